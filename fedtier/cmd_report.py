"""``fedtier report``: an HTML page of plots for one run, or several overlaid (e.g. FedAvg vs HIST)."""

from __future__ import annotations

from pathlib import Path

import click

from fedtier.cli import main
from fedtier.console import console, fail, refuse_federation_folder


@main.command()
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="HTML file to write (default: RUN_DIR/report.html for one run, ./report.html for several).",
)
def report(run_dirs: tuple[str, ...], out: str | None) -> None:
    """Plot RUN_DIRS: accuracy and loss vs round, bytes and time; bytes per tier; participation;
    per-cell aggregation durations. Writes a self-contained HTML page and the PNGs next to it."""
    for run_dir in run_dirs:
        refuse_federation_folder(run_dir)
    import matplotlib

    matplotlib.use("Agg")
    from rich.markup import escape

    from monitor.report import write_report
    from monitor.run_data import NotARunFolder

    target = Path(out) if out else (Path(run_dirs[0]) / "report.html" if len(run_dirs) == 1 else Path("report.html"))

    def warn(line: str) -> None:  # also listed in the report
        console.print(f"[yellow]warning:[/] invalid record skipped: {escape(line)}", highlight=False)

    def unfinished(folder: str, ended: str) -> None:  # a failed job's plots look like any other's
        console.print(f"[yellow]note:[/] {escape(folder)} did not finish: {escape(ended)}", highlight=False)

    try:
        path, plots = write_report(list(run_dirs), target, on_bad=warn, on_unfinished=unfinished)
    except NotARunFolder as exc:  # a cell's job folder: the wrong folder given, as a federation's is (exit 2)
        fail(str(exc), 2)
    except ValueError as exc:  # a run folder with nothing to plot (no round closed): 1
        fail(str(exc), 1)
    except OSError as exc:  # --out in a missing or read-only folder, a full disk
        fail(f"cannot write the report {target}: {exc.strerror or exc}", 1)
    console.print(
        f"wrote [bold]{path}[/] ({len(plots)} plots, PNGs in {path.with_name(path.stem + '_plots')})", highlight=False
    )
