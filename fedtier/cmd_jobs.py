"""The operator's commands on a federation: ``fedtier submit``, ``fedtier jobs``, ``fedtier cancel``.

Each reads the operator bundle's ``config.toml`` (``fedtier provision`` writes ``nodes/operator/``: the
broker login, TLS files and the operator's signing key), signs its request with the operator identity and
waits for the cloud's signed answer."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.markup import escape

from protocols.joblog import figures_text, job_figures

from .cli import VERBOSE, main
from .cli_types import Finite
from .console import JOB_FAILED, connect_within, console, load_or_exit, output_console, print_error, setup_logging

RETAINED_GRACE = 1.0
"""Seconds the operator's commands give the broker, once it acknowledged their subscriptions, to hand over the cloud's
retained status before they say none is there (a broker sends retained messages right after the acknowledgement)."""

OFFLINE_GRACE = 1.5
"""Seconds `fedtier jobs` waits for a newer status of a cloud whose status says offline. A live cloud's read offline for
an instant as a job ended (seen once in a fresh-clone suite): its job's connection closed its socket before the broker
had read its DISCONNECT, the broker's answers to its last subscription changes failed to be written and it said the
will (not a takeover by the cloud's next connection); a clean close now waits for the broker's end
(``protocols.transport.paho_client.linger_close``). Kept for what remains: a broker slower than that wait
(``LINGER_WAIT``, 2 s) to read the DISCONNECT, whose next connection then takes the old one over (the will again),
and its idle status replaces it at once."""

OPERATOR_CONFIG = click.option(
    "--config",
    "config",
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="The operator bundle's config.toml (fedtier provision: nodes/operator/config.toml).",
)
WAIT = click.option(
    "--wait",
    type=Finite(min=0.1),
    default=30.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds to wait for the cloud.",
)


def _fail(message: str, code: int) -> NoReturn:
    print_error(message)
    raise SystemExit(code)


def _operator(cfg: Any) -> Any:
    """The operator's identity (``None`` in an unsigned federation)."""
    from protocols.jobs import OPERATOR
    from protocols.wire.keys import KeysError, Trust, load_keys

    if not cfg.security.keys:
        return None
    try:
        ring = load_keys(cfg.security.keys)
    except KeysError as exc:  # (the monitor bundle's, public keys only, said "keys.toml has no [private] key")
        ring, why = None, f": {exc}"
    else:
        why = ""
    if ring is None or OPERATOR not in ring.private or "cloud" not in ring.public:
        raise KeysError(
            f"{cfg.security.keys}: not an operator's keys (the operator's private key, the cloud's public key){why}; "
            "give --config the operator bundle's config.toml (fedtier provision's nodes/operator)"
        )
    return Trust(OPERATOR, ring.private[OPERATOR], ring.public)


class _Session:
    """A short connection of the operator to the federation's broker."""

    def __init__(self, cfg: Any, wait: float) -> None:
        from edge_agent.runner import BrokerOptions
        from protocols.jobs import OPERATOR
        from protocols.transport.threadloop import ThreadLoop

        self.cfg, self.fed, self.wait = cfg, cfg.run.name, wait
        self.trust = _operator(cfg)
        self.loop = ThreadLoop("operator")
        opts = BrokerOptions.from_config(cfg)
        transport = opts.transport(OPERATOR, self.fed, self.loop, persistent=False)
        self.transport = transport.connect(connect_within(wait))  # within the command's wait

    def read(self, topic: str, signer: str, wait: float, until: Any = None) -> dict[str, Any] | None:
        """Subscribe to ``topic`` and return the first record ``signer`` signed (``until(record)`` true), or None."""
        from protocols.jobs import JobError, open_job_record

        got: list[dict[str, Any]] = []

        def on_record(t: str, data: bytes) -> None:
            if not data:
                return
            try:
                record = open_job_record(data, t, signer, self.trust.verify if self.trust is not None else None)
            except JobError as exc:
                print_error(exc, "ignored")
                return
            if until is None or until(record):
                got.append(record)

        self.transport.subscribe(topic, on_record)
        self.transport.wait_subscribed(wait)
        self.loop.run(until=lambda: bool(got), timeout=wait)
        return got[0] if got else None

    def settle(self, until: Callable[[], bool], seconds: float) -> None:
        """Take what comes for up to ``seconds``, or until ``until()``."""
        self.loop.run(until=until, timeout=seconds)

    def cloud_status(self) -> list[dict[str, Any]]:
        """Collect the cloud's (verified) status records from now on (a provisioning before the operator could
        read them gets none); a note at once where the broker holds none."""
        from protocols.status import decode_status
        from protocols.wire import topics

        got: list[dict[str, Any]] = []
        topic = topics.status(self.fed, "cloud")
        trust = self.trust

        def on_status(t: str, data: bytes) -> None:
            record = decode_status(data, t, trust) if data else None
            if record is not None:
                got.append(record)

        self.transport.subscribe(topic, on_status)
        # a broker that holds no status of the cloud (none ever served here, or the broker lost what it kept): said
        # now, as the wait that follows is long and silent (a cloud starting meanwhile still answers within it)
        self.transport.wait_subscribed(self.wait)
        self.loop.run(until=lambda: bool(got), timeout=min(self.wait, RETAINED_GRACE))  # a retained one comes at once
        if not got:
            print_error(
                f"no cloud has said its status on this broker yet: waiting up to {self.wait:g} s for one (is `fedtier "
                "cloud --serve` running?)",
                "note",
                "yellow",
            )
        return got

    def request(self, record: dict[str, Any], job: str, wait: float) -> dict[str, Any] | None:
        """Publish a signed request about ``job`` and wait for the cloud's signed reply to it (one that echoes
        its nonce: another request's answer, or a reply not the cloud's, is ignored, said on stderr)."""
        from protocols.jobs import post_request

        sign, verify = (self.trust.sign, self.trust.verify) if self.trust else (None, None)
        pending = post_request(self.transport, self.fed, record, job, sign, wait, verify)
        self.loop.run(until=lambda: pending.answer is not None, timeout=wait)
        for why in pending.ignored:
            print_error(why, "ignored")
        return pending.answer

    def close(self) -> None:
        self.transport.close()


def _answer(session: _Session, record: dict[str, Any], job: str, wait: float) -> None:
    from protocols.wire import topics

    cloud = session.cloud_status()  # (subscribed before the list: its retained status comes first)
    try:
        # a cloud that never connected has no session on the broker yet: a request now would reach nobody
        if session.read(topics.job_list(session.fed), "cloud", wait) is None:
            _fail(f"no cloud has served federation {session.fed!r} yet (no job list within {wait:g} s)", 1)
        if cloud and cloud[-1].get("state") == "offline":  # said now: the wait for an answer is long and silent
            print_error(
                f"the cloud is offline (its last status): waiting up to {wait:g} s for it to answer", "note", "yellow"
            )
        reply = session.request(record, job, wait)
    finally:
        session.close()
    if reply is None and session.transport.reconnects:
        _fail(
            f"no answer from the cloud within {wait:g} s, and this command's connection to the broker was lost "
            f"{session.transport.reconnects} time(s) meanwhile: the broker keeps one connection per identity, so "
            "another fedtier command run from the operator bundle at the same time (submit --wait-end, jobs, cancel) "
            f"takes it over and the answer can be lost. `fedtier jobs` says whether job {job} was queued",
            1,
        )
    if reply is None and cloud and cloud[-1].get("state") == "offline":  # its session at the broker holds the request
        _fail(
            f"the cloud is offline (no answer within {wait:g} s): the broker keeps this request for it, and it takes "
            f"it when it starts again (a submission is then queued or refused, a cancel done); `fedtier jobs` then "
            f"says what became of job {job}",
            1,
        )
    if reply is None:
        _fail(f"no answer from the cloud within {wait:g} s (is `fedtier cloud --serve` running?)", 1)
    if not reply.get("accepted"):  # a refused cancel leaves the job as it was: it is the request that was refused
        what = f"cannot cancel job {job}" if record.get("action") == "cancel" else f"job {job} refused"
        _fail(f"{what}: {reply.get('reason')}", 1)
    console.print(f"job {job}: {reply.get('reason')}")


def _connect(config: str, wait: float) -> _Session:
    from protocols.config import ConfigError

    cfg = load_or_exit(config, ())
    if not cfg.broker.url:  # it said "broker.url: required (mqtt://host:port), or pass --broker", an option it lacks
        _fail(
            f"{config} names no broker ([broker] url): --config takes the operator bundle's config.toml (fedtier "
            "provision writes it in OUT/nodes/operator; run the command from there)",
            2,
        )
    try:
        return _Session(cfg, wait)
    except ConfigError as exc:
        _fail(str(exc), 2)
    except ConnectionError as exc:
        _fail(str(exc), 1)
    raise AssertionError


ENDED = {"finished": 0, "failed": JOB_FAILED, "cancelled": 1}
"""A job's end state and the exit status of ``fedtier submit --wait-end``."""


def _wait_end(config: str, job: str, seconds: float) -> NoReturn:
    """Follow the cloud's signed job list until ``job`` ended (or ``seconds`` passed); exit with its end."""
    from protocols.wire import topics

    def state(record: dict[str, Any]) -> str | None:
        listed = record.get("jobs")
        mine = [j for j in listed if isinstance(j, dict) and j.get("job") == job] if isinstance(listed, list) else []
        return str(mine[0].get("state")) if mine else None

    session = _connect(config, seconds)
    cloud = session.cloud_status()  # (subscribed before the list: its retained status comes first)
    try:
        record = session.read(topics.job_list(session.fed), "cloud", seconds, until=lambda r: state(r) in ENDED)
    finally:
        session.close()
    if record is None and cloud and cloud[-1].get("state") == "offline":  # e.g. it stopped on a full disk
        _fail(
            f"job {job} has not ended within {seconds:g} s, and the cloud is offline (its last status: it stopped or "
            "died, its log says why): a job it lists running resumes when it starts again (fedtier jobs shows where "
            "it is)",
            1,
        )
    if record is None:
        _fail(f"job {job} has not ended within {seconds:g} s (fedtier jobs shows where it is)", 1)
    ended = next(j for j in record["jobs"] if isinstance(j, dict) and j.get("job") == job)
    reason = f": {ended.get('reason')}" if ended.get("reason") else ""
    reason += f" ({figures})" if (figures := figures_text(ended)) else ""
    if ended["state"] == "finished":
        console.print(f"job {job}: finished{escape(reason)}", highlight=False)
    else:
        print_error(f"{ended['state']}{reason}", f"job {job}")
    raise SystemExit(ENDED[ended["state"]])


@main.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
@OPERATOR_CONFIG
@click.option("--id", "job_id", default=None, help="The job's id (default: [job] id, else the file's name).")
@WAIT
@click.option(
    "--wait-end",
    type=Finite(min=0.1),
    default=None,
    metavar="SECONDS",
    help="Once queued, wait up to SECONDS for the job to end; exit 0 finished, 3 failed, 1 cancelled or not "
    "ended in time (for scripts that run job after job).",
)
@VERBOSE
def submit(job_file: str, config: str, job_id: str | None, wait: float, wait_end: float | None, verbose: int) -> None:
    """Submit JOB_FILE (a run config, plus an optional [job] section) to the federation's cloud queue.

    The job is validated here first (the same errors as fedtier sim), signed with the operator identity,
    and accepted or refused by the cloud (exit 0 / 1, with its reason); with --wait-end, then followed to
    its end."""
    from protocols.jobs import JobError, canonical_job, read_job_file, submit_record

    setup_logging(verbose)
    cfg = load_or_exit(config, ())
    try:
        request = read_job_file(job_file, job_id)
    except JobError as exc:
        _fail(str(exc), 2)
    try:
        canonical_job(
            request.config, cfg, "the federation's as provisioned (this bundle's; the cloud checks its roster)"
        )
    except JobError as exc:  # which file the keys it names are in
        _fail(f"{job_file}: {exc}", 2)
    _answer(_connect(config, wait), submit_record(request), request.job, wait)
    if wait_end is not None:
        _wait_end(config, request.job, wait_end)


@main.command()
@click.argument("job")
@OPERATOR_CONFIG
@WAIT
@VERBOSE
def cancel(job: str, config: str, wait: float, verbose: int) -> None:
    """Cancel JOB: a queued job at once, a running one after its current round."""
    from protocols.jobs import JobError, cancel_record

    setup_logging(verbose)
    try:
        record = cancel_record(job)
    except JobError as exc:
        _fail(str(exc), 2)
    _answer(_connect(config, wait), record, job, wait)


@main.command()
@OPERATOR_CONFIG
@WAIT
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON.")
@VERBOSE
def jobs(config: str, wait: float, as_json: bool, verbose: int) -> None:
    """List the federation's jobs (queued, running, finished, failed, cancelled), as the cloud signed them."""
    import json

    from rich.table import Table

    from protocols.wire import topics

    setup_logging(verbose)
    session = _connect(config, wait)
    cloud = session.cloud_status()
    try:
        record = session.read(topics.job_list(session.fed), "cloud", wait)
        if cloud and cloud[-1].get("state") == "offline":  # a live cloud says otherwise at once (OFFLINE_GRACE)
            session.settle(lambda: cloud[-1].get("state") != "offline", min(wait, OFFLINE_GRACE))
    finally:
        session.close()
    if record is None:
        _fail(f"no job list from the cloud within {wait:g} s (is `fedtier cloud --serve` running?)", 1)
    if cloud and cloud[-1].get("state") == "offline":  # (its status comes before the list: subscribed first)
        print_error(
            "the cloud is offline: this is the list it left; nothing is running now (a job it lists running resumes "
            "when the cloud starts again)",
            "warning",
            "yellow",
        )
    jobs = record.get("jobs")
    listed = jobs if isinstance(jobs, list) else []
    if as_json:
        click.echo(json.dumps(listed))
        return
    if not listed:  # an empty table reads as a broken command
        console.print(
            f"no jobs: the cloud lists none; submit one with `fedtier submit JOB.toml --config {escape(config)}`"
        )
        return
    table = Table("job", "state", "submitted", "hash", "rounds", "accuracy", "reason")
    for j in listed:
        when = dt.datetime.fromtimestamp(j.get("submitted") or 0, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        absent = j.get("cells_absent_at_start")
        said = [f"{c}: {why}" for c, why in absent.items()] if isinstance(absent, dict) else []
        if isinstance(more := j.get("cells_absent_at_start_more"), int) and more > 0:
            said.append(f"and {more} more cells absent at start")
        reason = "; ".join(filter(None, [str(j.get("reason") or ""), *said]))
        figures = job_figures(j)
        rounds, accuracy = figures.get("rounds", ""), figures.get("accuracy", "")
        cells = (str(j.get("job")), str(j.get("state")), when, str(j.get("hash", ""))[:12], rounds, accuracy, reason)
        table.add_row(*(escape(c) for c in cells))  # the cloud's words: a reason may name a [section]
    output_console().print(table)  # the list is the command's output: stdout, as --json's
