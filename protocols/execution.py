"""Where a run's devices train, decided once from ``[runtime]``.

:func:`execution_plan` is the one reading of ``runtime.engine`` and its knobs; the launchers and agent
workers build their executor from the plan (``sim.executors.make_executor``,
``edge_agent.cohort.make_cohort_executor``): per device or as batched cohorts, in this process or in worker
processes / Ray actors, with how many torch threads, on which torch device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .config import RunConfig
    from .trainer import Trainer


@dataclass(frozen=True)
class ExecutionPlan:
    """How the devices of one process (or its workers) train."""

    cohort: bool
    """batched cohorts (``runtime.engine = "cohort"``), else one device at a time"""
    cohort_size: int
    """most devices trained at once in a cohort"""
    device: str
    """the torch device (``runtime.device``)"""
    threads: int
    """torch threads of this process's cohorts (``runtime.cohort_threads``)"""
    workers: int
    """worker processes or Ray actors of ``fedtier sim`` (0: devices train in this process)"""
    backend: Literal["processes", "ray"]
    ray_address: str | None

    def batches(self, trainer: Trainer) -> bool:
        """Whether the devices ``trainer`` serves train as cohorts under this plan (the cohort engine, and a
        trainer that declares it can: ``Trainer.trains_in_cohorts``)."""
        return self.cohort and trainer.trains_in_cohorts

    @property
    def eval_threads(self) -> int:
        """Threads of the cloud's central evaluation: the cohorts' threads with the cohort engine, else 1."""
        return self.threads if self.cohort else 1

    @property
    def worker_threads(self) -> int:
        """Torch threads of each worker's cohorts: ``threads`` shared by the workers (the cloud's evaluation,
        which runs while they wait, takes all of them); never below one."""
        return shared_threads(self.threads, self.workers)


def shared_threads(threads: int, workers: int) -> int:
    """``threads`` shared by ``workers`` (0: this process alone), never below one each."""
    return max(1, threads // max(1, workers))


def execution_plan(cfg: RunConfig) -> ExecutionPlan:
    """The execution plan of run ``cfg``."""
    rt = cfg.runtime
    return ExecutionPlan(
        cohort=rt.engine == "cohort",
        cohort_size=rt.cohort_size,
        device=rt.device,
        threads=rt.cohort_threads,
        workers=rt.sim_workers,
        backend=rt.sim_backend,
        ray_address=rt.ray_address,
    )


def idle_settings(cfg: RunConfig, command: Literal["sim", "run"]) -> list[str]:
    """The ``[runtime]`` performance settings ``cfg`` sets (away from their defaults) that ``fedtier {command}``
    does not use, each with why. They change speed, never results, so a run goes on with them (warned): the
    cohort engine's knobs with ``engine = "device"``; ``fedtier sim``'s workers under ``fedtier run`` (whose
    device agents run in their own worker processes, ``--workers``), or its worker backend without workers."""
    from .algorithms.base import non_defaults

    rt = cfg.runtime

    def changed(*keys: str) -> list[str]:
        return list(non_defaults(rt, dict.fromkeys(keys)))

    out = []
    if rt.engine != "cohort":
        out += [
            f'runtime.{k} = {getattr(rt, k)!r} has no effect with engine = "device" (it sizes the cohort engine)'
            for k in changed("cohort_size", "cohort_threads", "cell_process_threads")
        ]
    if command == "run":
        out += [
            f"runtime.{k} = {getattr(rt, k)!r} has no effect under fedtier run (fedtier sim's device workers; "
            "fedtier run's device agents run in their own worker processes: --workers)"
            for k in changed("sim_workers", "sim_backend", "ray_address")
        ]
        out += [
            f"runtime.{k} = {getattr(rt, k)!r} has no effect under fedtier run (its cells have no engine: they sum "
            "on the host)"
            for k in changed("cell_sums")
        ]
        out += [
            f"runtime.{k} = {getattr(rt, k)!r} has no effect under fedtier run (its cells run in their own processes)"
            for k in changed("cell_processes", "cell_process_threads")
        ]
    elif rt.sim_workers == 0:
        out += [
            f"runtime.{k} = {getattr(rt, k)!r} has no effect without runtime.sim_workers (the devices train in "
            "this process)"
            for k in changed("sim_backend", "ray_address")
        ]
    if command == "sim" and rt.engine == "cohort" and not rt.cell_processes:
        out += [
            f"runtime.{k} = {getattr(rt, k)!r} has no effect without runtime.cell_processes (it sizes their cohorts)"
            for k in changed("cell_process_threads")
        ]
    return out
