"""Where ``fedtier sim``'s cells sum their devices' results (``runtime.cell_sums``): on the host, or on the torch
device the run's devices train on (:class:`protocols.device_sums.DeviceSums`), decided once here and logged.

``auto`` puts the sums on that device only with the cohort engine on a GPU, and only sums of at least
``protocols.device_sums.AUTO_MIN_BYTES`` of results (fewer are faster on the host, logged): the cells' process is
the critical path there (issue #33), and numpy beats torch on the CPU (``benchmarks/README.md``). The sums are the
same bits either way; only the robust aggregators' weighted means go with them (median, trimmed mean, Krum's
distances and majority stay on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from protocols.algorithms.base import ModelSpec
from protocols.config import RunConfig
from protocols.device_sums import DeviceSums
from protocols.execution import execution_plan
from protocols.torch_trainer import say

from .executors import ProcessExecutor, RayExecutor, worker_device


def cell_sums(cfg: RunConfig, executor: Any, trainer: Any, spec: ModelSpec) -> DeviceSums | None:
    """The place of the cells' sums under ``cfg`` (``None``: the host), given the run's ``executor`` (workers,
    cohorts in this process, or each device on ``trainer``)."""
    mode = cfg.runtime.cell_sums
    if mode == "host" or (mode == "auto" and not execution_plan(cfg).cohort):
        why = "" if mode == "host" else ", engine = device"
        say(f"cells sum on the host (runtime.cell_sums = {mode}{why})")
        return None
    return DeviceSums(
        engine_device(cfg, executor, trainer, spec),
        on_cpu=mode == "engine",
        auto=mode == "auto",
        what=f"cells sum (runtime.cell_sums = {mode})",
    )


def engine_device(cfg: RunConfig, executor: Any, trainer: Any, spec: ModelSpec) -> Callable[[], torch.device]:
    """The torch device the run's devices train on: the sim workers' (``auto`` decided once in this process), the
    in-process cohort engine's (asked at each sum: an ``auto`` engine chooses at its first cohort), else the
    per-device trainer's."""
    if isinstance(executor, (ProcessExecutor, RayExecutor)):
        chosen = torch.device(worker_device(cfg, spec) or cfg.runtime.device)
        return lambda: chosen
    from edge_agent.cohort import CohortExecutor

    if isinstance(executor, CohortExecutor):
        return lambda: executor.engine.device
    device = torch.device(trainer.device)
    return lambda: device
