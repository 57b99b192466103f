"""``fedtier run``: the whole hierarchy on one machine over a real MQTT broker.

The cloud and one cell server per cell run in this process on one :class:`ThreadLoop`; the device
agents run in worker OS processes (``spawn``), each device with its own MQTT connection and client
id, as on a real device, several devices per worker. Each device's partition is written to
``RUN_DIR/devices/<device>.npz`` and a worker loads it from there, as ``fedtier agent`` does.

Start order: broker -> cells and cloud subscribe -> workers connect their devices, which announce
themselves (retained status) -> the cloud waits until every cell reports all its devices online
(``runtime.startup_wait``) -> rounds -> the cloud publishes the retained ``finished`` record ->
agents leave, workers exit. With device-level partial participation, each round's absent devices
really disconnect and rejoin when they take part again (the cloud's retained round manifest tells
them the round; cells wait up to ``runtime.rejoin_wait`` for them), so the run stays bit-identical. Everything is
torn down in ``finally`` (workers are terminated if they
are still alive). Same config and seed -> the same final model, byte for byte, as ``fedtier sim``.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cell_server.node import build_cell
from cloud.node import build_cloud
from edge_agent.cohort import cohort_engine
from edge_agent.runner import AgentProcess, BrokerOptions, offline_will, save_device_data
from protocols import procs, runfiles
from protocols.config import ConfigError, RunConfig, load_config
from protocols.execution import execution_plan
from protocols.transport.bridge import bridge_config
from protocols.transport.broker import find_mosquitto
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking, topics
from protocols.wire.keys import with_run_keys

from .executors import set_torch_threads
from .hierarchy import cell_availability, device_availability, edge_availability, fresh_output, make_evaluator, prepare
from .launcher import RunResult, cell_bounds, device_samples, write_final
from .onnx_devices import export_onnx, with_onnx_model

log = logging.getLogger("fedtier.run")

SYS_STATS = "sys_interval 1\n"  # Mosquitto publishes its $SYS byte counters every second
WIRE_TIERS = ("cloud_to_cell", "cell_to_cloud", "cell_to_device", "device_to_cell", "control")


def wire_by_tier(snapshots: list[dict[str, Any]]) -> dict[str, int]:
    """Bytes on the wire (MQTT framing included) per tier, counted once, at each publisher."""
    total = {t: 0 for t in WIRE_TIERS}
    for snap in snapshots:
        for topic, (out, _in) in snap["by_topic"].items():
            total[topics.tier_of(topic) or "control"] += out
    return total


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
def worker_main(job: dict[str, Any], results: Any) -> None:
    """Entry point of a worker process: run the agents of ``job`` until the run is finished."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops us
    procs.die_with_parent(job.get("parent"))  # a SIGKILLed launcher leaves no worker behind
    logging.basicConfig(level=job.get("log_level", logging.WARNING), format="%(processName)s %(message)s")
    raise_fd_limit()
    from edge_agent.runner import load_device_data, make_trainer
    from protocols.algorithms.base import ModelSpec

    cfg = load_config(job["config"])
    data, shape, classes = {}, None, None
    for device, path in job["devices"].items():
        data[device], shape, classes = load_device_data(path)
    spec = cfg.model_spec(shape, classes) if shape and classes else ModelSpec.model_validate(job["spec"])
    trainer = make_trainer(job.get("backend", "torch"), spec, cfg)
    faults = Faults(**job.get("faults", {}))
    on_task = faults.on_task if faults.crash or faults.hold else None
    cell_brokers = {c: BrokerOptions(**o) for c, o in job.get("cell_brokers", {}).items()}
    agents = AgentProcess(
        cfg,
        cfg.build_algorithm(spec),
        data,
        trainer,
        BrokerOptions(**job["broker"]),
        cell_brokers=cell_brokers,
        on_task=on_task,
        timing=job.get("timing", False),
        availability=device_availability(cfg),
    )
    try:
        agents.start(job.get("connect_timeout", 30.0))
        if faults.duplicate:
            for t in agents.transports.values():
                t.publish = _twice(t.publish)
        agents.wait()
    finally:
        agents.stop()
        results.put(agents.stats())


def _twice(publish: Callable[..., None]) -> Callable[..., None]:
    def publish_twice(topic: str, payload: bytes, **kw: Any) -> None:
        publish(topic, payload, **kw)
        if topic.endswith("/result"):
            publish(topic, payload, **kw)

    return publish_twice


# --------------------------------------------------------------------------------------- launcher
class Emulation:
    """The emulated hierarchy of ``cfg``; :meth:`run` runs it and returns the result.

    ``broker_url``: an external broker (default: the config's ``[broker] url``, else an embedded
    amqtt broker on a free port). ``workers``: agent processes (devices dealt round-robin; None:
    :func:`agent_workers` sizes the pool from the number of agents and cores);
    ``process_per_agent``: one process per device. ``max_chunk``: MQTT chunk size of every node.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        broker_url: str | None = None,
        workers: int | None = None,
        process_per_agent: bool = False,
        max_chunk: int = chunking.DEFAULT_MAX_CHUNK,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        faults: Faults | None = None,
        isolate: tuple[str, ...] = (),
        broker_options: dict[str, Any] | None = None,
        join_timeout: float = 60.0,
        brokers: str = "shared",
        timing: bool = False,
        resume: bool = False,
        metrics: Any = None,
    ) -> None:
        if cfg.runtime.onnx_devices:  # forward-only agents load the run's x_0 from RUN_DIR/model.onnx
            cfg = with_onnx_model(cfg)
        if workers is not None and workers < 1:
            raise ConfigError("--workers must be >= 1")
        if cfg.attack.kind != "none" and cfg.attack.fraction > 0:
            raise ConfigError("attack: Byzantine devices are a fedtier sim option (sim/attack.py), not fedtier run")
        cfg = with_run_keys(cfg, cfg.output_dir())  # [security] keys naming a missing file: fresh ones
        self.cfg, self.on_round, self.faults = cfg, on_round, faults or Faults()
        n = len(cfg.topology.all_devices())
        self.workers = n if process_per_agent else workers or agent_workers(n)
        self.isolate = (
            tuple(isolate) + tuple(d for d in self.faults.devices if d not in isolate) + tuple(cfg.runtime.onnx_devices)
        )  # a worker runs one backend: onnx devices get their own
        self.broker_url = broker_url or cfg.broker.url
        self.broker_options = {k: v for k, v in (broker_options or {}).items() if v is not None}
        self.max_chunk, self.join_timeout = max_chunk, join_timeout
        self.timing = timing  # agents time their training (benchmarks/wire.py)
        self.resume = resume  # continue from the run folder's checkpoint
        self.metrics = metrics  # a monitor.exporter.MetricsExporter that watches the cloud and the cells
        if brokers not in ("shared", "per-cell"):
            raise ConfigError(f"--brokers {brokers!r}: expected 'shared' or 'per-cell'")
        if brokers == "per-cell" and self.broker_url is not None:
            raise ConfigError("--brokers per-cell starts its own brokers: drop --broker / [broker] url")
        if brokers == "per-cell" and find_mosquitto() is None:
            raise ConfigError("--brokers per-cell needs Mosquitto (apt-get install mosquitto)")
        self.brokers = brokers
        self.started_brokers: dict[str, Any] = {}
        self.broker_bytes: dict[str, dict[str, int]] = {}  # per-cell: $SYS byte counters at the end
        self.procs: list[Any] = []
        self.groups: list[list[str]] = []
        self.agent_stats: dict[str, dict[str, Any]] = {}
        self.cells: dict[str, Any] = {}

    def _start_brokers(self) -> tuple[str, dict[str, str]]:
        """The broker URL of the cloud and of each cell: one broker for all (the given one, else
        Mosquitto where installed, else embedded amqtt), or with ``brokers="per-cell"`` a Mosquitto
        per cell bridged to a cloud Mosquitto (``protocols.transport.bridge``)."""
        from protocols.transport.broker import EmbeddedBroker, MosquittoBroker

        cells = self.cfg.topology.cell_ids()

        def mosquitto(name: str, extra: str = "") -> MosquittoBroker:
            # sessions and queued messages persist in the run folder: a broker restart loses nothing
            broker = MosquittoBroker(
                extra_config=SYS_STATS + extra, persistence=self.cfg.output_dir() / runfiles.BROKER / name
            )
            self.started_brokers[name] = broker.start()
            return broker

        if self.brokers == "per-cell":
            cloud = mosquitto("cloud")
            for c in cells:
                mosquitto(c, bridge_config(self.cfg.run.name, c, cloud.url))
            return cloud.url, {c: self.started_brokers[c].url for c in cells}
        if self.broker_url is not None:
            return self.broker_url, {c: self.broker_url for c in cells}
        # amqtt breaks at scale (see EmbeddedBroker): Mosquitto wherever it is installed
        broker = mosquitto("shared") if find_mosquitto() else EmbeddedBroker()
        self.started_brokers["shared"] = broker.start()
        return broker.url, {c: broker.url for c in cells}

    def broker_traffic(self) -> dict[str, dict[str, int]]:
        """Bytes each started Mosquitto received and sent so far (its ``$SYS`` counters), by name:
        ``cloud`` and the cells with ``brokers="per-cell"``, else ``shared``."""
        from protocols.transport.broker import MosquittoBroker
        from protocols.transport.mqtt import sys_bytes

        return {name: sys_bytes(b.url) for name, b in self.started_brokers.items() if isinstance(b, MosquittoBroker)}

    def run(self) -> RunResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        set_torch_threads(1)
        prep = prepare(cfg)
        spec, ds = prep.spec, prep.dataset
        if execution_plan(cfg).cohort:
            cohort_engine(spec, cfg.runtime.device)  # refuse a model the workers could not vectorize, now
        out = fresh_output(cfg, self.resume)
        if not self.resume:  # a fresh run: no broker sessions of an earlier one
            shutil.rmtree(out / runfiles.BROKER, ignore_errors=True)
        device_files = {}
        for device, data in prep.device_data.items():
            device_files[device] = out / "devices" / f"{device}.npz"
            save_device_data(device_files[device], data, spec)
        algorithm = cfg.build_algorithm(spec)
        if cfg.runtime.onnx_devices:
            export_onnx(spec, algorithm.initial_params(), cfg.runtime.onnx_model)
        availability = edge_availability(cfg)

        loop = cloud = None
        cells: dict[str, Any] = {}
        self.cells = cells  # the cell servers, for tests that watch a round
        results: Any = None
        agent_stats: dict[str, dict[str, Any]] = {}
        reactor = Reactor("run-io").start()  # the sockets of the cloud and every cell
        try:
            url, cell_urls = self._start_brokers()
            opts = BrokerOptions.from_config(cfg, url, **self.broker_options, max_chunk=self.max_chunk)
            cell_opts = {c: dataclasses.replace(opts, url=u) for c, u in cell_urls.items()}
            run = cfg.run.name
            loop = ThreadLoop(f"run-{run}").start()
            for c in cfg.topology.cell_ids():
                node = topics.cell_node(c)
                transport = (
                    cell_opts[c]
                    .transport(node, run, loop, will=offline_will(run, node, cfg), reactor=reactor)
                    .connect()
                )
                cells[c] = build_cell(
                    cfg,
                    c,
                    transport,
                    algorithm,
                    availability=availability,
                    output_dir=out,
                    heartbeats=True,
                    samples=device_samples(prep.device_data, cfg.topology.devices(c)),
                )
                if self.metrics is not None:
                    self.metrics.watch_cell(cells[c])
                _on_loop(loop, cells[c].start)
            transport = opts.transport(
                "cloud", run, loop, will=offline_will(run, "cloud", cfg), reactor=reactor
            ).connect()
            cloud = build_cloud(
                cfg,
                transport,
                algorithm,
                evaluator=make_evaluator(spec, ds.x_test, ds.y_test, cfg.runtime.device),
                output_dir=out,
                resume=self.resume,
                startup_wait=cfg.runtime.startup_wait,
                devices_recreated=True,
                on_round=self.on_round,
                availability=cell_availability(cfg),
                cell_bounds=cell_bounds(cfg, prep.device_data),
            )
            if self.metrics is not None:
                self.metrics.watch_cloud(cloud)
            for node in (*cells.values(), cloud):
                node.transport.wait_subscribed()
            _on_loop(loop, cloud.start)
            results = self._spawn(out, device_files, spec, opts, cell_opts)
            self._wait_finished(cloud)
            agent_stats = self.agent_stats = self._collect(results)
            for node in (*cells.values(), cloud):
                _on_loop(loop, node.stop)
            loop.stop()
            wire = wire_by_tier(
                [n.transport.stats.snapshot() for n in (*cells.values(), cloud)]
                + [s["wire"] for s in agent_stats.values()]
            )
            result = RunResult(
                cfg,
                cloud.role.global_params(),
                cloud.history,
                [r for c in cells.values() for r in c.records],
                out,
                time.perf_counter() - t0,
                {d: {k: s[k] for k in ("bytes_in", "bytes_out", "tasks")} for d, s in sorted(agent_stats.items())},
                wire,
                stopped=cloud.stopped,
                failed=cloud.failed,
            )
            write_final(out, result)
            return result
        finally:
            self._terminate()
            if loop is not None:
                loop.stop()
            for node in (*cells.values(), *((cloud,) if cloud is not None else ())):
                if node.transport.connected:
                    node.transport.close(flush_timeout=1.0)
            if results is not None:
                results.close()
            reactor.close()
            if self.brokers == "per-cell" and self.started_brokers:
                self.broker_bytes = self.broker_traffic()
            for b in self.started_brokers.values():
                b.stop()

    # ------------------------------------------------------------------------------- workers
    def _spawn(
        self, out: Path, files: dict[str, Path], spec: Any, opts: BrokerOptions, cell_opts: dict[str, BrokerOptions]
    ) -> Any:
        ctx = mp.get_context("spawn")  # never fork: this process has threads
        results = ctx.Queue()
        level = logging.getLogger().getEffectiveLevel()
        groups = self.groups = worker_groups(self.cfg.topology.all_devices(), self.workers, self.isolate)
        for i, group in enumerate(groups):
            job = {
                "config": str(out / runfiles.CONFIG),
                "devices": {d: str(files[d]) for d in group},
                "spec": spec.model_dump(mode="json"),
                "broker": opts.__dict__,
                "log_level": level,
                "cell_brokers": {c: o.__dict__ for c, o in cell_opts.items() if o != opts},
                "backend": "onnx" if group[0] in self.cfg.runtime.onnx_devices else "torch",
                "faults": {
                    "crash": {d: v for d, v in self.faults.crash.items() if d in group},
                    "hold": {d: v for d, v in self.faults.hold.items() if d in group},
                    "duplicate": self.faults.duplicate,
                },
                "timing": self.timing,
                "parent": os.getpid(),
            }
            proc = ctx.Process(target=worker_main, args=(job, results), name=f"fedtier-agents-{i}", daemon=True)
            procs.spawn(proc.start)
            self.procs.append(proc)
        return results

    def _wait_finished(self, cloud: Any) -> None:
        """Until the cloud finished; fails fast when a worker dies before the first round."""
        while not cloud.finished:
            if not cloud.started:
                dead = [p for p in self.procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
                if dead:
                    raise RuntimeError(
                        f"agent worker {dead[0].name} exited with code {dead[0].exitcode} "
                        "before the first round (see its log above)"
                    )
            time.sleep(0.05)

    def _collect(self, results: Any) -> dict[str, dict[str, Any]]:
        """Every worker's stats (a killed worker sends none); waits up to ``join_timeout`` for them."""
        stats: dict[str, dict[str, Any]] = {}
        expected = len(self.procs)
        got = 0
        deadline = time.monotonic() + self.join_timeout
        while got < expected and time.monotonic() < deadline:
            try:
                stats.update(results.get(timeout=0.2))
                got += 1
            except queue.Empty:
                if all(p.exitcode is not None for p in self.procs) and results.empty():
                    break
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return stats

    def _terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                log.warning("terminating agent worker %s", p.name)
                p.terminate()
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.kill()
                p.join()


def _on_loop(loop: ThreadLoop, fn: Callable[[], None], timeout: float = 30.0) -> None:
    """Run ``fn`` on ``loop`` (so it never races the node's handlers) and wait for it."""
    done = threading.Event()
    error: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised in the caller
            error.append(exc)
        finally:
            done.set()

    loop.post(call)
    if not done.wait(timeout):
        raise TimeoutError(f"{fn!r} did not run on the loop within {timeout} s")
    if error:
        raise error[0]


def run_emulation(cfg: RunConfig, **kwargs: Any) -> RunResult:
    """Run ``cfg`` as an emulated hierarchy over MQTT (see :class:`Emulation` for the options)."""
    return Emulation(cfg, **kwargs).run()
