"""What ``fedtier monitor`` shows: the rendering of a :class:`~monitor.state.MonitorState`.

:func:`render` turns the state into a rich renderable for a given wall-clock ``now``: a summary line,
and the rows of the cells that matter most (all of them when they fit in ``top``), so that a fleet of
a thousand cells stays readable; :class:`CellFilter` narrows the rows to some cells or states. No I/O here.
"""

from __future__ import annotations

import fnmatch
import io
import time as _time
from collections import Counter
from dataclasses import dataclass

from rich.console import Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from protocols.round_text import nth, nth_edge
from protocols.terminal import SafeConsole

from .state import STATES, CellView, MonitorState, phase_name, waiting_text

SPARK = "▁▂▃▄▅▆▇█"
SORTS = ("severity", "lag", "drop", "silent", "name")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def sparkline(values: list[float], width: int = 30) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - lo) / span * (len(SPARK) - 1) + 0.5))] for v in values)


def _ago(now: float, then: float | None) -> str:
    if then is None:
        return "never"
    s = max(0.0, now - then)
    return f"{s:.1f} s ago" if s < 60 else f"{s / 60:.1f} min ago" if s < 3600 else f"{s / 3600:.1f} h ago"


_STATE_STYLE = {
    "silent": ("SILENT", "bold red"),
    "offline": ("offline", "red"),
    "drop": ("DROP", "bold yellow"),
    "revoked": ("revoked", "magenta"),
    "waiting": ("waiting", "dim"),
    "idle": ("idle", "cyan"),
    "ok": ("ok", "green"),
    "ended": ("ended", "green"),
}


@dataclass(frozen=True)
class CellFilter:
    """Which cells the table shows, and how many: ``patterns`` (globs on the cell id, any matches),
    ``states`` (of :data:`STATES`), at most ``top`` rows ordered by ``sort`` (one of :data:`SORTS`;
    default: by name when every selected cell fits, else by severity)."""

    patterns: tuple[str, ...] = ()
    states: tuple[str, ...] = ()
    top: int = 20
    sort: str | None = None

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ValueError("top must be at least 1")
        if self.sort is not None and self.sort not in SORTS:
            raise ValueError(f"sort must be one of {', '.join(SORTS)}")
        if set(self.states) - set(STATES):
            raise ValueError(f"states must be among {', '.join(STATES)}")


@dataclass
class _Row:
    view: CellView
    state: str
    lag: int | None
    quiet: float  # seconds since last seen (0: never seen)
    drop: float  # latest / mean participation (1: no drop known)


def _rows(state: MonitorState, now: float, flt: CellFilter) -> tuple[list[_Row], int]:
    """The rows to show, and how many cells the filter selected."""
    rows = []
    for cell, view in state.cells.items():
        if flt.patterns and not any(fnmatch.fnmatchcase(cell, p) for p in flt.patterns):
            continue
        st = state.state_of(view, now)
        if flt.states and st not in flt.states:
            continue
        drop = state.dropped(view)
        rows.append(
            _Row(
                view,
                st,
                state.lag(view),
                now - view.last_seen if view.last_seen is not None else 0.0,
                drop[0] / drop[1] if drop else 1.0,
            )
        )
    sort = flt.sort or ("name" if len(rows) <= flt.top else "severity")
    keys = {
        "name": lambda r: r.view.cell,
        "severity": lambda r: (STATES.index(r.state), -(r.lag or 0), r.drop, -r.quiet, r.view.cell),
        "lag": lambda r: (-(r.lag or 0), r.view.cell),
        "drop": lambda r: (r.drop, r.view.cell),
        "silent": lambda r: (-r.quiet, r.view.cell),
    }
    rows.sort(key=keys[sort])
    return rows[: flt.top], len(rows)


def cell_table(state: MonitorState, now: float, flt: CellFilter | None = None) -> Table:
    """The cells selected by ``flt`` (default: the 20 that matter most), and a last row for the others."""
    flt = flt or CellFilter()
    table = Table(expand=False, header_style="bold")
    for name, justify in (
        ("cell", "left"),
        ("round", "right"),
        ("answered", "right"),
        ("bytes in/out", "right"),
        ("loss", "right"),
        ("lag", "right"),
        ("closed by", "left"),
        ("last seen", "right"),
        ("state", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    rows, selected = _rows(state, now, flt)
    for row in rows:
        view, rec, lag = row.view, row.view.last, row.lag
        status = Text(*_STATE_STYLE[row.state])
        if rec is None:
            last = state.states.get(f"cell.{view.cell}", {}).get("round")  # its retained state's round, if any
            table.add_row(
                Text(view.cell),
                nth(last) if isinstance(last, int) else "-",
                "-",
                "-",
                "-",
                str(lag) if lag is not None else "-",
                "-",
                _ago(now, view.last_seen),
                status,
            )
            continue
        part = rec.participation
        answered = (
            f"{len(rec.answered)}/{len(rec.planned)}"
            + (f" ({part:.0%})" if part is not None else "")
            + (f" of {rec.cell_size}" if rec.cell_size != len(rec.planned) else "")
        )
        loss = (
            "-"
            if rec.loss_mean is None
            else f"{rec.loss_mean:.4f}" + (f" ± {rec.loss_std:.3f}" if rec.loss_std is not None else "")
        )
        table.add_row(
            Text(view.cell),  # Text: what came from the network is shown as it is, never read as markup
            nth_edge(rec.round, rec.edge_round),  # from 1, as the cloud's "round 20/20"
            answered,
            f"{human_bytes(rec.bytes_in)} / {human_bytes(rec.bytes_out)}",
            loss,
            Text(str(lag), style="yellow" if lag else ""),
            Text(rec.closed_by),
            _ago(now, view.last_seen),
            status,
        )
    if selected > len(rows):
        table.add_row(Text(f"... {selected - len(rows)} more", style="dim"), *[""] * 8)
    return table


def summary_line(state: MonitorState, now: float) -> Text:
    """Counts of cells per state, devices answered in the cells' latest aggregations, the largest lag."""
    views = list(state.cells.values())
    counts = Counter(state.state_of(v, now) for v in views)
    text = Text.assemble(("cells ", "bold"), f"{len(views)}: ")
    text.append(", ".join(f"{counts[s]} {s}" for s in STATES if counts[s]) or "none")
    answered = sum(len(v.last.answered) for v in views if v.last is not None)
    planned = sum(len(v.last.planned) for v in views if v.last is not None)
    if planned:
        text.append(f"  devices answered {answered}/{planned} ({answered / planned:.0%})")
    lags = [lag for v in views if (lag := state.lag(v))]
    if lags:
        text.append(f"  behind: {len(lags)} cells, up to {max(lags)} rounds", style="yellow")
    return text


def link_line(state: MonitorState, now: float, log: bool = False) -> Text | None:
    """The monitor's own broker connection, once it was ever lost: down since when (the rest is as last heard), or
    (``log``: a line when it comes back) back."""
    if state.link_lost is not None:
        since = "" if log else f" {now - state.link_lost:.0f} s ago"
        lost = f"connection lost{since}, reconnecting: the cells and rounds below are as last heard"
        return Text.assemble(("broker ", "bold"), (lost, "bold red"))
    if log and state.link_losses:
        return Text.assemble(("broker ", "bold"), ("connection back", "green"))
    return None


def state_line(state: MonitorState, now: float) -> Text | None:
    """What the cloud is doing now (its retained state): the open round, since when, whom it waits for."""
    s = state.states.get("cloud")
    if s is None:
        return None
    text = Text.assemble(("now ", "bold"))
    phase = s.get("phase")
    if phase == "waiting":
        text.append(f"round {nth(s.get('round'))}: {waiting_text(s)} for {now - s['since']:.0f} s")
        deadline = s.get("deadline_s")
        if isinstance(deadline, (int, float)) and now - s["since"] > deadline:
            text.append(f" (deadline {deadline:g} s passed)", style="bold red")
    else:  # an end is a moment ("finished 91 s ago"), any other phase lasts ("idle for 3 s")
        when = f"{now - s['since']:.0f} s ago" if phase in ENDS else f"for {now - s['since']:.0f} s"
        text.append(phase_name(phase) + (f": {s['reason']}" if s.get("reason") else "") + f" {when}")
    started = state.started()
    if started is not None:
        text.append(f"  run started {now - started:.0f} s ago")
    return text


def cloud_line(state: MonitorState, now: float, log: bool = False) -> Text:
    """The cloud's last closed round and its figures (``log``: as a line of a log, without the accuracy's sparkline
    and the time since it came, which change while nothing happens)."""
    c = state.cloud
    if c is None and state.cell_folder:
        return cell_folder_line(state.cell_folder)
    if c is None and state.folder_missing:  # (a monitor started before its run)
        return Text(f"cloud: {state.folder} does not exist yet: waiting for the run to start", style="dim")
    if c is None:
        s = state.states.get("cloud", {})
        if (ended := ended_line(s)) is not None:
            return ended
        if isinstance(closed := s.get("round"), int) and closed > 0:  # walked: "no round closed yet" at round 32
            before = f"{closed} round{'s' if closed > 1 else ''} closed before this monitor started"
            return Text(f"cloud: {before} (their records are in the cloud's run folder)", style="dim")
        return Text("cloud: no round closed yet", style="dim")
    total = f"/{c.rounds}" if c.rounds else ""
    text = Text.assemble(("cloud ", "bold"), f"round {nth(c.round)}{total} closed ({c.closed_by}), ")
    if state.accuracy:
        text.append(f"accuracy {state.accuracy[-1][1]:.4f} ", style="bold cyan")
        text.append("" if log else sparkline([a for _, a in state.accuracy]) + " ")
    if c.loss is not None:
        text.append(f"loss {c.loss:.4f}  ")
    if c.epsilon is not None:
        text.append(f"ε {c.epsilon:.3g}  ", style="magenta")
    text.append(f"bytes {human_bytes(sum(c.cumulative_bytes.values()))}  ")
    if not log:
        text.append(f"last {_ago(now, state.cloud_seen)}")
    if state.finished:
        phase = str(state.states.get("cloud", {}).get("phase"))  # a failed job ended too: say how
        styles = {"failed": "bold red", "stopped": "bold yellow"}
        text.append(f"  {phase if phase in styles else 'finished'}", style=styles.get(phase, "bold green"))
    return text


ENDS = {"finished": "bold green", "stopped": "bold yellow", "failed": "bold red"}


def cell_folder_line(cells: list[dict]) -> Text:
    """A cell's own job folder (``fedtier cell --serve``): whose it is, and that it holds the cell's records only."""
    names = ", ".join(str(c["cell"]) for c in cells)  # (a Text: no markup read in them)
    jobs = ", ".join(sorted({str(c["job"]) for c in cells}))
    text = Text.assemble((f"cell {names}", "bold"), f"'s job folder (job {jobs}): ")
    text.append("its own aggregation records only; the job's rounds are in the cloud's job folder (or --broker)")
    return text


def ended_line(s: dict) -> Text | None:
    """A job that ended before this monitor came (no round record: telemetry is not retained), as the cloud's
    retained end state says it: how it ended, its rounds and last figures; None for a job that goes on."""
    phase = s.get("phase")
    if phase not in ENDS:
        return None
    total = f"/{s['rounds']}" if isinstance(s.get("rounds"), int) else ""
    when = f" after round {s['round']}{total}" if s.get("round") is not None else " before its first round closed"
    text = Text.assemble(("cloud ", "bold"), (f"{phase}", ENDS[phase]), when)
    for key in ("accuracy", "loss"):
        if s.get(key) is not None:
            text.append(f", {key} {s[key]:.4f}", style="bold cyan" if key == "accuracy" else "")
    if not s.get("interrupted"):  # (a killed run's own folder: what it has is here)
        text.append("  (ended before this monitor started: its rounds are in the cloud's run folder)", style="dim")
    return text


def jobs_line(state: MonitorState, now: float, log: bool = False) -> Text | None:
    """A federation's jobs, from the cloud's signed list: the running one, how many wait, the last that ended (when,
    unless ``log``)."""
    if not state.jobs:
        return None
    running = [j["job"] for j in state.jobs if j["state"] == "running"]
    queued = sum(j["state"] == "queued" for j in state.jobs)
    ended = [j for j in state.jobs if j["state"] in ("finished", "failed", "cancelled") and j["ended"] is not None]
    text = Text.assemble(("jobs ", "bold"), f"running {', '.join(running) or 'none'}, {queued} queued")
    if ended:
        last = max(ended, key=lambda j: j["ended"])
        style = {"finished": "green", "failed": "bold red"}.get(last["state"], "yellow")
        text.append("; last ended: ")
        text.append(f"{last['job']} {last['state']}", style=style)
        text.append((f": {last['reason']}" if last["reason"] else "") + ("" if log else f" {_ago(now, last['ended'])}"))
    return text


def render(state: MonitorState, now: float | None = None, flt: CellFilter | None = None) -> Group:
    """The monitor frame: header, cloud line, cell summary, the rows ``flt`` selects, alerts."""
    now = _time.time() if now is None else now
    alerts = state.alerts(now)
    alert_text = (
        Text("\n".join(f"! {a}" for a in alerts), style="bold red") if alerts else Text("no alerts", style="green")
    )
    title = f"fedtier monitor: {escape(state.title)}  ({len(state.cells)} cells)"
    current, jobs, link = state_line(state, now), jobs_line(state, now), link_line(state, now)
    body = Group(
        *((link,) if link is not None else ()),
        cloud_line(state, now),
        *((current,) if current is not None else ()),
        *((jobs,) if jobs is not None else ()),
        summary_line(state, now),
        cell_table(state, now, flt),
    )
    return Group(
        Panel(body, title=title, title_align="left", expand=False),
        Panel(alert_text, title="alerts", title_align="left", expand=False),
    )


def render_text(state: MonitorState, now: float | None = None, width: int = 140, flt: CellFilter | None = None) -> str:
    """The frame as plain text (for ``--once`` in scripts and for tests)."""
    console = SafeConsole(width=width, file=io.StringIO(), color_system=None)
    console.print(render(state, now, flt))
    return console.file.getvalue()  # type: ignore[attr-defined]
