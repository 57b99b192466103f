"""``fedtier monitor``: a live terminal view of a run's cells, from its folder or from the broker."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live

from fedtier.cli import auth_options, main
from fedtier.console import fail, load_or_exit


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
    type=float,
    default=3.0,
    show_default=True,
    help="With --once --broker: listen this long at most (stops 1 s after telemetry went quiet).",
)
@click.option("--refresh", type=float, default=0.5, show_default=True, help="Seconds between frames.")
@click.option(
    "--deadline",
    type=float,
    help="Flag a cell silent after this many seconds (default: the device deadline its records carry).",
)
@click.option(
    "--drop",
    "drop_ratio",
    type=float,
    default=0.75,
    show_default=True,
    help="Flag a cell whose participation falls below this fraction of its recent mean.",
)
@click.option("--exit-when-done", is_flag=True, help="Leave once the cloud's last round is in.")
@click.option("--width", type=int, default=None, help="Frame width for --once (default: the terminal's).")
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
    type=click.Choice(["silent", "offline", "drop", "waiting", "ok"]),
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
    (--sort, --cell, --state narrow it). Ctrl-C leaves.
    """
    from monitor.sources import RunDirFollower, TelemetryFeed, wait_quiet
    from monitor.view import CellFilter, MonitorState, render

    if config_path is not None:
        if run_dir is not None:
            fail("--config is for the live view: give RUN_DIR or --config, not both", 2)
        cfg = load_or_exit(config_path, ())
        broker, run_name = broker or cfg.broker.url, run_name or cfg.run.name
        keys_file = keys_file or cfg.security.keys
        auth = {k: v if v is not None else getattr(cfg.broker, k) for k, v in auth.items()}
        if broker is None:
            fail(f"{config_path} names no broker ([broker] url): give --broker URL", 2)
    if (run_dir is None) == (broker is None):
        fail("give either RUN_DIR or --broker URL --run NAME (or --config)", 2)
    if keys_file is not None and broker is None:
        fail(
            "--keys checks the signatures of live telemetry: it goes with --broker (a run folder's logs are "
            "not signed)",
            2,
        )
    state = MonitorState(drop_ratio=drop_ratio, deadline=deadline)
    flt = CellFilter(patterns=patterns, states=states, top=top, sort=sort)
    feed: RunDirFollower | TelemetryFeed
    if broker is not None:
        if not run_name:
            fail("--broker needs --run NAME", 2)
        from protocols.transport.mqtt import MqttTransport
        from protocols.transport.threadloop import ThreadLoop
        from protocols.wire.keys import KeysError, load_public_keys

        try:
            keys = load_public_keys(keys_file) if keys_file is not None else None
        except KeysError as exc:
            fail(str(exc), 2)
        loop = ThreadLoop("fedtier-monitor").start()
        try:
            transport = MqttTransport.from_url(broker, f"monitor-{uuid.uuid4().hex[:8]}", loop, **auth).connect()
        except (ConnectionError, ValueError) as exc:
            loop.stop()
            fail(str(exc), 1)
        feed = TelemetryFeed(transport, run_name, keys).start()
        state.run = run_name
    else:
        if once and not Path(run_dir).is_dir():
            fail(f"{run_dir} is not a run folder", 2)
        feed = RunDirFollower(run_dir)  # it may not exist yet: the run creates it

    restarts = 0

    def pull() -> None:
        nonlocal state, restarts
        records, bad, statuses = feed.poll()
        if isinstance(feed, RunDirFollower) and feed.restarts != restarts:  # a new run in the folder
            restarts, state = feed.restarts, MonitorState(drop_ratio=drop_ratio, deadline=deadline)
        now = time.time() if broker is not None else None  # a folder: trust the records' own time
        state.add_all(records, bad, received=now)
        for node, s in statuses:
            state.add_status(node, s, time.time())
        if isinstance(feed, TelemetryFeed):
            for current in feed.poll_states():
                state.add_state(current)

    out = Console(width=width) if width else Console()
    try:
        if once:
            if isinstance(feed, TelemetryFeed):
                wait_quiet(feed, quiet=min(1.0, wait), timeout=wait)
            pull()
            out.print(render(state, flt=flt))
            return
        with Live(render(state, flt=flt), console=out, auto_refresh=False, transient=False) as live:
            while True:
                pull()
                live.update(render(state, flt=flt), refresh=True)
                if exit_when_done and state.finished:
                    return
                time.sleep(refresh)
    except KeyboardInterrupt:
        pass
    finally:
        if isinstance(feed, TelemetryFeed):
            feed.close()
            loop.stop()
