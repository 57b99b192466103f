"""``fedtier monitor``: a live terminal view of a run's cells, from its folder or from the broker."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from fedtier.cli import auth_options, main
from fedtier.cli_types import SECONDS, Finite
from fedtier.console import (
    INTERRUPTED,
    JOB_FAILED,
    fail,
    live_connection,
    live_target,
    public_keys_or_exit,
    refuse_federation_folder,
)
from protocols.terminal import SafeConsole

if TYPE_CHECKING:
    from fedtier.console import LiveTarget
    from monitor.live import LiveView


@contextmanager
def sigterm_leaves_as_ctrl_c() -> Iterator[None]:
    """SIGTERM (``kill``, ``systemctl stop``, a CI job's timeout) leaves the view as Ctrl-C does: where the output is
    no terminal, its last frame is written (it died with nothing more said)."""

    def leave(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@main.command()
@click.argument("run_dir", required=False, type=click.Path(file_okay=False))
@click.option("--broker", metavar="URL", help="Subscribe to the run's telemetry on this broker (mqtt://host:port).")
@click.option("--run", "run_name", metavar="NAME", help="Run name (with --broker).")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False),
    metavar="FILE",
    help="A config for the live view, e.g. the monitor bundle's config.toml of `fedtier provision` (run "
    "from inside the bundle): the broker (URL, user, password, TLS files), the run name and the keys "
    "that check signatures; the flags override it.",
)
@auth_options
@click.option(
    "--keys",
    "keys_file",
    type=click.Path(dir_okay=False),
    metavar="FILE",
    help="With --broker, a signed run: a keys file with the cloud's and the cells' public keys (the "
    "run's keys.toml, the cloud's share or the monitor bundle's); records and statuses not signed by "
    "the node their topic names are rejected (counted as bad records).",
)
@click.option("--once", is_flag=True, help="Render one frame to stdout and exit (scripts, tests).")
@click.option(
    "--wait",
    type=SECONDS,
    default=3.0,
    show_default=True,
    metavar="SECONDS",
    help="With --broker: listen this long at most for the broker's records before the first frame (--once) or, "
    "where the output is no terminal, the first lines (stops 1 s after telemetry went quiet).",
)
@click.option(
    "--refresh",
    type=Finite(min=0.05),
    default=0.5,
    show_default=True,
    metavar="SECONDS",
    help="Seconds between frames.",
)
@click.option(
    "--deadline",
    type=Finite(min=0, min_open=True),
    metavar="SECONDS",
    help="Flag a cell silent after this many seconds (default: the device deadline its records carry).",
)
@click.option(
    "--drop",
    "drop_ratio",
    type=Finite(0, 1),
    default=0.75,
    show_default=True,
    metavar="FRACTION",
    help="Flag a cell whose participation falls below this fraction of its recent mean.",
)
@click.option(
    "--exit-when-done",
    is_flag=True,
    help="Leave once the cloud's last round is in (exit 3 when the run failed); on a federation, once no job is "
    "running or queued.",
)
@click.option(
    "--width",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Frame width (default: the terminal's; 80 where the output is none, e.g. the last frame in a log).",
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Rows at most; with more cells, those that matter most (see --sort).",
)
@click.option(
    "--sort",
    type=click.Choice(["severity", "lag", "drop", "silent", "name"]),
    default=None,
    help="Row order (default: name when every cell fits, else severity: silent, offline, drop, then lag).",
)
@click.option("--cell", "patterns", multiple=True, metavar="GLOB", help="Only cells matching (e.g. 'c1*'; repeatable).")
@click.option(
    "--state",
    "states",
    multiple=True,
    type=click.Choice(["silent", "offline", "drop", "revoked", "waiting", "idle", "ok", "ended"]),
    help="Only cells in this state (repeatable).",
)
def monitor(
    run_dir: str | None,
    broker: str | None,
    run_name: str | None,
    config_path: str | None,
    keys_file: str | None,
    once: bool,
    wait: float,
    refresh: float,
    deadline: float | None,
    drop_ratio: float,
    exit_when_done: bool,
    width: int | None,
    top: int,
    sort: str | None,
    patterns: tuple[str, ...],
    states: tuple[str, ...],
    **auth: str | None,
) -> None:
    """Watch a run's cells: participation, bytes, loss, lag behind the cloud, alerts.

    Follow a run folder (RUN_DIR, tailing its JSON-lines logs) or a live run's telemetry topics
    (--broker mqtt://host:port --run NAME, or --config with the broker and the run in it). A summary
    line counts the cells per state; with many cells the table shows the --top that matter most
    (--sort, --cell, --state narrow it). Ctrl-C or SIGTERM leaves.
    """
    from monitor.live import LiveView
    from monitor.sources import RunDirFollower
    from monitor.view import CellFilter

    if config_path is not None and run_dir is not None:
        fail("--config is for the live view: give RUN_DIR or --config, not both", 2)
    target = live_target(config_path, broker, run_name, keys_file, auth)
    if config_path is not None and target.broker is None:
        fail(f"{config_path} names no broker ([broker] url): give --broker URL", 2)
    if (run_dir is None) == (target.broker is None):
        fail("give either RUN_DIR or --broker URL --run NAME (or --config)", 2)
    if target.keys_file is not None and target.broker is None:
        fail(
            "--keys checks the signatures of live telemetry: it goes with --broker (a run folder's logs are "
            "not signed)",
            2,
        )
    flt = CellFilter(patterns=patterns, states=states, top=top, sort=sort)
    watch = LiveView(drop_ratio, deadline, flt, SafeConsole(width=width) if width else SafeConsole())
    if run_dir is not None:
        refuse_federation_folder(run_dir)
        if once and not Path(run_dir).is_dir():
            fail(f"{run_dir} is not a run folder", 2)
        with sigterm_leaves_as_ctrl_c():
            watch.follow(RunDirFollower(run_dir), once, wait, refresh, exit_when_done)  # it may not exist yet
        return exit_if_run_failed(watch, exit_when_done)
    if not target.run:
        fail("--broker needs --run NAME", 2)
    _follow_live(target, watch, once, wait, refresh, exit_when_done)
    exit_if_run_failed(watch, exit_when_done)


def _follow_live(
    target: LiveTarget, watch: LiveView, once: bool, wait: float, refresh: float, exit_when_done: bool
) -> None:
    """``watch`` follows ``target``'s live telemetry (:meth:`LiveView.follow`) on a connection of its own, whose loss
    its view and log say ("broker connection lost"): the connection's own line is said at info (walked: both lines
    at each drop)."""
    from monitor.sources import TelemetryFeed

    assert target.run is not None  # (the caller checked it)
    keys = public_keys_or_exit(target.keys_file)
    with sigterm_leaves_as_ctrl_c(), live_connection(target, "monitor", wait if once else None) as transport:
        transport.own_drop_line = True
        feed = TelemetryFeed(transport, target.run, keys).start()
        watch.state.run = target.run
        watch.follow(feed, once, wait, refresh, exit_when_done)


def exit_if_run_failed(watch: Any, exit_when_done: bool) -> None:
    """With ``--exit-when-done``, a run that failed exits with :data:`JOB_FAILED`, one whose process ended before it
    did (killed) with :data:`INTERRUPTED`, as that process would have: a script waiting on the monitor learns it (a
    finished or stopped run: 0)."""
    cloud = watch.state.states.get("cloud", {})
    if exit_when_done and cloud.get("phase") == "failed":
        raise SystemExit(JOB_FAILED)
    if exit_when_done and cloud.get("interrupted") is True:
        raise SystemExit(INTERRUPTED)
