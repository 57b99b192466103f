"""``fedtier run``: the whole hierarchy on one machine over a real MQTT broker, as a local federation plus
one submitted job (the service code of ``fedtier cloud|cell|agent --serve``).

The cloud and one cell server per cell run in this process as long-lived services (``sim.local_federation``),
each on its own loop; the device agents run in worker OS processes (``sim.agent_workers``), each device with
its own MQTT connection and client id, as on a real device, several devices per worker. Each device's
partition is written to ``RUN_DIR/devices/<device>.npz`` and a worker loads it from there, as
``fedtier agent`` does.

Start order: broker -> the cloud and cells connect -> the run's config is submitted as one job (queued in
``RUN_DIR/jobs.json``) -> the cloud publishes it as the job in progress -> the cells and the workers' agents
take its config from that record, connect their devices, which announce themselves (retained status) -> the
cloud waits until every cell reports its devices online (those taking part; ``runtime.startup_wait``) -> rounds ->
the cloud publishes the retained ``finished`` record -> agents leave, workers exit, the services stop (as on SIGTERM).
With device-level partial participation, each round's absent devices really disconnect and rejoin when they
take part again (the cloud's retained round manifest tells them the round; cells wait up to
``runtime.rejoin_wait`` for them), so the run stays bit-identical. Everything is torn down in ``finally``
(workers are terminated if they are still alive). Same config and seed -> the same final model, byte for
byte, as ``fedtier sim``.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cell_server.node import build_cell
from cell_server.server import CellServer
from cloud.server import CloudServer
from cloud.service import JobParts
from edge_agent.cohort import cohort_engine
from edge_agent.runner import BrokerOptions, save_device_data
from protocols import procs, runfiles
from protocols.config import ConfigError, RunConfig
from protocols.execution import execution_plan
from protocols.failures import CallerHook
from protocols.limits import processes_refusal
from protocols.privacy.ledger import LEDGER_FILE
from protocols.transport.base import Transport
from protocols.transport.bridge import bridge_config
from protocols.transport.broker import find_mosquitto
from protocols.transport.reactor import Reactor
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking, topics
from protocols.wire.keys import with_run_keys

from .agent_workers import Faults, agent_workers, raise_fd_limit, with_init_model, worker_groups, worker_main
from .clock import clock_modelled
from .executors import set_torch_threads
from .hierarchy import Prepared, cell_availability, edge_availability, fresh_output, make_evaluator, prepare
from .launcher import RunResult, cell_bounds, device_samples, warn_idle_settings, write_final
from .local_federation import LocalFederation, federation_bundle, job_text, refuse_live_run
from .onnx_devices import export_onnx, refuse_own_onnx_model, with_onnx_model
from .worker_context import launch, worker_context

__all__ = [
    "Emulation",
    "Faults",
    "agent_workers",
    "raise_fd_limit",
    "run_emulation",
    "say_failed_workers",
    "worker_groups",
]

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
        refuse_own_onnx_model(cfg)
        if cfg.runtime.onnx_devices:  # forward-only agents load the run's x_0 from RUN_DIR/model.onnx
            cfg = with_onnx_model(cfg)
        if workers is not None and workers < 1:
            raise ConfigError("--workers must be >= 1")
        if cfg.attack.kind != "none" and cfg.attack.fraction > 0:
            raise ConfigError("attack: Byzantine devices are a fedtier sim option (sim/attack.py), not fedtier run")
        if clock_modelled(cfg.clock):
            log.warning("[clock] is fedtier sim's virtual clock: fedtier run runs in real time and ignores it")
        cfg = with_run_keys(cfg, cfg.output_dir(), resume)  # [security] keys naming a missing file: fresh ones
        self.cfg, self.on_round, self.faults = cfg, CallerHook.of(on_round), faults or Faults()  # (run() raises it)
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
        processes = min(self.workers, n) + len(self.isolate) + (cfg.topology.cells if brokers == "per-cell" else 0)
        refused = processes_refusal(processes, "agent workers and per-cell brokers")
        if refused is not None:  # before a broker or a worker starts (--process-per-agent: one per device)
            raise ConfigError(refused)
        self.started_brokers: dict[str, Any] = {}
        self.broker_bytes: dict[str, dict[str, int]] = {}  # per-cell: $SYS byte counters at the end
        self.procs: list[Any] = []
        self.groups: list[list[str]] = []
        self.agent_stats: dict[str, dict[str, Any]] = {}
        self.cells: dict[str, CellServer] = {}  # the job's cell servers, as the cells build them
        self.served: list[list[str]] = []  # per worker that reported: the job sessions its agents served
        self.device_files: dict[str, Path] = {}
        self._results: Any = None

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
        from concurrent.futures import ThreadPoolExecutor

        from protocols.transport.broker import MosquittoBroker
        from protocols.transport.sys_counters import sys_bytes

        urls = {name: b.url for name, b in self.started_brokers.items() if isinstance(b, MosquittoBroker)}
        if not urls:
            return {}
        # side by side: each read waits ~1-2 s for the broker's next $SYS publication
        with ThreadPoolExecutor(len(urls), thread_name_prefix="sys-bytes") as pool:
            reads = {name: pool.submit(sys_bytes, url) for name, url in urls.items()}
            return {name: read.result() for name, read in reads.items()}

    def run(self, check_live: bool = False) -> RunResult:
        """Run the config as one job on a local federation; its result (the job's outputs are in the run
        folder). Raises :class:`ConfigError` for a job the cloud refused or could not start, and what ``on_round``
        raised (failing the job). ``check_live`` (``fedtier run``): on an external broker, first refuse to start
        (``protocols.twin.TwinError``) while a cloud, cell or agent of another run of this name is live on it
        (``local_federation.refuse_live_run``)."""
        t0 = time.perf_counter()
        set_torch_threads(1)
        warn_idle_settings(self.cfg, "run")
        prep = prepare(self.cfg)
        out = self._prepare_folder(prep)
        self.cells, self.served, self.procs = {}, [], []
        reactor = Reactor("run-io").start()  # the sockets of the cloud and every cell
        fed: LocalFederation | None = None
        try:
            url, cell_urls = self._start_brokers()
            opts = BrokerOptions.from_config(self.cfg, url, **self.broker_options, max_chunk=self.max_chunk)
            cell_opts = {c: dataclasses.replace(opts, url=u) for c, u in cell_urls.items()}
            if check_live and self.broker_url is not None:  # before this run's nodes take the live one's ids
                refuse_live_run(opts, self.cfg)
            fed = LocalFederation(
                self.cfg,
                out,
                opts,
                cell_opts,
                reactor,
                self._parts(prep),
                self._cell_builder(prep, out),
                self.on_round,
                resume=self.resume,
            )
            fed.start()
            job = fed.submit(job_text(self.cfg))
            self._spawn(job, out, prep, opts, cell_opts)
            ended = fed.wait(job, self._fail_fast)
            if fed.server is None:  # it could not be built: the nodes never saw it
                raise ConfigError(f"job {job} failed: {ended.reason}")
            self.agent_stats = self._collect()
            fed.stop()
            if self.on_round is not None:  # the job failed on it: the caller's error, not only the job's
                self.on_round.reraise()
            return self._result(fed.server, out, t0)
        finally:
            self._terminate()
            if fed is not None:
                fed.stop()
            if self._results is not None:
                self._results.close()
            reactor.close()
            if self.brokers == "per-cell" and self.started_brokers:
                self.broker_bytes = self.broker_traffic()
            for b in self.started_brokers.values():
                b.stop()

    def _prepare_folder(self, prep: Prepared) -> Path:
        """The run folder (a fresh run's old files removed), the devices' data files, the onnx model."""
        cfg = self.cfg
        if execution_plan(cfg).cohort:
            cohort_engine(prep.spec, cfg.runtime.device)  # refuse a model the workers could not vectorize, now
        out = fresh_output(cfg, self.resume)
        # No broker sessions of an earlier command, resumed or not: a resumed run is a new job (its own session), and
        # the stopped job's retained record and the tasks its sessions still queued had its cells take it again and its
        # devices train them, their results then refused as stale (the round waited its device deadline without them)
        shutil.rmtree(out / runfiles.BROKER, ignore_errors=True)
        if not self.resume:  # a fresh run: no privacy ledger of an earlier one
            (out / LEDGER_FILE).unlink(missing_ok=True)
        self.device_files = {d: out / "devices" / f"{d}.npz" for d in prep.device_data}
        prep.device_data.keep_bytes = 0  # each device's samples written once here, trained by its agent: none kept
        for device, data in prep.device_data.items():
            save_device_data(self.device_files[device], data, prep.spec)
        if cfg.runtime.onnx_devices:
            assert cfg.runtime.onnx_model is not None  # with_onnx_model set it
            export_onnx(prep.spec, cfg.build_algorithm(prep.spec).initial_params(), cfg.runtime.onnx_model)
        return out

    def _parts(self, prep: Prepared) -> Callable[[RunConfig], JobParts]:
        """The cloud's part of the job, from the job's config (the cloud's record of it)."""
        ds = prep.dataset

        def parts(job_cfg: RunConfig) -> JobParts:
            job_cfg = with_init_model(job_cfg, self.cfg.run.init_model)
            spec = job_cfg.model_spec(ds.input_shape, ds.num_classes)
            return JobParts(
                job_cfg.build_algorithm(spec),
                make_evaluator(spec, ds.x_test, ds.y_test, job_cfg.runtime.device),
                availability=cell_availability(job_cfg),
                cell_bounds=cell_bounds(job_cfg, prep.device_data),
                devices_recreated=True,
                resume=self.resume,
                collect_cell_records=False,  # the cells write to the run folder themselves
                on_build=self.metrics.watch_cloud if self.metrics is not None else None,
            )

        return parts

    def _cell_builder(self, prep: Prepared, out: Path) -> Callable[[RunConfig, str, Transport], CellServer]:
        """A cell's server for the job's config (the cloud's record of it); kept in ``self.cells``."""
        ds = prep.dataset

        def build(job_cfg: RunConfig, cell: str, transport: Transport) -> CellServer:
            job_cfg = with_init_model(job_cfg, self.cfg.run.init_model)
            spec = job_cfg.model_spec(ds.input_shape, ds.num_classes)
            node = build_cell(
                job_cfg,
                cell,
                transport,
                job_cfg.build_algorithm(spec),
                availability=edge_availability(job_cfg),
                output_dir=out,
                heartbeats=True,
                samples=device_samples(prep.device_data, job_cfg.topology.devices(cell)),
            )
            self.cells[cell] = node  # for tests that watch a round
            if self.metrics is not None:
                self.metrics.watch_cell(node)
            return node

        return build

    def _result(self, cloud: CloudServer, out: Path, t0: float) -> RunResult:
        """The run's result from the job's cloud and cell servers and the agents' stats; written to ``out``."""
        cells = [self.cells[c] for c in self.cfg.topology.cell_ids() if c in self.cells]  # as the sim orders them
        transports: list[Any] = [c.transport for c in cells] + [cloud.transport]  # MqttTransports, with counters
        agent_stats = self.agent_stats
        wire = wire_by_tier([t.stats.snapshot() for t in transports] + [s["wire"] for s in agent_stats.values()])
        result = RunResult.of_cloud(
            self.cfg,
            cloud,
            out,
            time.perf_counter() - t0,
            [r for c in cells for r in c.records],
            {d: {k: s[k] for k in ("bytes_in", "bytes_out", "tasks")} for d, s in sorted(agent_stats.items())},
            wire,
            simulated_time=False,  # its loop clock is the machine's: no virtual time to report
        )
        write_final(out, result)
        return result

    # ------------------------------------------------------------------------------- workers
    def _spawn(
        self, job_id: str, out: Path, prep: Prepared, opts: BrokerOptions, cell_opts: dict[str, BrokerOptions]
    ) -> None:
        """Start the agent workers; each serves job ``job_id`` with the config its devices learn from the cloud."""
        ctx = worker_context()  # never fork: this process has threads (a fork server, or spawn)
        self._results = ctx.Queue()
        level = logging.getLogger().getEffectiveLevel()
        bundle = federation_bundle(self.cfg).to_toml()
        groups = self.groups = worker_groups(self.cfg.topology.all_devices(), self.workers, self.isolate)
        for i, group in enumerate(groups):
            job = {
                "job": job_id,
                "bundle": bundle,
                "devices": {d: str(self.device_files[d]) for d in group},
                "spec": prep.spec.model_dump(mode="json"),
                "init_model": self.cfg.run.init_model,
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
            }
            proc = launch(ctx, worker_main, (job, self._results), f"fedtier-agents-{i}")
            self.procs.append(proc)

    def _fail_fast(self) -> None:
        """Raise if a worker died before the first round (a SIGKILL is a fault a test injected)."""
        dead = [p for p in self.procs if p.exitcode not in (None, 0, -signal.SIGKILL)]
        if dead:
            raise RuntimeError(
                f"agent worker {dead[0].name} exited with code {dead[0].exitcode} "
                "before the first round (see its log above)"
            )

    def _collect(self) -> dict[str, dict[str, Any]]:
        """Every worker's stats (a killed worker sends none); waits up to ``join_timeout`` for them."""
        stats: dict[str, dict[str, Any]] = {}
        got = 0
        deadline = time.monotonic() + self.join_timeout
        while got < len(self.procs) and time.monotonic() < deadline:
            try:
                report = self._results.get(timeout=0.2)
            except queue.Empty:
                if all(p.exitcode is not None for p in self.procs) and self._results.empty():
                    break
                continue
            stats.update(report["agents"])
            self.served.append(report["sessions"])
            got += 1
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        say_failed_workers(self.procs, self.groups)
        return stats

    def _terminate(self) -> None:
        procs.end(self.procs, grace=0.0, what="agent worker")


def say_failed_workers(procs: list[Any], groups: list[list[str]]) -> list[str]:
    """Log each agent worker that exited with an error (a SIGKILL is a fault a test injected), naming its devices
    (``groups``, as ``procs``): what they did is missing from the run's result. Returns those workers' names."""
    failed = [(p, group) for p, group in zip(procs, groups) if p.exitcode not in (None, 0, -signal.SIGKILL)]
    for p, group in failed:
        log.error(
            "agent worker %s (devices %s) exited with code %s during the job (its log is above): what its devices "
            "did is missing from the result",
            p.name,
            ", ".join(group),
            p.exitcode,
        )
    return [p.name for p, _ in failed]


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
