"""Hierarchical FedAvg (HierFAVG): local SGD on devices, weighted averages at cells and cloud.

Devices run H local steps from the cell model and send their model delta with their sample count.
A cell averages the deltas (weighted by samples), applies them, and repeats for E edge rounds; it
then reports its progress over the cloud round (cell model - cloud model) with its weight, the
samples of the distinct devices that answered. The cloud applies the weighted mean of the reports,
scaled by ``server_lr`` (1 = plain averaging).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import params as P
from ..seeding import rng
from ..trainer import LocalData, Trainer, num_steps
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, Rejected, TrainParams


def check_delta(payload: Payload, reference: Mapping[str, np.ndarray], what: str) -> float:
    """Validate a dense delta with a positive finite ``weight``; return the weight."""
    weight = payload.meta.get("weight")
    if not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight <= 0:
        raise Rejected(f"{what}: weight must be a positive number, got {weight!r}")
    try:
        P.check_like(payload.tensors, reference, what)
    except ValueError as exc:
        raise Rejected(str(exc)) from None
    return float(weight)


class FedAvgCloud(CloudRole):
    def __init__(self, params: TrainParams, initial: Mapping[str, np.ndarray]) -> None:
        self.p = params
        self.model = P.copy(initial)

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {c: task for c in cells}

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("weight") == 0 and not report.tensors:
            return  # no device of the cell answered this round
        check_delta(report, self.model, f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> dict[str, float]:
        reports = {c: r for c, r in reports.items() if r.meta.get("weight")}
        if not reports:
            return {"cells": 0}
        mean, total = P.weighted_mean((r.meta["weight"], r.tensors) for _, r in sorted(reports.items()))
        self.model = P.add(self.model, mean, self.p.server_lr)
        return {"cells": len(reports), "weight": total}

    def global_params(self) -> "dict[str, np.ndarray]":
        return self.model

    def state(self) -> Payload:
        return Payload({}, self.model)

    def load_state(self, state: Payload) -> None:
        P.check_like(state.tensors, self.model, "checkpoint")
        self.model = P.copy(state.tensors)


class FedAvgCell(CellRole):
    def __init__(self, params: TrainParams, cell: str) -> None:
        self.p, self.cell = params, cell
        self.edge_rounds = params.edge_rounds
        self.base: Mapping[str, np.ndarray] = {}
        self.model: Mapping[str, np.ndarray] = {}
        self.weights: dict[str, float] = {}

    def begin(self, round: int, task: Payload) -> None:
        self.base = task.tensors
        self.model = task.tensors
        self.weights = {}

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {d: task for d in available}

    def check(self, device: str, result: Payload) -> None:
        check_delta(result, self.model, f"result of device {device}")

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> dict[str, Any]:
        if not results:
            return {}
        ordered = sorted(results.items())
        mean, _ = P.weighted_mean((r.meta["weight"], r.tensors) for _, r in ordered)
        self.model = P.add(self.model, mean)
        for d, r in ordered:
            self.weights[d] = float(r.meta["weight"])
        return {}

    def report(self) -> Payload:
        weight = sum(self.weights.values())
        if weight == 0:
            return Payload({"weight": 0}, {})
        return Payload({"weight": weight}, P.sub(self.model, self.base))


class FedAvgDevice(DeviceRole):
    def __init__(self, params: TrainParams) -> None:
        self.p = params

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        trainer.set_params(task.tensors)
        steps = num_steps(len(data), self.p.batch_size, self.p.local_steps, self.p.local_epochs)
        stats = trainer.sgd(data, steps=steps, batch_size=self.p.batch_size, lr=self.p.lr,
                            rng=rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches"),
                            weight_decay=self.p.weight_decay)
        delta = P.sub(trainer.get_params(), task.tensors)
        return Payload({"weight": len(data), "loss": stats.loss, "steps": stats.steps}, delta)


class FedAvg(Algorithm):
    """Hierarchical FedAvg; with one cell and E = 1 it is plain FedAvg."""

    name = "fedavg"
    Params = TrainParams

    def cloud(self) -> CloudRole:
        return FedAvgCloud(self.params, self.initial_params())

    def cell(self, cell: str) -> CellRole:
        return FedAvgCell(self.params, cell)

    def device(self, device: str) -> DeviceRole:
        return FedAvgDevice(self.params)
