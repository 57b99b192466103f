"""``fedtier run``'s agent workers: OS processes (``spawn``) whose devices each hold their own MQTT connection
and client id, as on a real device, several devices per worker. A worker runs an
:class:`edge_agent.service.AgentService` over its devices: it learns the job in progress from the cloud's
retained, signed job record and builds its devices' roles from that record's config (its own bundle holds
no training config), serves the job, and reports its devices' stats when the job ends. Fault injection
(:class:`Faults`) makes workers crash, hold or duplicate for tests."""

from __future__ import annotations

import logging
import os
import signal
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_agent.broker import device_will
from edge_agent.runner import AgentProcess, BrokerOptions
from edge_agent.service import AgentService
from protocols.config import RunConfig, parse_config
from protocols.heap import setup_frozen
from protocols.jobs import JobError
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import topics
from protocols.wire.keys import Trust, load_keys, node_trust

from .hierarchy import device_availability
from .worker_context import become_worker


@dataclass
class Faults:
    """Fault injection for tests: ``crash`` kills a device's worker with SIGKILL when that device
    receives its task for ``(round, edge_round)`` (round ``None``: of any round, e.g. an asynchronous
    cell's first task of a device, ``(None, 0)``, whatever model version it carries); ``duplicate`` publishes every
    device result twice;
    ``hold`` maps a device to ``(round, edge_round, path)``: on that task it creates ``path.held``
    and trains only once ``path`` exists (at most ``HOLD_LIMIT`` seconds), so a test can act while
    the device is known to be mid-task."""

    crash: dict[str, tuple[int | None, int]] = field(default_factory=dict)
    duplicate: bool = False
    hold: dict[str, tuple[int, int, str]] = field(default_factory=dict)

    def on_task(self, device: str, rnd: int, edge: int) -> None:
        """Called by a worker before ``device`` trains its task of ``(rnd, edge)``."""
        crash = self.crash.get(device)
        if crash is not None and crash[0] in (None, rnd) and crash[1] == edge:
            os.kill(os.getpid(), signal.SIGKILL)
        hold = self.hold.get(device)
        if hold is not None and tuple(hold[:2]) == (rnd, edge):
            Path(f"{hold[2]}.held").touch()
            deadline = time.monotonic() + HOLD_LIMIT
            while not os.path.exists(hold[2]) and time.monotonic() < deadline:
                time.sleep(0.02)

    @property
    def devices(self) -> tuple[str, ...]:
        """Devices a fault targets (each gets a worker of its own)."""
        return (*self.crash, *(d for d in self.hold if d not in self.crash))


HOLD_LIMIT = 120.0


AGENTS_PER_CORE = 100
"""Agents below which one more worker process is not worth its ~300 MB (a torch import): a worker's
agents share one I/O thread and train one at a time, so workers only buy cores."""


def agent_workers(agents: int, cores: int | None = None, fd_limit: int | None = None) -> int:
    """Worker processes for ``agents`` emulated devices: one per ``AGENTS_PER_CORE`` agents, at most
    one per core, and enough that no worker needs more sockets than its file-descriptor limit."""
    cores = cores or os.cpu_count() or 1
    if fd_limit is None:
        import resource

        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        fd_limit = 1 << 20 if fd_limit == resource.RLIM_INFINITY else fd_limit
    per_worker = max(1, fd_limit - 64)  # one socket per agent, plus the process's own files
    by_cores = min(cores, -(-agents // AGENTS_PER_CORE))
    return max(1, by_cores, -(-agents // per_worker))


def raise_fd_limit() -> int:
    """Raise this process's soft file-descriptor limit to its hard limit (a worker holds one socket
    per agent); returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def worker_groups(devices: list[str], workers: int, isolate: tuple[str, ...] = ()) -> list[list[str]]:
    """Devices dealt round-robin over ``workers`` processes; each ``isolate`` device gets its own."""
    alone = [d for d in devices if d in isolate]
    rest = [d for d in devices if d not in isolate]
    n = max(1, min(workers, len(rest))) if rest else 0
    return [[d] for d in alone] + [rest[i::n] for i in range(n)]


# ---------------------------------------------------------------------------------------- workers
def with_init_model(cfg: RunConfig, path: str | None) -> RunConfig:
    """``cfg`` starting from the model in ``path``: ``fedtier run``'s ``run.init_model``, a file every node of
    its local federation reads (a job may not name a path on the cloud, see ``protocols.jobs``)."""
    if path is None:
        return cfg
    return cfg.model_copy(update={"run": cfg.run.model_copy(update={"init_model": path})})


def worker_main(job: dict[str, Any], results: Any, parent: int | None = None, inherited: Any = None) -> None:
    """Entry point of a worker process: its devices serve the federation's job in progress until it ends;
    then ``{"agents": stats per device, "sessions": the job sessions served}`` goes to ``results``. ``inherited``:
    the launcher's output and environment (``sim.worker_context``)."""
    become_worker(parent, inherited, job.get("log_level", logging.WARNING))
    raise_fd_limit()
    from edge_agent.runner import load_device_data

    data, shape, classes = {}, None, None
    for device, path in job["devices"].items():
        data[device], shape, classes = load_device_data(path)
    sessions: list[str] = []
    started: list[AgentProcess] = []
    service = worker_service(job, data, (shape, classes), sessions, started)
    service.on_job_end = lambda _job: service.stop()  # one job: the launcher's (``build`` refuses others)
    service.only_job = job.get("job")  # (ended before its devices took it: nothing to serve)
    try:
        with setup_frozen():  # the devices' data and the imports are not scanned by every full collection
            service.serve()
    finally:
        results.put({"agents": started[0].stats() if started else {}, "sessions": sessions})


def worker_service(
    job: dict[str, Any], data: dict[str, Any], shape: tuple[Any, Any], sessions: list[str], started: list[AgentProcess]
) -> AgentService:
    """The :class:`AgentService` of a worker's devices: the bundle ``job["bundle"]`` (no training config), the
    config of job ``job["job"]`` (only) from the cloud's record; ``sessions`` gets each job session it builds
    agents for, ``started`` the agents once started."""
    from edge_agent.runner import make_trainer
    from protocols.algorithms.base import ModelSpec

    bundle = parse_config(tomllib.loads(job["bundle"]))
    fed, first = bundle.run.name, next(iter(data))
    opts = BrokerOptions(**job["broker"])
    cell_brokers = {c: BrokerOptions(**o) for c, o in job.get("cell_brokers", {}).items()}
    faults = Faults(**job.get("faults", {}))
    loop = ThreadLoop(f"agents-watch-{fed}")

    def build(cfg: RunConfig, session: str) -> AgentProcess:
        if job.get("job") is not None and not session.startswith(f"{job['job']}."):  # e.g. a killed run's record
            raise JobError(f"job session {session} is not of job {job['job']}, the one this worker serves")
        cfg = with_init_model(cfg, job.get("init_model"))
        spec = cfg.model_spec(*shape) if all(shape) else ModelSpec.model_validate(job["spec"])
        sessions.append(session)
        return AgentProcess(
            cfg,
            cfg.build_algorithm(spec),
            data,
            make_trainer(job.get("backend", "torch"), spec, cfg),
            opts,
            cell_brokers=cell_brokers,
            on_task=faults.on_task if faults.crash or faults.hold else None,
            timing=job.get("timing", False),
            availability=device_availability(cfg),
            session=session,
            long_lived=True,
        )

    def watch_opts(device: str) -> BrokerOptions:  # the broker of the device's cell
        return cell_brokers.get(bundle.topology.cell_of(device) or "", opts)

    def watch() -> Any:  # a clean session of the first device, on its cell's broker (its will: offline, of now)
        cell = bundle.topology.cell_of(first)
        will = device_will(fed, cell, first, bundle, service.twin.instance, ordered=True) if cell is not None else None
        return watch_opts(first).transport(topics.device_node(first), fed, loop, persistent=False, will=will).connect()

    def on_start(agents: AgentProcess) -> None:
        started.append(agents)
        if faults.duplicate:
            for t in agents.transports.values():
                t.publish = _twice(t.publish)

    watched = [d for d in data if watch_opts(d) == watch_opts(first)]  # said idle on the watch connection
    service = AgentService(bundle, list(data), loop, watch, build, node_trust(bundle, first), signers(bundle, watched))
    service.on_start = on_start
    return service


def signers(bundle: RunConfig, devices: list[str]) -> dict[str, Trust | None]:
    """Each of ``devices``' identity for signing its own idle status before its first job (one read of the keys file;
    ``None`` each in an unsigned run). A device whose private key the file lacks is left out (a status it did not sign
    would be refused)."""
    if not bundle.security.keys:
        return dict.fromkeys(devices)
    private = load_keys(bundle.security.keys).private
    return {d: Trust(d, private[d], {}) for d in devices if d in private}


def _twice(publish: Callable[..., None]) -> Callable[..., None]:
    def publish_twice(topic: str, payload: bytes, **kw: Any) -> None:
        publish(topic, payload, **kw)
        if topic.endswith("/result"):
            publish(topic, payload, **kw)

    return publish_twice
