"""Shared terminal output for the CLI: progress over rounds, summaries, config loading with errors."""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from protocols.config import ConfigError, RunConfig, load_config, shown
from protocols.safe_text import SafeFormatter
from protocols.terminal import SafeConsole

if TYPE_CHECKING:
    from protocols.transport.mqtt import MqttTransport
    from protocols.wire.keys import PublicKeys


class CliConsole(SafeConsole):
    """The CLI's stderr. Off a terminal (a journal, a log file, a pipe, a CI log) a printed line is never broken at
    80 columns: `fedtier provision` said 'broker config in fed/broker (mosquitto -c' and 'fed/broker/mosquitto.conf)'
    on two lines, `fedtier partition` and `fedtier report` broke their paths so, as a serving node's start line was.
    A terminal wraps as before; a call may still say ``soft_wrap=``."""

    @property
    def soft_wrap(self) -> bool:
        return not self.is_terminal

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:  # rich's constructor sets it: this console decides by its output
        pass


console = CliConsole(stderr=True)


def output_console() -> SafeConsole:
    """Where a command writes its output (a table): stdout; off a terminal (a pipe, a file) 200 columns wide, so a
    row is not squeezed into 80 columns and broken mid-word."""
    out = SafeConsole()
    return out if out.is_terminal else SafeConsole(width=200)


PLAIN_LOG_FORMAT = "[%(asctime)s] %(levelname)-8s %(message)s"
"""A log record where stderr is no terminal (a journal, a file, a pipe): the terminal's columns, on one line."""


class _ConsoleStreamHandler(logging.StreamHandler):
    """A plain handler writing where the CLI's console writes now (its stderr of the moment, as rich's handler
    does), not to the stream of when it was set up."""

    @property
    def stream(self) -> Any:
        return console.file

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(verbose: int) -> None:
    """Log at WARNING (``-v``: INFO, ``-vv``: DEBUG) on the CLI's :class:`SafeConsole`, peer text escaped. Where
    stderr is no terminal, a record is one plain line: rich's handler wraps it at 80 columns there (a warning of a
    serving node's journal was two or three entries, a path in it broken), or pads it to any wider width."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler: logging.Handler
    if console.is_terminal:
        handler = RichHandler(console=console, show_path=False)
        handler.setFormatter(SafeFormatter("%(message)s", datefmt="[%X]"))  # a log file's rule, not only the console's
    else:
        handler = _ConsoleStreamHandler()
        handler.setFormatter(SafeFormatter(PLAIN_LOG_FORMAT, datefmt="%X"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def load_or_exit(path: str, overrides: tuple[str, ...]) -> RunConfig:
    """Load a config; on a bad one print the error (naming the keys) and exit with status 2."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as exc:
        print_error(exc)
        sys.exit(2)
    refuse_files_left_beside(cfg, path)
    return cfg


FILE_KEYS = (("security", "keys"), ("broker", "ca_certs"), ("broker", "certfile"), ("broker", "keyfile"))
"""The files a node's bundle ``config.toml`` names relative to its own folder (`fedtier provision`)."""


def refuse_files_left_beside(cfg: RunConfig, path: str) -> None:
    """A config read from another folder than its own whose relative file names are missing here but found beside
    it (a node's bundle, ``fedtier submit JOB --config fed/nodes/operator/config.toml``): exit 2 saying where to run
    the command (each file is opened from the current folder; it said "security.keys: cannot read keys.toml")."""
    folder = Path(path).parent
    beside = [
        f"{section}.{key} = {shown(name)}"
        for section, key in FILE_KEYS
        if isinstance(name := getattr(getattr(cfg, section), key), str)
        and not Path(name).is_absolute()
        and not Path(name).exists()
        and (folder / name).exists()
    ]
    if beside:
        fail(
            f"{path} names its files relative to its own folder ({', '.join(beside)}), and this command opens them "
            f"from the current one: run it from {folder} (cd {folder}), naming the config {Path(path).name}",
            2,
        )


def load_deployment_or_exit(path: str, overrides: tuple[str, ...]) -> RunConfig:
    """:func:`load_or_exit` for a deployment command: DP noise drawn from the OS unless the config sets an
    integer ``privacy.noise_seed`` (then a warning says who can remove the noise)."""
    from protocols.config import deployment_config

    cfg, warning = deployment_config(load_or_exit(path, overrides))
    if warning is not None:
        console.print(f"[bold yellow]warning:[/] {warning}")
    return cfg


@contextmanager
def round_progress(cfg: RunConfig, enabled: bool = True) -> Iterator[Callable[[dict[str, Any]], None]]:
    """A progress bar over cloud rounds; yields the ``on_round`` callback that advances it."""
    if not enabled:
        yield lambda record: None
        return
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task(f"{cfg.run.name} ({cfg.train.name})", total=cfg.run.rounds, status="")

        def on_round(record: dict[str, Any]) -> None:
            status = f"acc {record['accuracy']:.4f}" if "accuracy" in record else ""
            progress.update(task, completed=record["round"] + 1, status=status)

        try:
            yield on_round
        except BaseException:
            if not progress.tasks[0].completed:  # refused before a round closed: the reason alone, not a bar at 0
                progress.live.transient = True
            raise


def print_summary(summary: dict[str, Any], output_dir: Any) -> None:
    table = Table(title="run summary", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    keys = ("run", "status", "failed", "algorithm", "rounds", "accuracy", "loss", "epsilon", "stopped", "wall_s")
    for key in (*keys, "virtual_time_s"):
        if key not in summary:
            continue
        value = summary.get(key)
        if isinstance(value, float):
            value = f"{value:.4f}"
        table.add_row(key, str(value))
    for tier, n in summary.get("cumulative_bytes", {}).items():
        table.add_row(f"bytes {tier.replace('_', ' ')}", f"{n:,}")
    if summary.get("wire_bytes"):
        for tier, n in summary["wire_bytes"].items():
            table.add_row(f"wire {tier}", f"{n:,}")
    table.add_row("output", str(output_dir))
    SafeConsole().print(table)


def print_error(message: object, label: str = "error", style: str = "bold red") -> None:
    """``label: message`` (``style``: red), the message as plain text: errors name config sections and keys in
    brackets (``[security] keys``), which rich would take as markup and drop. Never hard-wrapped: a line break inside
    a path or a key (``job.tom l``) would break it where the output is a file or a pipe (a journal, a CI log, a
    copy-paste); the terminal wraps it."""
    from rich.markup import escape

    console.print(f"[{style}]{label}:[/] {escape(str(message))}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 1) -> NoReturn:
    print_error(message)
    raise click.exceptions.Exit(code)


INTERRUPTED = 130
"""Exit status of ``fedtier run`` stopped by Ctrl-C or SIGTERM (its checkpoint kept: ``--resume`` continues it)."""


def refuse_federation_folder(run_dir: str) -> None:
    """Exit 2 when ``run_dir`` is a federation node's output folder (e.g. the cloud's ``runs/fed``), not a run's:
    the record commands read one job's run folder, which the message names."""
    from protocols.runfiles import JOB_FOLDERS, job_folders

    from .federation import STATE_FILE

    if jobs := job_folders(Path(run_dir)):
        listed = ", ".join(jobs[:5]) + (f" and {len(jobs) - 5} more" if len(jobs) > 5 else "")
        fail(
            f"{run_dir} is a federation's folder, not a run's: each job's records are in its run folder "
            f"{Path(run_dir) / JOB_FOLDERS / 'JOB'} ({listed}); give one of those",
            2,
        )
    if (Path(run_dir) / STATE_FILE).is_file():  # it showed an empty frame ("0 cells"), or "has no records"
        fail(
            f"{run_dir} is a provisioning folder (fedtier provision wrote its {STATE_FILE}), not a run's: a job's "
            f"records are in {JOB_FOLDERS}/JOB of the cloud's output folder (the [run] output of its config.toml, "
            "from the folder the cloud runs in); to watch the federation live, run fedtier monitor --config "
            f"config.toml in {Path(run_dir) / 'nodes' / 'monitor'}",
            2,
        )


@contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C and SIGTERM stop the block alike (its ``finally`` clauses stop the workers and brokers), then
    the command says so and how to continue, and exits with :data:`INTERRUPTED`."""
    import signal

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        console.print("[bold yellow]interrupted:[/] the same command with --resume continues from the last round")
        raise SystemExit(INTERRUPTED) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


LOCK_WAIT_S = 0.5
"""How long a run waits for its folder's lock before it is refused: ``fedtier monitor`` holds it shared for an
instant (``monitor.sources``: whether the run that wrote the folder is gone), which must not refuse a run."""


def _take_lock(fd: int) -> bool:
    """Take ``fd``'s exclusive lock, waiting up to :data:`LOCK_WAIT_S` for a holder of a moment; False: held."""
    import fcntl
    import time

    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


@contextmanager
def run_folder_lock(cfg: RunConfig, node: str | None = None) -> Iterator[None]:
    """Hold ``cfg``'s run folder for this command (``RUN_DIR/run.lock``, released when it ends, or dies): a
    second ``fedtier run|sim`` into the same folder meanwhile would delete this one's files and interleave
    its records with them, so it is refused with the holder's pid (exit 2). ``node`` (``cloud``, ``cell c0``): a
    long-lived node's lock instead (``fedtier cloud|cell --serve``: ``RUN_DIR/cloud.lock``, ``cell-c0.lock``): a
    second process of that node on its folder would take the first's broker session from it, without end, and
    write the same job queue or journals (walked: two clouds of one bundle flipped a finished job to failed); it
    is refused, exit 2, which the node's systemd unit does not restart."""
    import os

    from protocols import runfiles

    out = cfg.output_dir()
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = f"{node.replace(' ', '-')}.lock" if node else runfiles.LOCK
        fd = os.open(out / lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # not a folder, no room, no permission
        print_error(f"run.output: cannot use {out} as the run folder: {exc.strerror or exc}")
        sys.exit(2)
    if not _take_lock(fd):
        holder = os.read(fd, 16).decode(errors="replace").strip() or "?"
        os.close(fd)
        if node:
            print_error(f"{out} is in use by another fedtier {node} (pid {holder}): one serves; stop that one first")
        else:
            print_error(
                f"{out} is in use by another run (pid {holder}); wait for it, or give this one another run.output"
            )
        sys.exit(2)
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def note_resume(cfg: RunConfig, resume: bool) -> None:
    """Say so when ``--resume`` finds no checkpoint in the run folder (another run.output than the
    interrupted run's, or it never started a round): the run starts from its first round. Say so too where the
    checkpoint's rounds reach ``run.rounds``: it has none left to run (it checks the settings and writes the summary of
    the rounds done; before, a bar at 0 of ``run.rounds`` over a summary of more rounds said nothing of why)."""
    from protocols import runfiles
    from protocols.checkpoint import load_payload

    path = cfg.output_dir() / runfiles.CHECKPOINT
    if not resume:
        return
    if not path.exists():
        console.print(f"[yellow]note:[/] no checkpoint in {cfg.output_dir()}: --resume starts from round 1")
        return
    try:
        done = load_payload(path).meta.get("round")
    except (OSError, ValueError):  # damaged: the run says why
        return
    if isinstance(done, int) and not isinstance(done, bool) and done + 1 >= cfg.run.rounds:
        console.print(
            f"[yellow]note:[/] {cfg.output_dir()} ran {done + 1} rounds already (run.rounds = {cfg.run.rounds}): "
            "--resume has none left to run; raise run.rounds to go on"
        )


def refused_start(cfg: RunConfig, reason: object) -> None:
    """Leave the summary of a failed run in ``cfg``'s run folder for a ``fedtier sim|run`` refused once it had taken the
    folder, before its first record (a data set it cannot read, a device this machine lacks): ``run``, ``status`` and
    ``failed``, as a job the cloud could not build has. Before, the folder held only its ``run.lock``, and a monitor of
    it (``--exit-when-done``) waited for ever for a run starting. A folder with an earlier run's records is left."""
    import json

    from protocols import runfiles
    from protocols.checkpoint import write_durably

    out = cfg.output_dir()
    if not out.is_dir() or any((out / f).exists() for f in (runfiles.SUMMARY, runfiles.METRICS, runfiles.AGGREGATION)):
        return
    summary = {"run": cfg.run.name, "status": "failed", "failed": str(reason)}
    try:
        write_durably(out / runfiles.SUMMARY, (json.dumps(summary, indent=2) + "\n").encode(), private=False)
    except OSError:  # (a folder it cannot write: the refusal itself was said)
        pass


JOB_FAILED = 3
"""Exit status of a one-shot command (``fedtier run|sim|cloud``) whose job failed (1: an error before it ran,
2: a bad config)."""


def exit_if_failed(result: Any) -> None:
    """Exit with :data:`JOB_FAILED` and the reason when the job of ``result`` (a ``RunResult``) failed."""
    if getattr(result, "failed", None):
        print_error(result.failed, "job failed")
        raise SystemExit(JOB_FAILED)


@dataclass(frozen=True)
class LiveTarget:
    """Where a live view (``fedtier monitor --broker``, ``fedtier fleet``) listens: the broker URL, the run
    name, the keys file that checks signatures and the broker credentials (``auth_options``)."""

    broker: str | None
    run: str | None
    keys_file: str | None
    auth: dict[str, str | None]


def live_target(
    config_path: str | None, broker: str | None, run: str | None, keys_file: str | None, auth: dict[str, str | None]
) -> LiveTarget:
    """The flags, with a config (e.g. the monitor bundle's ``config.toml``) filling what they leave out: its
    ``[broker]`` URL and credentials, its run name and ``[security] keys``."""
    if config_path is None:
        return LiveTarget(broker, run, keys_file, auth)
    cfg = load_or_exit(config_path, ())
    filled = {k: v if v is not None else getattr(cfg.broker, k) for k, v in auth.items()}
    return LiveTarget(broker or cfg.broker.url, run or cfg.run.name, keys_file or cfg.security.keys, filled)


def public_keys_or_exit(keys_file: str | None) -> PublicKeys | None:
    """The public keys in ``keys_file`` (``None`` without one); a bad file exits with status 2."""
    from protocols.wire.keys import KeysError, load_public_keys

    try:
        return load_public_keys(keys_file) if keys_file is not None else None
    except KeysError as exc:
        fail(str(exc), 2)


def connect_within(wait: float | None) -> float:
    """The connect timeout of a command that waits ``wait`` seconds at most (``None``: no wait, a node's default): it
    gives up connecting within its wait (``fedtier jobs --wait 5`` with no broker reachable waited 10 s)."""
    from protocols.transport.connecting import CONNECT_TIMEOUT

    return CONNECT_TIMEOUT if wait is None else min(wait, CONNECT_TIMEOUT)


@contextmanager
def live_connection(target: LiveTarget, name: str, wait: float | None = None) -> Iterator[MqttTransport]:
    """A connected MQTT transport to ``target.broker`` (client id ``{name}-`` and a random suffix: several
    watchers at once), on its own loop; closed with its loop on leaving. No connection within
    :func:`connect_within` ``wait`` exits with status 1."""
    from protocols.transport.mqtt import MqttTransport
    from protocols.transport.threadloop import ThreadLoop

    if target.broker is None:
        fail("no broker to connect to: give --broker URL", 2)
    loop = ThreadLoop(f"fedtier-{name}").start()
    try:
        transport = MqttTransport.from_url(target.broker, f"{name}-{uuid.uuid4().hex[:8]}", loop, **target.auth)
        transport.connect(connect_within(wait))
    except (ConnectionError, ValueError) as exc:
        loop.stop()
        fail(str(exc), 1)
    try:
        yield transport
    finally:
        transport.close()
        loop.stop()
