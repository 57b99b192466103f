"""``fedtier report``: plots of one or several runs (matplotlib, Agg) and a self-contained HTML page.

Each ``plot_*`` function takes loaded runs and returns a :class:`Plot`: the matplotlib figure and the
exact series it drew (``series[name] = (x, y)``, or a matrix for the heatmap), so what is on the
page can be checked against the records. Several runs share the axes (e.g. FedAvg vs HIST).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import rc_context
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from monitor.run_data import RoundPoint, RunData, heatmap, load_run
from protocols.checkpoint import write_durably
from protocols.records import TIERS

__all__ = ["Plot", "RunData", "load_run", "make_plots", "participation_matrix", "write_report"]

MB = 1e6


def unique_labels(runs: list[RunData]) -> None:
    """Make labels distinct by adding the folder name where two runs share one."""
    seen: dict[str, int] = {}
    for r in runs:
        seen[r.label] = seen.get(r.label, 0) + 1
    for r in runs:
        if seen[r.label] > 1:
            r.label = f"{r.label} [{r.path}]"


@dataclass
class Plot:
    """A figure, its file name and the data it shows."""

    name: str
    title: str
    figure: Figure
    series: dict[str, Any]
    note: str = ""
    """A line under the plot: which runs' series were thinned, and to how many points."""

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        return buf.getvalue()


def _figure(ncols: int = 1, nrows: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Figure, list]:
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _metric_plot(
    runs: list[RunData],
    name: str,
    title: str,
    xlabel: str,
    x_of: Callable[[RunData, RoundPoint], float],
    integer_x: bool = False,
) -> Plot:
    fig, (ax_acc, ax_loss) = _figure(2)
    series: dict[str, Any] = {}
    for run in runs:
        ev = run.evaluated
        x = [x_of(run, r) for r in ev]
        acc, loss = [r.accuracy for r in ev], [r.loss for r in ev]
        ax_acc.plot(x, acc, marker="o", markersize=3, label=run.label)
        ax_loss.plot(x, loss, marker="o", markersize=3, label=run.label)
        series[f"{run.label}/accuracy"] = (x, acc)
        series[f"{run.label}/loss"] = (x, loss)
    note = thinned_note(runs, evaluated=True)
    for ax, what in ((ax_acc, "test accuracy"), (ax_loss, "test loss")):
        ax.set_xlabel(xlabel)
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    return Plot(name, title, fig, series, note)


def thinned_note(runs: list[RunData], evaluated: bool) -> str:
    """What a plot says of the runs whose series it draws (``evaluated``: the rounds with an accuracy, else every
    round) were thinned to a bounded number of points (:mod:`monitor.round_series`); empty where none was."""
    said = []
    for run in runs:
        s = run.series
        count, drawn, width = (
            (s.evaluated_count, len(s.evaluated), s.evaluated_width) if evaluated else (s.count, len(s.points), s.width)
        )
        if drawn < count:
            what = "evaluated rounds" if evaluated else "rounds"
            said.append(
                f"{run.label}: {count:,} {what} drawn as {drawn:,} points (the first of each {width:,} rounds, "
                "with the last and the best-accuracy round)"
            )
    return "; ".join(said)


def plot_vs_round(runs: list[RunData]) -> Plot:
    return _metric_plot(
        runs,
        "metrics_vs_round",
        "Accuracy and loss per cloud round",
        "cloud round",
        lambda run, r: r.round + 1,
        integer_x=True,
    )


def plot_vs_bytes(runs: list[RunData]) -> Plot:
    return _metric_plot(
        runs,
        "metrics_vs_bytes",
        "Accuracy and loss vs cumulative bytes (all tiers)",
        "cumulative payload MB (all tiers)",
        lambda run, r: sum(r.cumulative_bytes.values()) / MB,
    )


def plot_vs_time(runs: list[RunData]) -> Plot:
    return _metric_plot(
        [r for r in runs if r.has_clock],
        "metrics_vs_time",
        "Accuracy and loss vs time",
        "seconds (loop clock: virtual in simulation)",
        lambda run, r: run.elapsed(r),
    )


def plot_vs_epsilon(runs: list[RunData]) -> Plot:
    """Accuracy and loss against the differential-privacy epsilon spent so far (runs with ``[privacy] dp``)."""
    return _metric_plot(
        [r for r in runs if r.has_epsilon],
        "metrics_vs_epsilon",
        "Accuracy and loss vs privacy spent (epsilon so far)",
        "epsilon so far",
        lambda run, r: r.epsilon if r.epsilon is not None else float("nan"),
    )


def plot_bytes_per_tier(runs: list[RunData]) -> Plot:
    """Left: total payload bytes per tier (bars per run); right: uplink bytes per round."""
    fig, (ax_tot, ax_round) = _figure(2)
    series: dict[str, Any] = {}
    width = 0.8 / max(1, len(runs))
    pos = np.arange(len(TIERS))
    for i, run in enumerate(runs):
        last = run.series.last.cumulative_bytes
        totals = [last.get(t, 0) / MB for t in TIERS]
        bars = ax_tot.bar(pos + (i - (len(runs) - 1) / 2) * width, totals, width, label=run.label)
        ax_tot.bar_label(bars, fmt="%.3g", fontsize="x-small", padding=1)
        series[f"{run.label}/total_mb"] = (list(TIERS), totals)
        for tier, style in (("device_to_cell", "-"), ("cell_to_cloud", "--")):
            x = [r.round + 1 for r in run.rounds]
            y = [r.bytes.get(tier, 0) / MB for r in run.rounds]
            ax_round.plot(x, y, style, marker=".", color=f"C{i}", label=f"{run.label} {tier.replace('_', ' ')}")
            series[f"{run.label}/{tier}"] = (x, y)
    ax_tot.set_xticks(pos, [t.replace("_to_", "\n→ ") for t in TIERS], fontsize="small")
    ax_tot.set_ylabel("payload MB (whole run)")
    ax_tot.legend(fontsize="small")
    ax_tot.grid(axis="y", alpha=0.3)
    ax_round.set_xlabel("cloud round")
    ax_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_round.set_ylabel("uplink payload MB per round")
    ax_round.set_title("solid: device → cell, dashed: cell → cloud", fontsize="small")
    ax_round.legend(fontsize="x-small")
    ax_round.grid(alpha=0.3)
    fig.suptitle("Bytes per tier")
    return Plot("bytes_per_tier", "Bytes per tier", fig, series, thinned_note(runs, evaluated=False))


def participation_matrix(run: RunData) -> tuple[list[str], list[str], np.ndarray]:
    """(the rows: devices grouped by cell, or cells where there are more than ``monitor.heatmap.MAX_ROWS`` devices;
    the cell of each row; matrix[row, column]): each entry is the share of its cell's edge rounds in that cloud round
    that the device answered (0: absent or not planned), or the mean of those shares over a bucket of a larger run
    (:mod:`monitor.heatmap`). The rounds are those of the cloud's records and of the cells' (a run stopped or in
    progress has aggregations of a round the cloud has not closed)."""
    heat = heatmap(run)
    return heat.rows, heat.cells, heat.matrix


def plot_participation(runs: list[RunData]) -> Plot:
    """One heatmap per run: devices (grouped by cell) x cloud rounds; bucketed past MAX_ROWS x MAX_COLUMNS."""
    heats = [heatmap(run) for run in runs]
    heights = [max(2.0, (0.18 if h.per_row == "device" else 0.06) * len(h.rows) + 1.2) for h in heats]
    fig = Figure(figsize=(8, sum(heights)), layout="constrained")
    axes = fig.subplots(len(runs), 1, squeeze=False, height_ratios=heights)[:, 0]
    series: dict[str, Any] = {}
    image = None
    for ax, run, heat in zip(axes, runs, heats):
        devices, cells, matrix = heat.rows, heat.cells, heat.matrix
        series[run.label] = {"devices": devices, "cells": cells, "matrix": matrix, "width": heat.width}
        image = ax.imshow(
            matrix,
            aspect="auto",
            cmap="Greens",
            vmin=0,
            vmax=1,
            interpolation="nearest",
            extent=(0.5, matrix.shape[1] * heat.width + 0.5, len(devices) - 0.5, -0.5),
        )
        every = 1 if heat.per_row == "device" else max(1, math.ceil(len(devices) / 40))  # bucketed: 0.06 in a row
        ticks = range(0, len(devices), every)
        ax.set_yticks(ticks, [devices[i] for i in ticks], fontsize="x-small" if len(devices) > 20 else "small")
        rows_are_devices = heat.per_row == "device" or heat.per_row.endswith("of a cell")
        for i in range(1, len(cells) if rows_are_devices else 0):  # (a row per cell: no lines between them)
            if cells[i] != cells[i - 1]:
                ax.axhline(i - 0.5, color="black", linewidth=1.2)
        ax.set_xlabel(heat.x_label())
        title = run.label if heat.per_row == "device" else f"{run.label}: a row per {heat.per_row}"
        ax.set_title(title, fontsize="medium")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="share of edge rounds answered", shrink=0.8)
    fig.suptitle("Participation (devices grouped by cell; lines separate cells)")
    return Plot("participation", "Participation heatmap", fig, series)


def plot_cell_durations(runs: list[RunData]) -> Plot:
    """Wall seconds of each aggregation (edge round) per cell; runs in separate line styles. A run whose records
    were folded (:mod:`monitor.run_data`) has a point per heatmap column: its mean over the column's rounds."""
    fig, (ax,) = _figure(1, width=9)
    series: dict[str, Any] = {}
    styles = ["-", "--", ":", "-."]
    widths = set()
    for i, run in enumerate(runs):
        for cell, (x, y) in _durations(run).items():
            ax.plot(x, y, styles[i % len(styles)], marker=".", label=f"{run.label} {cell}")
            series[f"{run.label}/{cell}"] = (x, y)
        widths.add(run.folded.heatmap.width if run.folded is not None else 1)
    bucketed = ", ".join(f"{w:,}" for w in sorted(widths - {1}))
    ax.set_xlabel(
        "cloud round (+ edge round / edge rounds)"
        + (f"; folded runs: the mean of each {bucketed} rounds at their middle" if bucketed else "")
    )
    ax.set_ylabel("aggregation wall seconds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="x-small", ncols=2)
    fig.suptitle("Per-cell aggregation duration")
    return Plot("cell_durations", "Per-cell aggregation duration", fig, series)


def _durations(run: RunData) -> dict[str, tuple[list[float], list[float]]]:
    """Per cell: (cloud round + edge round / edge rounds, wall seconds) of each aggregation, or the folded means."""
    if run.folded is not None:
        return run.folded.durations
    edges = max((r.edge_round for r in run.cells), default=0) + 1
    by_cell: dict[str, tuple[list[float], list[float]]] = {}
    for r in run.cells:
        x, y = by_cell.setdefault(r.cell, ([], []))
        x.append(r.round + 1 + r.edge_round / edges)
        y.append(r.duration_s)
    return dict(sorted(by_cell.items()))


def make_plots(runs: list[RunData]) -> list[Plot]:
    """Every plot of the report; the time plot only when some run's clock moved. Labels and cell names are the
    records' text, drawn as written: a ``$`` in one is no mathtext (``$\\bad$`` failed the report)."""
    with rc_context({"text.parse_math": False}):
        return _make_plots(runs)


def _make_plots(runs: list[RunData]) -> list[Plot]:
    plots = [plot_vs_round(runs), plot_vs_bytes(runs)]
    if any(r.has_clock for r in runs):
        plots.append(plot_vs_time(runs))
    if any(r.has_epsilon for r in runs):
        plots.append(plot_vs_epsilon(runs))
    plots += [plot_bytes_per_tier(runs), plot_participation(runs), plot_cell_durations(runs)]
    return plots


def _summary_rows(runs: list[RunData]) -> str:
    rows = []
    for run in runs:
        last, final = run.series.last, run.series.last_evaluated
        acc = final.accuracy if final is not None else None
        cells = [
            run.label,
            str(run.path),
            str(run.series.count),
            "-" if acc is None else f"{acc:.4f}",
            f"{sum(last.cumulative_bytes.values()) / MB:,.2f}",
            f"{run.mean_participation:.0%}" if run.mean_participation is not None else "-",
            f"{last.epsilon:.3g}" if last.epsilon is not None else "-",
            f"{run.summary['wall_s']:.1f}" if isinstance(run.summary.get("wall_s"), (int, float)) else "-",
            str(len(run.bad)),
            run.ended,
        ]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def write_report(
    run_dirs: list[str | Path],
    out: str | Path,
    on_bad: Callable[[str], None] | None = None,
    on_unfinished: Callable[[str, str], None] | None = None,
) -> tuple[Path, list[Plot]]:
    """Write ``out`` (HTML, plots embedded) and its PNGs in ``<out stem>_plots/``; return both. The invalid lines
    of the records (a run killed mid-write ends in half a line) are skipped, listed in the page, and passed to
    ``on_bad``; each run that did not finish goes to ``on_unfinished`` (its folder, how it ended: also in the page)."""
    runs = [load_run(p) for p in run_dirs]
    for run in runs:
        if run.ended != "finished" and on_unfinished is not None:
            on_unfinished(str(run.path), run.ended)
    for run in runs:  # the first ones of each run (protocols.records.KEPT_BAD_LINES), then how many more
        for line in run.bad:
            if on_bad is not None:
                on_bad(str(line))
        if on_bad is not None and len(run.bad) > len(run.bad.first):
            on_bad(f"{run.path}: {len(run.bad) - len(run.bad.first):,} more not listed ({len(run.bad):,} in all)")
    unique_labels(runs)
    plots = make_plots(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png_dir = out.with_name(out.stem + "_plots")
    png_dir.mkdir(exist_ok=True)
    sections = []
    for plot in plots:
        data = plot.png()
        (png_dir / f"{plot.name}.png").write_bytes(data)
        sections.append(
            f'<h2>{html.escape(plot.title)}</h2>\n<img alt="{plot.name}" '
            f'src="data:image/png;base64,{base64.b64encode(data).decode()}">'
            + (f'\n<p class="note">Downsampled: {html.escape(plot.note)}.</p>' if plot.note else "")
        )
    bad = [str(b) for run in runs for b in run.bad] + [
        f"{run.path}: {len(run.bad) - len(run.bad.first):,} more ({len(run.bad):,} in all)"
        for run in runs
        if len(run.bad) > len(run.bad.first)
    ]
    page = _PAGE.format(
        title=html.escape("fedtier report: " + ", ".join(r.label for r in runs)),
        rows=_summary_rows(runs),
        sections="\n".join(sections),
        bad=("<h2>Invalid records (skipped)</h2><pre>" + html.escape("\n".join(bad)) + "</pre>") if bad else "",
    )
    write_durably(out, page.encode("utf-8"), private=False)  # a full disk leaves the old page whole, not half a new
    return out, plots


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;max-width:1300px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}
td:first-child,td:nth-child(2),td:last-child{{text-align:left}}
img{{max-width:100%;border:1px solid #eee}}</style></head>
<body><h1>{title}</h1>
<table><tr><th>run</th><th>folder</th><th>rounds</th><th>final accuracy</th><th>total payload MB</th>
<th>mean participation</th><th>epsilon</th><th>wall s</th><th>invalid lines</th><th>ended</th></tr>
{rows}
</table>
{sections}
{bad}
</body></html>
"""
