"""A complete fedtier algorithm in one file (the example of docs/how-to/write-an-algorithm.md): norm-bounded FedAvg.

Devices run local SGD and send their model delta with their sample count. Each cell clips every delta
to L2 norm ``max_norm`` before the weighted mean (the norm-bounding defence of Sun et al. 2019), so one
device moves its cell's model by at most ``max_norm`` an edge round, whatever it sends; the cloud steps
the global model by the weighted mean of the cells' progress. Register it, then run it like a built-in::

    from protocols.algorithms import register
    from examples.normclip import NormClip

    register(NormClip)  # now algorithm.name = "normclip" validates
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import Field

from protocols import params as P
from protocols.algorithms.base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, TrainParams
from protocols.algorithms.outcome import Outcome
from protocols.algorithms.traits import Trait
from protocols.rejections import Rejected, RejectKind
from protocols.seeding import rng
from protocols.trainer import LocalData, Trainer, num_steps
from protocols.wire.payload import Payload


# --8<-- [start:params]
class NormClipParams(TrainParams):
    """The ``[algorithm]`` keys: every ``TrainParams`` key plus ``max_norm``."""

    max_norm: float = Field(default=1.0, gt=0, description="a cell clips each device's delta to this L2 norm")


# --8<-- [end:params]


def checked_weight(payload: Payload, reference: Mapping[str, np.ndarray], what: str) -> float:
    """The positive finite ``weight`` of a delta shaped like ``reference``; raise :class:`Rejected` otherwise."""
    weight = payload.meta.get("weight")
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not 0 < weight < math.inf:
        raise Rejected(RejectKind.BOUND, f"{what}: weight must be a positive number")
    P.check_like(payload.tensors, reference, what)  # raises Rejected (shape, non_finite)
    return float(weight)


def clip(delta: Mapping[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """``delta`` scaled to L2 norm at most ``max_norm``, and its norm before."""
    norm = math.sqrt(sum(float(np.square(v, dtype=np.float64).sum()) for v in delta.values()))
    scale = max_norm / norm if norm > max_norm else 1.0
    return {k: (v * scale).astype(v.dtype) for k, v in delta.items()}, norm


# --8<-- [start:cloud]
class NormClipCloud(CloudRole):
    def __init__(self, initial: Mapping[str, np.ndarray]) -> None:
        self.model = P.copy(initial)

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {c: task for c in cells}

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("weight") == 0 and not report.tensors:
            return  # none of the cell's devices answered
        checked_weight(report, self.model, f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        live = [(r.meta["weight"], r.tensors) for r in reports.values() if r.meta.get("weight")]
        if live:
            mean, _ = P.weighted_mean(live)
            self.model = P.add(self.model, mean)
        return Outcome({"cells": len(live)})

    def global_params(self) -> dict[str, np.ndarray]:
        return self.model

    def state(self) -> Payload:
        return Payload({}, self.model)

    def load_state(self, state: Payload) -> None:
        P.check_like(state.tensors, self.model, "checkpoint")
        self.model = P.copy(state.tensors)


# --8<-- [end:cloud]


# --8<-- [start:cell]
class NormClipCell(CellRole):
    def __init__(self, params: NormClipParams) -> None:
        self.p, self.edge_rounds = params, params.edge_rounds

    def begin(self, round: int, task: Payload) -> None:
        self.base = self.model = task.tensors
        self.weights: dict[str, float] = {}

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {d: task for d in available}

    def check(self, device: str, result: Payload) -> None:
        checked_weight(result, self.model, f"result of device {device}")

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        if not results:
            return Outcome()
        items, clipped = [], 0
        for device, result in results.items():  # sorted by device id: the sum's order is fixed
            delta, norm = clip(result.tensors, self.p.max_norm)
            clipped += norm > self.p.max_norm
            items.append((float(result.meta["weight"]), delta))
            self.weights[device] = float(result.meta["weight"])
        mean, _ = P.weighted_mean(items)
        self.model = P.add(self.model, mean)
        return Outcome({"clipped": clipped})

    def report(self) -> Payload:
        weight = sum(self.weights.values())
        if weight == 0:
            return Payload({"weight": 0}, {})
        return Payload({"weight": weight}, P.sub(self.model, self.base))


# --8<-- [end:cell]


# --8<-- [start:device]
class NormClipDevice(DeviceRole):
    def __init__(self, params: NormClipParams) -> None:
        self.p = params

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        p = self.p
        trainer.set_params(task.tensors)
        stats = trainer.sgd(
            data,
            steps=num_steps(len(data), p.batch_size, p.local_steps, p.local_epochs),
            batch_size=p.batch_size,
            lr=p.lr,
            rng=rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches"),
            weight_decay=p.weight_decay,
        )
        delta = P.sub(trainer.get_params(), task.tensors)
        return Payload({"weight": len(data), "loss": stats.loss}, delta)


# --8<-- [end:device]


# --8<-- [start:algorithm]
class NormClip(Algorithm):
    name = "normclip"
    Params = NormClipParams
    # what the roles do (validation, privacy and attacks ask these, never the name), and why not the rest
    traits = frozenset({Trait.CLOUD_SUM, Trait.PLAIN_DELTA_UPLINK})
    without = {
        Trait.CELL_SUM: "normclip's cell clips each device's delta before the mean: it needs every update, not a sum",
        Trait.VERSIONED: "normclip runs synchronous rounds only",
    }

    def cloud(self) -> CloudRole:
        return NormClipCloud(self.initial_params())

    def cell(self, cell: str) -> CellRole:
        return NormClipCell(self.params)  # type: ignore[arg-type]

    def device(self, device: str) -> DeviceRole:
        return NormClipDevice(self.params)  # type: ignore[arg-type]


# --8<-- [end:algorithm]
