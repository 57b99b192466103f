"""``fedtier sim``: the whole hierarchy in one process over the in-memory transport.

The cloud, cell and device runtimes are the very ones deployments use; only the transport differs
(messages are still encoded and decoded, so the bytes counted are the bytes MQTT would carry).
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from cloud.node import build_cloud
from edge_agent.agent import DeviceAgent
from protocols import directions, runfiles
from protocols.algorithms.base import CloudRole
from protocols.bounds import CellBounds
from protocols.checkpoint import save_params
from protocols.config import ConfigError, RunConfig
from protocols.execution import execution_plan, idle_settings
from protocols.failures import CallerHook
from protocols.heap import keep_freed_memory, setup_frozen
from protocols.round_text import nth
from protocols.transport.memory import MemoryHub
from protocols.transport.virtual_loop import CELLS, MAIN, VirtualLoop
from protocols.wire.keys import with_run_keys

from .attack import attacked, byzantine_devices
from .cell_processes import CellProcesses, check_split
from .cell_sums import cell_sums
from .clock import clock_modelled, sim_clock
from .device_worker import set_torch_threads
from .executors import make_executor, start_workers, worker_device
from .hierarchy import (
    DeviceData,
    Prepared,
    cell_availability,
    fresh_output,
    make_evaluator,
    prepare,
)
from .onnx_devices import onnx_trainers, refuse_own_onnx_model
from .population import Population
from .sim_cells import CLOUD, build_sim_cells, device_samples, loop_sides

if TYPE_CHECKING:
    from cloud.server import CloudServer
    from protocols.algorithms.base import Algorithm, ModelSpec

    from .executors import ProcessExecutor, RayExecutor

log = logging.getLogger("fedtier.sim")


@dataclass
class RunResult:
    """What a run produced (also written to its output folder)."""

    config: RunConfig
    params: dict[str, np.ndarray]
    history: list[dict[str, Any]]
    cell_records: list[dict[str, Any]] = field(default_factory=list)
    output_dir: Path | None = None
    wall_s: float = 0.0
    device_traffic: dict[str, dict[str, int]] = field(default_factory=dict)  # bytes_in/out, tasks per device
    wire_bytes: dict[str, int] = field(default_factory=dict)  # MQTT bytes per tier (fedtier run only)
    stopped: str | None = None  # why the cloud stopped before run.rounds (a privacy budget)
    failed: str | None = None  # why the job failed (a stall, a failed cell, a handler's exception)
    earlier: dict[str, Any] | None = None  # a resumed run: the last round record before it (its checkpoint's)
    simulated_time: bool = True  # the loop clock was fedtier sim's (virtual with [clock]); fedtier run's is real
    cells_revoked: dict[str, str] = field(default_factory=dict)  # cells the federation revoked during the job, why
    cells_absent_at_start: dict[str, str] = field(default_factory=dict)  # cells the job began without, why
    job: str | None = None  # a federation's job (fedtier cloud --serve): its id, and its config hash as the cloud
    config_hash: str | None = None  # holds it (``fedtier jobs``); a single run (sim, run, cloud) has neither

    @property
    def status(self) -> str:
        """``finished``, ``stopped`` (before run.rounds, not an error) or ``failed``."""
        return "failed" if self.failed else "stopped" if self.stopped else "finished"

    @property
    def final_accuracy(self) -> float | None:
        for record in (*reversed(self.history), self.earlier or {}):
            if "accuracy" in record:
                return record["accuracy"]
        return None

    @classmethod
    def of_cloud(
        cls,
        cfg: RunConfig,
        cloud: CloudServer,
        output_dir: Path | None,
        wall_s: float,
        cell_records: list[dict[str, Any]] | None = None,
        device_traffic: dict[str, dict[str, int]] | None = None,
        wire_bytes: dict[str, int] | None = None,
        simulated_time: bool = True,
    ) -> RunResult:
        """The result of the job ``cloud`` ran: its global model, round records and how it ended."""
        return cls(
            cfg,
            cloud.role.global_params(),
            cloud.history,
            cell_records or [],
            output_dir,
            wall_s,
            device_traffic or {},
            wire_bytes or {},
            stopped=cloud.stopped,
            failed=cloud.failed,
            earlier=cloud.resumed_from,
            simulated_time=simulated_time,
            cells_revoked=dict(cloud.revoked),
            cells_absent_at_start=dict(cloud.cells_absent_at_start),
        )

    def absent_at_start(self) -> dict[str, str]:
        """Each cell the job began without, why, and the round it first reported in if it joined later."""
        out = {}
        for cell, why in self.cells_absent_at_start.items():
            joined = next((r["round"] for r in self.history if cell in (r.get("cells_reported") or ())), None)
            out[cell] = why if joined is None else f"{why}; took part from round {nth(joined)}"
        return out

    def unrecorded_device_bytes(self) -> dict[str, int]:
        """Per device tier, the bytes ``device_traffic`` counts (what the devices sent and received, this command)
        beyond the round records' ``cumulative_bytes`` of the same rounds (what the cloud's rounds took in):
        results and tasks of an asynchronous run still in flight at its end, or taken by a cell after its last
        push; answers the cells refused (late, stale); tasks a cell sent again (a device back while its result was
        pending: the cells' records' ``bytes_resent``). Tiers where both agree are left out (all, in a run without
        such traffic)."""
        if not self.device_traffic:
            return {}
        last = self.history[-1] if self.history else self.earlier or {}
        before = (self.earlier or {}).get("cumulative_bytes", {})
        recorded = {t: last.get("cumulative_bytes", {}).get(t, 0) - before.get(t, 0) for t in DEVICE_TIERS}
        sent = {"device_to_cell": "bytes_out", "cell_to_device": "bytes_in"}  # as a device counts them
        devices = {t: sum(d.get(sent[t], 0) for d in self.device_traffic.values()) for t in DEVICE_TIERS}
        return {t: devices[t] - recorded[t] for t in DEVICE_TIERS if devices[t] != recorded[t]}

    def summary(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else self.earlier or {}  # a resume of a finished run: its end
        return {
            "run": self.config.run.name,
            **({"job": self.job, "config_hash": self.config_hash} if self.job is not None else {}),
            "status": self.status,
            **({"failed": self.failed} if self.failed else {}),
            "algorithm": self.config.train.name,
            "rounds": last.get("round", -1) + 1,  # a resumed run counts its earlier rounds
            "accuracy": self.final_accuracy,
            "loss": last.get("loss"),
            "cumulative_bytes": last.get("cumulative_bytes", {}),
            "wall_s": round(self.wall_s, 3),
            **({"device_traffic": self.device_traffic} if self.device_traffic else {}),
            **({"unrecorded_device_bytes": unrecorded} if (unrecorded := self.unrecorded_device_bytes()) else {}),
            **({"wire_bytes": self.wire_bytes} if self.wire_bytes else {}),
            **(
                {"virtual_time_s": last.get("clock_s")}
                if self.simulated_time and clock_modelled(self.config.clock)
                else {}
            ),
            **({"epsilon": last["epsilon"]} if "epsilon" in last else {}),
            **{k: last[k] for k in ("epsilon_by_party", "epsilon_basis") if last.get(k) is not None},
            **({"stopped": self.stopped} if self.stopped else {}),
            **({"cells_revoked": self.cells_revoked} if self.cells_revoked else {}),
            **({"cells_absent_at_start": self.absent_at_start()} if self.cells_absent_at_start else {}),
            **({"resumed_after_round": self.earlier["round"]} if self.earlier and "round" in self.earlier else {}),
        }


DEVICE_TIERS = ("device_to_cell", "cell_to_device")
"""The tiers of a device's traffic (``RunResult.device_traffic``), as the round records name them."""


def warn_unclocked_quorum(cfg: RunConfig) -> None:
    """Warn that ``runtime.quorum`` < 1 without a ``[clock]`` cuts the same devices off every edge round."""
    if cfg.runtime.quorum < 1 and not clock_modelled(cfg.clock):
        log.warning(
            "runtime.quorum = %g without a [clock]: the simulation has no device speeds, so every edge round's "
            "quorum is met by the same devices (the first in the simulation's order) and the others never train "
            "the model; model the devices' speeds with [clock] (device_steps_per_s, device_speed_spread)",
            cfg.runtime.quorum,
        )


def warn_idle_settings(cfg: RunConfig, command: Literal["sim", "run"]) -> None:
    """Warn of each ``[runtime]`` performance setting ``fedtier {command}`` does not use (it runs on: they
    change speed, not results; :func:`protocols.execution.idle_settings`)."""
    for line in idle_settings(cfg, command):
        log.warning("%s", line)


def eval_threads(cfg: RunConfig) -> int:
    """Threads of the cloud's central evaluation: ``cohort_threads`` with the cohort engine, else 1."""
    return execution_plan(cfg).eval_threads


def cell_bounds(cfg: RunConfig, device_data: DeviceData) -> CellBounds:
    """Each cell's weight bound at the cloud from its devices' sample counts (computed at its first report)."""
    return CellBounds(
        cfg.topology.cell_ids(),
        cfg.train,
        lambda c: device_samples(device_data, cfg.topology.devices(c)).values(),
        cfg.topology.cell_of,
        lambda c, d: device_samples(device_data, cfg.topology.devices(c)).get(d),
    )


def build_sim_cloud(
    cfg: RunConfig,
    hub: MemoryHub,
    algorithm: Algorithm,
    prep: Prepared,
    output_dir: Path | None,
    on_round: Callable[[dict[str, Any]], None] | None,
    resume: bool,
) -> CloudServer:
    """The cloud on ``hub``: it evaluates on the test split and bounds each cell's weight by its devices'."""
    ds = prep.dataset
    return build_cloud(
        cfg,
        hub.connect(CLOUD),
        algorithm,
        evaluator=make_evaluator(prep.spec, ds.x_test, ds.y_test, cfg.runtime.device, eval_threads(cfg)),
        output_dir=output_dir,
        resume=resume,
        on_round=on_round,
        devices_recreated=True,
        availability=cell_availability(cfg),
        cell_bounds=cell_bounds(cfg, prep.device_data),
    )


class SimHierarchy:
    """The hierarchy of ``cfg`` built on an in-memory hub: ``cloud``, ``cells``, ``agents``.

    Build, optionally tamper with nodes (tests do), then :meth:`run`.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        write_output: bool = True,
        resume: bool = False,
        prepared: Prepared | None = None,
    ) -> None:
        """``prepared``: the data of each device already built (:func:`sim.hierarchy.prepare_given`), instead of
        ``cfg.data``'s dataset and partition; not with ``runtime.sim_workers`` (workers build from the config)."""
        from protocols.torch_trainer import TorchTrainer

        set_torch_threads(1)
        if prepared is not None and (prepared.config is not cfg or cfg.runtime.sim_workers):
            raise ConfigError(
                "prepared data must come from this config, and runtime.sim_workers build their "
                "devices' data from data.dataset (set it to 0)"
            )
        self.t0 = time.perf_counter()
        if write_output:  # [security] keys naming a missing file: fresh keys in the run folder
            cfg = with_run_keys(cfg, cfg.output_dir(), resume)
        self.cfg = cfg
        warn_unclocked_quorum(cfg)
        warn_idle_settings(cfg, "sim")
        loop = VirtualLoop()
        # runtime.sim_workers build their devices while we build ours (unless auto, with a GPU and cohorts,
        # needs the model spec to choose the workers' device)
        early = worker_device(cfg) is not None
        remote = self._start_workers(loop) if early else None
        self.prep = prep = prepared if prepared is not None else prepare(cfg)
        spec = prep.spec
        if not early:
            remote = self._start_workers(loop, spec)
        self.output_dir = fresh_output(cfg, resume) if write_output else None
        directions.set_prefetch(cfg.runtime.direction_threads > 1)  # (free cores: the cloud and cells draw ahead)
        self.algorithm = algorithm = cfg.build_algorithm(spec)
        self.clock = clock = sim_clock(cfg, prep)
        sides = None if cfg.runtime.cell_processes else loop_sides(cfg, algorithm)  # turns, as cell processes take
        self.hub = hub = MemoryHub(loop, link_delay=clock.link_delay if clock.enabled else None, side_of=sides)
        self.cloud = self._build_cloud(on_round, resume)
        if resumed_at := self._resumed_clock():  # a resumed run goes on from its virtual time: its cells start there
            loop.start_at(resumed_at)
        self.split = self._start_split(prepared is not None)  # runtime.cell_processes: the cells elsewhere
        self.cells = {} if self.split else build_sim_cells(cfg, hub, algorithm, prep.device_data, self.output_dir)
        trainer = TorchTrainer.from_spec(
            spec.name, spec.input_shape, spec.num_classes, cfg.runtime.device, **spec.build_kwargs()
        )
        onnx = onnx_trainers(cfg, spec, algorithm, self.output_dir)  # forward-only devices
        self.byzantine = set(byzantine_devices(cfg))  # [attack]: tests, benchmarks/robust.py
        self.agents = Population(
            cfg, hub, algorithm, prep.device_data, lambda d: onnx.get(d, trainer), self._configure
        )  # built as devices are needed
        self.executor = make_executor(execution_plan(cfg), self.agents.active(), spec, loop, trainer, remote)
        self.sums = cell_sums(cfg, self.executor, trainer, spec)  # where the cells sum (runtime.cell_sums)
        for cell in self.cells.values():
            cell.sums = self.sums

    def _start_workers(self, loop: VirtualLoop, spec: ModelSpec | None = None) -> ProcessExecutor | RayExecutor | None:
        """:func:`start_workers`, stopped with this object even if building fails later."""
        remote = start_workers(self.cfg, loop, spec)
        if remote is not None:
            weakref.finalize(self, remote.close)
        return remote

    def _start_split(self, prepared: bool) -> CellProcesses | None:
        """The cell processes of ``runtime.cell_processes`` (refused where unsupported), started now at the cloud's
        virtual time and stopped with this object even if building fails later; ``None`` for 0 (every cell in this
        process)."""
        check_split(self.cfg, self.algorithm, prepared)
        if not self.cfg.runtime.cell_processes:
            return None
        split = CellProcesses(self.cfg, self.hub, self.output_dir, self._resumed_clock())
        weakref.finalize(self, split.close)
        if isinstance(role := self.cloud.role, CloudRole):  # (its idle hook: while the cells' turn runs)
            role.idle_calls, split.waiting = True, role.idle
        return split

    def _resumed_clock(self) -> float:
        """The virtual time a resumed run goes on from (its checkpoint's); 0 for a fresh one."""
        clock = (self.cloud.resumed_from or {}).get("clock_s")
        return float(clock) if isinstance(clock, (int, float)) and clock > 0 else 0.0

    def _build_cloud(self, on_round: Callable[[dict[str, Any]], None] | None, resume: bool) -> CloudServer:
        """:func:`build_sim_cloud` on this hierarchy's hub (tests build a resumed cloud again)."""
        return build_sim_cloud(self.cfg, self.hub, self.algorithm, self.prep, self.output_dir, on_round, resume)

    def _configure(self, agent: DeviceAgent) -> None:
        agent.executor = self.executor
        agent.role = attacked(agent.role, agent.device, self.byzantine, self.cfg.attack)
        if self.clock.enabled:
            agent.compute_delay = self.clock.compute_delay

    def run(self) -> RunResult:
        """Run every round; write the final model and summary; return the result. Workers stop either way. What
        ``on_round`` raised (failing the job) is raised again here."""
        hook = self.cloud.on_round = CallerHook.of(self.cloud.on_round)  # (also one a test set on the cloud)
        try:
            result = self._run()
        finally:
            self.executor.close()
            if self.split is not None:
                self.split.close()
        if hook is not None:  # the job failed on it: the caller's error, not only the job's
            hook.reraise()
        return result

    def _run(self) -> RunResult:
        # what they start is on the cells' side of a loop that has one (as in a cell process)
        with self.hub.loop.acting(CELLS if self.hub.side_of is not None else MAIN):
            for cell in self.cells.values():
                cell.start()
            self.agents.start()
        if self.split is not None:
            self.split.start()
        self.hub.loop.run()  # deliver the birth records before the first round
        self.cloud.start()
        if self.split is not None:
            self.split.run(until=lambda: self.cloud.finished)
        else:
            self.hub.loop.run(until=lambda: self.cloud.finished)
        if not self.cloud.finished:
            raise RuntimeError("the simulation stalled before the last round (no events left)")
        records, traffic = (
            self.split.finish()
            if self.split is not None
            else ([r for c in self.cells.values() for r in c.records], self.agents.traffic())
        )
        result = RunResult.of_cloud(
            self.cfg, self.cloud, self.output_dir, time.perf_counter() - self.t0, records, traffic
        )
        self.agents.stop()
        for cell in self.cells.values():
            cell.stop()
        self.cloud.stop()
        if self.output_dir is not None:
            write_final(self.output_dir, result)
        return result


def check_requirements(cfg: RunConfig) -> None:
    """Refuse, with the reason, a job whose ``[requirements]`` this machine's simulated devices do not meet."""
    if cfg.requirements.nothing_required():
        return
    from protocols.capabilities import machine_caps, unmet

    reason = unmet(machine_caps(), cfg.requirements)
    if reason is not None:
        raise ConfigError(f"requirements: the simulated devices (this machine) do not meet them: {reason}")


def run_simulation(
    cfg: RunConfig,
    *,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    write_output: bool = True,
    resume: bool = False,
) -> RunResult:
    """Run ``cfg`` in memory and return the result; writes the run files unless ``write_output`` is off.
    Simulated devices have this machine's capabilities: a job whose ``[requirements]`` they miss is refused."""
    check_requirements(cfg)
    refuse_own_onnx_model(cfg)
    keep_freed_memory()  # every round frames a model-sized task per device: reuse the memory, not re-fault it
    hierarchy = SimHierarchy(cfg, on_round=on_round, write_output=write_output, resume=resume)
    with setup_frozen():  # the garbage collector does not scan the setup again every few rounds
        return hierarchy.run()


LISTED_DEVICES = 10_000
"""Devices ``summary.json`` lists with their traffic; a run of more writes each one's to ``device_traffic.jsonl`` (a
line a device) and ``summary.json`` their count and totals: 10^6 devices' entries were ~465 MB of indented JSON,
built whole in memory."""


def write_final(out: Path, result: RunResult) -> None:
    """The final model and a summary, next to the logs (the devices' traffic apart past :data:`LISTED_DEVICES`)."""
    save_params(out / runfiles.FINAL_MODEL, result.params)
    summary, apart = result.summary(), out / runfiles.DEVICE_TRAFFIC
    traffic: dict[str, dict[str, int]] = summary.get("device_traffic") or {}
    if len(traffic) > LISTED_DEVICES:
        del summary["device_traffic"]
        with apart.open("w", encoding="utf-8") as f:
            for device, counts in traffic.items():
                f.write(json.dumps({"device": device, **counts}, separators=(",", ":")) + "\n")
        totals = {k: sum(t.get(k, 0) for t in traffic.values()) for k in ("bytes_in", "bytes_out", "tasks")}
        summary["device_traffic_totals"] = {"devices": len(traffic), **totals}
        summary["device_traffic_file"] = runfiles.DEVICE_TRAFFIC
    else:
        apart.unlink(missing_ok=True)  # an earlier run's in this folder: not this one's
    (out / runfiles.SUMMARY).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
