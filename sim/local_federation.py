"""``fedtier run``'s federation: the long-lived cloud and cells of ``fedtier cloud|cell --serve``, in this
process, and the operator who submits the run's config to them as one job.

The cloud (:class:`cloud.service.CloudService`, its durable queue in ``RUN_DIR/jobs.json``, an unsigned
operator) and one :class:`cell_server.service.CellService` per cell each drive their own loop on a thread of
their own. :meth:`LocalFederation.submit` publishes the job on the cloud's job topic as ``fedtier submit``
does and waits for the cloud's answer; the cloud publishes the job in progress (retained, signed when the run
has keys), and the cells and the agents (``sim.agent_workers``) build their roles from that record's config:
their bundles (:func:`federation_bundle`) hold none. The job's folder is the run folder itself, so
``fedtier run`` writes what it always wrote where it always did (plus ``jobs.json``).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cell_server.server import CellServer
from cell_server.service import CellService
from cloud.jobs import ENDED, Job, JobQueue
from cloud.server import CloudServer
from cloud.service import CloudService, JobParts
from edge_agent.runner import BrokerOptions, offline_will
from protocols import runfiles
from protocols.config import ConfigError, RunConfig, parse_config
from protocols.jobs import NODE_LOCAL, JobRequest, post_request, submit_record
from protocols.session import new_session
from protocols.status import decode_status
from protocols.transport.base import Transport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import LIVE_STATES, TwinError, new_instance
from protocols.wire import topics
from protocols.wire.keys import node_trust

log = logging.getLogger("fedtier.run")

SUBMIT_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def federation_bundle(cfg: RunConfig) -> RunConfig:
    """The federation of ``cfg`` as its nodes' bundles hold it: its name, run folder, topology and the
    node-local sections (broker, keys, monitoring) and the run's plugins (a node imports no other); no training
    config (the job brings it)."""
    bundle = parse_config(
        {
            "run": {"name": cfg.run.name, "output": str(cfg.output_dir()), "plugins": list(cfg.run.plugins)},
            "topology": cfg.topology.model_dump(mode="json", exclude_none=True),
        }
    )
    return bundle.model_copy(update={section: getattr(cfg, section) for section in NODE_LOCAL})


def job_text(cfg: RunConfig) -> str:
    """``cfg``'s training config as the operator submits it: no node-local sections, no ``run.init_model`` (a
    path: the launcher hands it to each node itself) but its sha256 (``run.init_model_sha256``: in the job's
    config hash, so every node refuses another file), and the DP noise seed that ``fedtier sim`` uses
    (``run.seed``) written out, since a job without one draws its noise from the OS."""
    digest = cfg.run.init_model_sha256
    if cfg.run.init_model:
        try:
            digest = hashlib.sha256(Path(cfg.run.init_model).read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(f"run.init_model: cannot read {cfg.run.init_model}: {exc}") from None
        stated = cfg.run.init_model_sha256
        if stated is not None and digest != stated:  # the operator's check of the file: kept, never replaced
            raise ConfigError(
                f"run.init_model: cannot use {cfg.run.init_model}: its sha256 is {digest[:16]}..., not {stated[:16]}..."
            )
    update: dict[str, Any] = {"run": cfg.run.model_copy(update={"init_model": None, "init_model_sha256": digest})}
    if cfg.privacy.dp != "off" and cfg.privacy.noise_seed is None:
        update["privacy"] = cfg.privacy.model_copy(update={"noise_seed": cfg.run.seed})
    return cfg.model_copy(update=update).to_toml(exclude=NODE_LOCAL)


LIVE_CHECK_WAIT = 0.5
"""Seconds :func:`refuse_live_run` waits after its subscriptions are acknowledged for the retained records (the
broker sends them right after its SUBACK)."""


def refuse_live_run(opts: BrokerOptions, cfg: RunConfig) -> None:
    """Raise :class:`TwinError` if the retained status of a cloud, cell or device of ``cfg``'s run name on ``opts``'
    broker says a process of it is up (online, idle: a node that stopped or died leaves offline, its will): another
    ``fedtier run`` of this name, or a federation serving it, even one whose cloud is down (its long-lived agents
    alone). Its nodes hold the same client ids and topics: this run's would take their broker sessions every second,
    and neither run would get a round done (walked, session 23: both ran on for 10 minutes at round 0); idle agents
    would take this run's job for their federation's. Read by a client of its own, which takes nothing from the live
    nodes (``NodeTwin``'s check must take the node's session)."""
    run, found = cfg.run.name, threading.Event()
    live: dict[str, str] = {}

    def on_status(topic: str, data: bytes) -> None:
        record = decode_status(data, topic)
        if record is not None and record.get("state") in LIVE_STATES:
            live.setdefault(topic.rsplit("/", 1)[-1], str(record.get("instance", "?")))
            found.set()

    loop = ThreadLoop("run-check").start()
    probe = opts.transport(f"run-check-{new_instance()[:8]}", run, loop, persistent=False)
    try:
        probe.subscribe(topics.statuses(run), on_status)  # the cloud's and the cells'
        probe.subscribe(topics.device_statuses(run), on_status)  # every cell's devices'
        probe.connect()
        if probe.wait_subscribed(10.0):
            found.wait(LIVE_CHECK_WAIT)
    finally:
        probe.close()
        loop.stop()
    if live:
        node, instance = next(iter(live.items()))
        raise TwinError(
            f"run {run!r}: another run or federation of this name is live on the broker at {opts.url} (its {node}, "
            f"instance {instance}, says it is up): nodes of one name take each other's broker sessions; give this run "
            "another name (--set run.name=...), or stop the other run first"
        )


class LocalFederation:
    """The cloud and cells of ``cfg``'s federation as services on threads of this process, with their job
    folder ``out``. ``cloud_opts`` / ``cell_opts[cell]``: their brokers (their sockets on ``reactor``);
    ``parts(job_cfg)``: the cloud's part of the job; ``build_cell(job_cfg, cell, transport)``: a cell's
    server for the job. ``resume``: a ``fedtier run --resume``: a job the queue holds unfinished is
    superseded by the one submitted now (which continues from the checkpoint, see ``JobParts.resume``)."""

    def __init__(
        self,
        cfg: RunConfig,
        out: Path,
        cloud_opts: BrokerOptions,
        cell_opts: dict[str, BrokerOptions],
        reactor: Any,
        parts: Callable[[RunConfig], JobParts],
        build_cell: Callable[[RunConfig, str, Transport], CellServer],
        on_round: Callable[[dict[str, Any]], None] | None = None,
        resume: bool = False,
    ) -> None:
        self.cfg, self.cloud_opts = cfg, cloud_opts
        bundle = federation_bundle(cfg)
        run = cfg.run.name
        queue = JobQueue(out / runfiles.JOBS)
        for job in list(queue.jobs.values()):
            if job.state not in ENDED and resume:
                queue.end(job.job, "cancelled", "superseded by a fedtier run --resume")
        loop = ThreadLoop(f"cloud-{run}")

        def connect() -> Transport:
            return cloud_opts.transport(
                "cloud", run, loop, will=offline_will(run, "cloud", cfg), reactor=reactor
            ).connect()

        self.cloud = CloudService(
            bundle,
            loop,
            connect,
            queue,
            parts,
            trust=node_trust(cfg, "cloud"),
            operator=None,
            on_end=self._ended,
            on_round=on_round,
            job_folder=lambda job: out,
        )
        self.cells = {c: self._cell(bundle, c, cell_opts[c], reactor, build_cell) for c in cfg.topology.cell_ids()}
        self.server: CloudServer | None = None  # the job's cloud server, once the job ended
        self.errors: list[BaseException] = []
        self.raised = False  # the first error was raised by check()
        self.threads: list[threading.Thread] = []

    def _cell(
        self, bundle: RunConfig, cell: str, opts: BrokerOptions, reactor: Any, build: Callable[..., CellServer]
    ) -> CellService:
        run, node = self.cfg.run.name, topics.cell_node(cell)
        loop = ThreadLoop(f"cell-{cell}")

        def connect() -> Transport:
            return opts.transport(node, run, loop, will=offline_will(run, node, self.cfg), reactor=reactor).connect()

        return CellService(bundle, cell, loop, connect, lambda cfg, t: build(cfg, cell, t), node_trust(self.cfg, cell))

    def _ended(self, job: Job, cfg: RunConfig, server: CloudServer, out: Path) -> None:
        """The job ended (finished, failed or cancelled): keep its server; the cloud serves no other."""
        self.server = server
        self.cloud.stop()

    # ------------------------------------------------------------------ lifecycle (the caller's thread)
    def start(self) -> None:
        """Start the cloud and the cells, each serving on a thread of its own."""
        for name, service in (("cloud", self.cloud), *self.cells.items()):
            node = "cloud" if service is self.cloud else f"cell {name}"
            thread = threading.Thread(target=self._serve, args=(node, service), name=f"fedtier-{name}", daemon=True)
            thread.start()
            self.threads.append(thread)

    def _serve(self, node: str, service: CloudService | CellService) -> None:
        """Serve ``service`` (``node`` names it); what stops it is kept for :meth:`check`, which raises the first
        (the command says it). Another node stopped by the same cause (every node's broker refused them) is not
        said again, one stopped by another is (the cloud and 100 cells said one refused broker 101 times)."""
        try:
            service.serve()
        except BaseException as exc:
            said = any(str(other) == str(exc) for other in self.errors)
            self.errors.append(exc)
            first = self.errors[0] is exc
            log.log(logging.DEBUG if first or said else logging.ERROR, "%s stopped: %s", node, exc)

    def check(self) -> None:
        """Raise what stopped a service, if one stopped with an error."""
        if self.errors:
            self.raised = True
            raise self.errors[0]

    def stop(self) -> None:
        """Stop every service (as SIGTERM would) and wait for their threads."""
        services: list[CloudService | CellService] = [self.cloud, *self.cells.values()]
        for service in services:
            service.stop()
        deadline = time.monotonic() + STOP_TIMEOUT
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("%s did not stop within %.0f s", thread.name, STOP_TIMEOUT)
        if self.errors and not self.raised:  # (what stopped a node after the job: never raised, so said here)
            log.error("%s", self.errors[0])

    # ------------------------------------------------------------------ the operator
    def submit(self, text: str, timeout: float = SUBMIT_TIMEOUT) -> str:
        """Submit ``text`` as one job, as ``fedtier submit`` does; its id once the cloud accepted it
        (:class:`ConfigError` with the cloud's reason if it refused it)."""
        deadline = time.monotonic() + timeout
        while not self._cloud_subscribed():  # else the submission reaches nobody
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cloud did not subscribe to its job topic within {timeout:.0f} s")
            time.sleep(0.02)
        run, job = self.cfg.run.name, f"run-{new_session()[:8]}"  # unique: a broker keeps old jobs' records
        loop = ThreadLoop("operator").start()
        operator = self.cloud_opts.transport("operator", run, loop, persistent=False).connect()
        try:
            pending = post_request(operator, run, submit_record(JobRequest(job, text)), job, None, timeout)
            while (reply := pending.answer) is None:
                self.check()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the cloud did not answer job {job} within {timeout:.0f} s")
                time.sleep(0.02)
        finally:
            operator.close()
            loop.stop()
        if not reply.get("accepted"):
            raise ConfigError(f"the cloud refused the job: {reply.get('reason')}")
        return job

    def _cloud_subscribed(self) -> bool:
        transport: Any = self.cloud.transport  # an MqttTransport
        return transport is not None and bool(transport.wait_subscribed(0.1))

    def wait(self, job: str, before_start: Callable[[], None]) -> Job:
        """Until ``job`` ended; ``before_start()`` is called meanwhile until its first round (it raises to
        fail fast, e.g. on an agent worker that died)."""
        while True:
            entry = self.cloud.queue.get(job)
            if entry is not None and entry.state in ENDED:
                return entry
            self.check()
            node = self.cloud.node
            if node is None or not node.started:
                before_start()
            time.sleep(0.05)
