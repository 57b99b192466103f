"""Long-lived nodes of a federation (``fedtier cloud|cell|agent --serve``): they stay up across jobs,
take each job's config from the cloud's signed job record, reconnect with backoff while the broker is
unreachable, and stop cleanly on SIGTERM or Ctrl-C (a running job resumes when they come back)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from protocols.config import ConfigError, RunConfig

from .metrics import linger, serve_metrics

log = logging.getLogger("fedtier.serve")
BACKOFF_MAX = 30.0
QUEUE_FILE = "jobs.json"


def connect_forever(make: Callable[[], Any], stopping: threading.Event, what: str) -> Any:
    """``make().connect()``, retried while it raises ``ConnectionError`` (:class:`Retrying`: doubling delays from 1 s
    to ``BACKOFF_MAX``, to ``REFUSED_BACKOFF`` times it while the broker refuses the node, e.g. a revoked one that was
    never told); ``None`` once ``stopping`` is set. Called with ``stopping`` set, it tries once: a service
    stopped between a job's end (its server said idle) and its next connection connects to say offline."""
    if stopping.is_set():
        try:
            return make().connect()
        except ConnectionError as exc:
            log.warning("%s: cannot connect to the broker (%s) as it stops", what, exc)
            return None
    retrying = Retrying(what)
    while not stopping.is_set():
        try:
            transport = make().connect()
        except ConnectionError as exc:
            stopping.wait(retrying.failed(exc))
        else:
            retrying.connected()
            return transport
    return None


class Retrying:
    """The delays and lines of a node's connect retried for as long as it takes: each failure's delay doubles from
    1 s up to ``BACKOFF_MAX`` (an unreachable broker), or up to ``REFUSED_BACKOFF`` times that once the broker has
    refused the node (:class:`~protocols.transport.paho_client.Refused`) for ``REFUSED_PATIENCE`` (a revoked node's
    for ever, so the broker is asked every 5 min, not every 30 s; a broker full after its restart for a while, so the
    node comes back within 30 s of it). A failure is said in full when it first comes, then only at the 10th, 100th,
    ... same in a row (``said_rarely``: a node refused for weeks writes a few lines, not one a minute), and a connect
    after failures says so."""

    def __init__(self, what: str) -> None:
        self.what, self.delay, self.failures, self.same, self.last, self.since = what, 1.0, 0, 0, "", ""
        self.refused_for = 0.0  # the waits after refusals (Refused), summed

    def failed(self, exc: ConnectionError) -> float:
        """Count ``exc``, say it if due; the seconds to wait before the next attempt."""
        from protocols.transport.connecting import longest_delay, said_rarely
        from protocols.transport.paho_client import Refused

        refused = isinstance(exc, Refused)
        delay, cap = self.delay, longest_delay(BACKOFF_MAX, refused, self.refused_for)
        self.refused_for += delay if refused else 0.0
        self.delay = min(2 * delay, cap)
        self.failures += 1
        self.since = self.since or time.strftime("%H:%M:%S UTC", time.gmtime())
        self.same, self.last = (self.same + 1 if str(exc) == self.last else 1), str(exc)
        if self.same == 1:
            log.warning("%s: cannot connect to the broker (%s); retrying in %.0f s", self.what, exc, delay)
        else:
            level = logging.WARNING if said_rarely(self.same) else logging.DEBUG
            said = f"still cannot connect to the broker, {self.failures} attempts since {self.since} ({exc})"
            log.log(level, "%s: %s; retrying in %.0f s (at most every %.0f s)", self.what, said, delay, cap)
        return delay

    def connected(self) -> None:
        """The connect succeeded: said if it had failed."""
        if self.failures:
            said = f"connected to the broker after {self.failures} failed attempts since {self.since}"
            log.warning("%s: %s", self.what, said)


def on_signals(*stops: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call each of ``stops`` in order (the service then leaves its loop and disconnects
    cleanly); SIGHUP reloads the node's TLS material (:func:`reload_on_sighup`)."""

    def stop(*_: object) -> None:
        for each in stops:
            each()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    reload_on_sighup()


def reload_on_sighup() -> Any:
    """SIGHUP (``systemctl reload``) makes this process's MQTT connections take their renewed TLS certificate
    and key from their files (``protocols.transport.tls_reload``), on a thread of its own (the handler may
    have interrupted one holding the logging lock). Returns the previous handler."""
    from protocols.transport.tls_reload import reload_and_log

    return signal.signal(signal.SIGHUP, lambda *_: threading.Thread(target=reload_and_log, name="tls-reload").start())


def operator_key(cfg: RunConfig) -> bytes | None:
    """The operator's public key from the cloud's keys file; ``None`` in an unsigned federation."""
    from protocols.jobs import OPERATOR
    from protocols.wire.keys import load_keys

    if not cfg.security.keys:
        return None
    key = load_keys(cfg.security.keys).public.get(OPERATOR)
    if key is None:
        raise ConfigError(
            f"{cfg.security.keys} holds no operator key: provision the federation again (fedtier provision)"
        )
    return key


ROSTER_FILE = "roster.json"


def federation_roster(cfg: RunConfig, trust: Any) -> tuple[bytes | None, bool]:
    """The federation's signed roster (``{output}/roster.json``, kept across restarts, or the bundle's from
    `fedtier provision`, whichever is newer: membership changes raise its version); else version 1 from the
    cloud's keys file and ``security.max_device_weight`` when there is none yet, and whether it is that new one
    (the caller keeps it in ``{output}/roster.json``). ``None`` in an unsigned federation or without a weight bound
    (logged)."""
    from protocols.roster import Roster, RosterError, sign_roster, verify_roster
    from protocols.wire.keys import load_keys

    keys = cfg.security.keys
    if trust is None or keys is None:
        return None, False
    path, bundled = cfg.output_dir() / ROSTER_FILE, Path(keys).with_name(ROSTER_FILE)
    found = []  # the one kept across restarts, and the one `fedtier provision` put in the bundle: the newer wins
    for where in (path, bundled):
        if where.exists():
            data = where.read_bytes()
            try:
                found.append((verify_roster(data, trust.verify, federation=cfg.run.name).version, data))
            except RosterError as exc:  # the kept one, signed before `renew --identity --node cloud`, beside the
                if where != path or not bundled.exists():  # bundle's re-signed one: the bundle's is taken
                    raise
                log.warning("the kept roster %s is not taken (%s): the bundle's is", path, exc)
    if found:
        return max(found)[1], False
    bound = cfg.security.max_device_weight
    if bound is None:
        log.warning("no roster: security.max_device_weight is not set (fedtier provision sets it)")
        return None, False
    topo = cfg.topology
    public = load_keys(keys).public
    roster = Roster.from_topology(cfg.run.name, {c: topo.devices(c) for c in topo.cell_ids()}, public, bound)
    return sign_roster(roster, trust.sign), True


def write_job_final(job: Any, job_cfg: RunConfig, node: Any, out: Path) -> None:
    """A federation job's final model and ``summary.json``, named by the job: its id and its config hash as the
    cloud holds it (``fedtier jobs``), so two jobs of one federation (one ``run`` name) are told apart."""
    from sim.launcher import RunResult, write_final

    result = RunResult.of_cloud(job_cfg, node, out, time.time() - (job.started or time.time()))
    result.job, result.config_hash = job.job, job.digest
    write_final(out, result)


def serve_cloud(cfg: RunConfig, opts: Any, test_data: str | None, spec_of: Callable[..., Any]) -> str:
    """Run the federation's cloud: the job queue in ``{output}/jobs.json``, a run folder per job; returns what it
    served (:func:`served_summary`)."""
    from cloud.jobs import JobQueue
    from cloud.service import CloudService, JobParts
    from edge_agent.runner import offline_will
    from protocols.checkpoint import write_durably
    from protocols.transport.threadloop import ThreadLoop
    from protocols.twin import NODE_WINDOW
    from protocols.wire.keys import node_trust
    from sim.hierarchy import make_evaluator

    fed = cfg.run.name
    trust = node_trust(cfg, "cloud")
    operator = operator_key(cfg)
    queue = JobQueue(cfg.output_dir() / QUEUE_FILE, create=False)  # written once the twin check passed: claim()
    loop = ThreadLoop("cloud")
    stopping = threading.Event()

    def connect() -> Any:  # its will names this process's instance (protocols.twin)
        will = offline_will(fed, "cloud", cfg, service.twin.instance)
        make = lambda: service.twin.borrow(opts.transport("cloud", fed, loop, will=will))  # noqa: E731
        return connect_forever(make, stopping, "cloud")

    exporter = serve_metrics(cfg)  # one /metrics across jobs: each job's server is watched as it is built

    def parts(job_cfg: RunConfig) -> JobParts:
        spec, test = spec_of(job_cfg, test_data)
        evaluator = make_evaluator(spec, test.x, test.y, job_cfg.runtime.device) if test is not None else None
        watch = exporter.watch_cloud if exporter is not None else None
        return JobParts(job_cfg.build_algorithm(spec), evaluator, on_build=watch)

    roster, new_roster = federation_roster(cfg, trust)

    def claim() -> None:  # once no other cloud is live: its files
        queue.create()
        if roster is not None and new_roster:
            write_durably(cfg.output_dir() / ROSTER_FILE, roster, private=False)

    service = CloudService(
        cfg,
        loop,
        connect,
        queue,
        parts,
        trust=trust,
        operator=operator,
        on_end=write_job_final,
        roster=roster,
        roster_path=cfg.output_dir() / ROSTER_FILE,
        twin_window=NODE_WINDOW,  # a second cloud process of the federation is refused (protocols.twin)
        claim=claim,
    )
    on_signals(stopping.set, service.stop)
    log.info("cloud of federation %s serving jobs (queue %s)", fed, queue.path)
    try:
        service.serve()
    finally:
        linger(exporter, 0)
    return cloud_served(service)


def cloud_served(service: Any) -> str:
    """What the serving cloud (a :class:`cloud.service.CloudService`) says as it stops: every job it ended, the ones
    it never started too, and the one it was stopped during (:func:`served_summary`)."""
    unstarted = {"failed at start": service.failed_at_start, "cancelled while queued": service.cancelled_queued}
    return served_summary("cloud", service.served, service.stopped_during, unstarted=unstarted)


def served_summary(
    node: str,
    served: list[str],
    stopped_during: str | None,
    tasks: int | None = None,
    unstarted: Mapping[str, list[str]] | None = None,
) -> str:
    """What a long-lived node (``node``: ``cloud``, ``cell c0``, ``device c0-d0``) says as it stops: the jobs it served
    (and ``tasks``), the jobs it ended without starting them (``unstarted``: how, e.g. ``failed at start``, and
    which), and the one it was stopped during, if it was (SIGTERM mid-job), and what becomes of that job."""
    line = f"{node}: served {len(served)} job{'' if len(served) == 1 else 's'}" + (
        f" ({', '.join(served)})" if served else ""
    )
    line += "" if tasks is None else f", {tasks} tasks"
    for how, jobs in (unstarted or {}).items():
        if jobs:  # the cloud's: "served 3 jobs" alone left an operator who submitted 5 guessing
            line += f"; {len(jobs)} {how} ({', '.join(jobs)})"
    if stopped_during is None:
        return line
    kind = node.split()[0]
    if kind == "cloud":  # the job waits for it: no round closes without the cloud
        return (
            f"{line}; stopped during job {stopped_during}, which resumes from its checkpoint when the cloud starts "
            "again"
        )
    return (
        f"{line}; stopped during job {stopped_during}, which goes on without this {kind} until it starts again and "
        "serves the rest of it (if the job still runs then)"
    )


def serve_cell(cfg: RunConfig, cell: str, opts: Any, spec_of: Callable[..., Any]) -> str:
    """Run one cell of the federation across jobs; returns what it served (:func:`served_summary`)."""
    from cell_server.node import build_cell
    from cell_server.service import CellService
    from edge_agent.runner import offline_will
    from protocols import runfiles
    from protocols.transport.threadloop import ThreadLoop
    from protocols.twin import NODE_WINDOW
    from protocols.wire import topics
    from protocols.wire.keys import node_trust
    from sim.hierarchy import edge_availability

    fed, node_name = cfg.run.name, topics.cell_node(cell)
    trust = node_trust(cfg, cell)
    loop = ThreadLoop(f"cell-{cell}")
    stopping = threading.Event()

    def connect() -> Any:  # its will names this process's instance (protocols.twin)
        will = offline_will(fed, node_name, cfg, service.twin.instance)
        make = lambda: service.twin.borrow(opts.transport(node_name, fed, loop, will=will))  # noqa: E731
        return connect_forever(make, stopping, node_name)

    exporter = serve_metrics(cfg)

    def build(job_cfg: RunConfig, transport: Any) -> Any:
        spec, _ = spec_of(job_cfg, None)
        out = job_cfg.output_dir()
        out.mkdir(parents=True, exist_ok=True)
        journal = out / runfiles.CELL_JOURNAL.format(cell=cell)
        node = build_cell(
            job_cfg,
            cell,
            transport,
            job_cfg.build_algorithm(spec),
            output_dir=out,
            heartbeats=True,
            availability=edge_availability(job_cfg),
            journal=True,
            resume=journal.exists() and job_cfg.secagg_settings() is None,
        )
        if exporter is not None:
            exporter.watch_cell(node)
        return node

    service = CellService(cfg, cell, loop, connect, build, trust, marks_job_folder=True, twin_window=NODE_WINDOW)
    on_signals(stopping.set, service.stop)
    try:
        service.serve()
    finally:
        linger(exporter, 0)
    return revoked_or(service, served_summary(f"cell {cell}", service.served, service.stopped_during))


def revoked_or(service: Any, summary: str) -> str:
    """``summary``, or :class:`protocols.roster.NodeRevoked` (exit 2: its unit does not restart it) saying why and what
    it served, and the job it was serving, if the federation revoked the node (``service.revoked``)."""
    from protocols.roster import NodeRevoked

    if service.revoked is None:
        return summary
    during = service.revoked_during
    raise NodeRevoked(f"{service.revoked}; {summary}" + (f"; revoked during job {during}" if during else ""))


def serve_agent(
    cfg: RunConfig, device: str, data: Any, opts: Any, make_trainer: Callable[[RunConfig, Any], Any], spec_of: Any
) -> str:
    """Run one device's agent across jobs; returns what it served and the tasks it answered (:func:`served_summary`).
    Raises :class:`protocols.roster.NodeRevoked` once the federation revoked the device."""
    from edge_agent.broker import device_will
    from edge_agent.node import cell_of
    from edge_agent.runner import AgentProcess
    from edge_agent.service import AgentService
    from protocols.transport.threadloop import ThreadLoop
    from protocols.twin import twin_window
    from protocols.wire import topics
    from protocols.wire.keys import node_trust
    from sim.hierarchy import device_availability

    fed = cfg.run.name
    cell_of(cfg, device)
    trust = node_trust(cfg, device)
    loop = ThreadLoop(f"agent-{device}")
    stopping = threading.Event()

    def watch() -> Any:  # a clean session: what a persistent one queued for the last job is dropped
        node = topics.device_node(device)  # its will names this process's instance (protocols.twin)
        will = device_will(fed, cell_of(cfg, device), device, cfg, service.twin.instance, ordered=True)
        make = lambda: service.twin.borrow(opts.transport(node, fed, loop, persistent=False, will=will))  # noqa: E731
        return connect_forever(make, stopping, node)

    def build(job_cfg: RunConfig, session: str) -> AgentProcess:
        spec, job_data = spec_of(job_cfg, None)  # the data as this job's model takes it (images: its size)
        return AgentProcess(
            job_cfg,
            job_cfg.build_algorithm(spec),
            {device: data if job_data is None else job_data},
            make_trainer(job_cfg, spec),
            opts,
            availability=device_availability(job_cfg),
            session=session,
            long_lived=True,
            twin_window=twin_window(job_cfg.runtime.heartbeat),  # a second agent under this id is refused (twin.py)
        )

    service = AgentService(cfg, [device], loop, watch, build, trust, twin_window=twin_window(cfg.runtime.heartbeat))
    exporter = serve_metrics(cfg, None, follow=True)
    if exporter is not None:  # its counters are the long-lived agent process's, from the first job on
        service.on_start = exporter.agents.follow
    on_signals(stopping.set, service.stop)
    try:
        service.serve()
    finally:
        linger(exporter, 0)
    return revoked_or(
        service, served_summary(f"device {device}", service.served, service.stopped_during, service.tasks)
    )
