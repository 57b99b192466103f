"""Hierarchical FedAvg (HierFAVG): local SGD on devices, weighted averages at cells and cloud.

Devices run H local steps from the cell model and send their model delta with their sample count.
A cell averages the deltas (weighted by samples), applies them, and repeats for E edge rounds; it
then reports its progress over the cloud round (cell model - cloud model) with its weight, the
samples of the distinct devices that answered. The cloud steps the global model with the weighted mean
of the reports through :class:`~.server_opt.ServerOptimizer`: ``server_lr`` times the mean by default
(1 = plain averaging), or FedAvgM / FedAdagrad / FedAdam / FedYogi (``server_optimizer``), optionally
amplifying the progress every ``amplify_period`` rounds by ``amplify_eta`` (off by default).

Communication in full-model units (the HIST paper's metric), derived from bytes sent: each cell reports the
tensor bytes its aggregated devices uploaded (what their uplink codec put on the wire: packed sign bits under
``signsgd``, a submodel under HIST) and how many distinct devices were aggregated; the cloud's ``upload_units``
is those bytes per aggregated device in the round divided by the full model's dense float32 bytes (``E`` for
dense FedAvg with every device in every edge round, ~``E / 32`` under signsgd). Devices that robust
aggregation left out count in neither the bytes nor the devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from .. import params as P
from ..numbers import finite_number, is_count
from ..rejections import Rejected, RejectKind
from ..seeding import rng
from ..trainer import LocalData, Trainer, num_steps
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole, TrainParams
from .codecs import DenseCodec, UplinkCodec, UplinkParams, make_codec, uplink_seed
from .outcome import Outcome
from .robust import RobustParams, aggregate, robust_params
from .server_opt import ServerOptimizer, ServerParams, split_state
from .staleness import AsyncParams, buffers_refusal
from .traits import Trait


def check_delta(
    payload: Payload, reference: Mapping[str, np.ndarray], what: str, codec: UplinkCodec | None = None
) -> float:
    """Validate a delta (dense, or encoded with ``codec``) with a positive finite ``weight``; return the weight."""
    weight = payload.meta.get("weight")
    number = finite_number(weight)  # (an int too large for a float, e.g. 10**400 from JSON, is refused, not raised)
    if number is None or number <= 0:
        raise Rejected(RejectKind.BOUND, f"{what}: weight must be a positive number, got {str(weight)[:40]}")
    (codec or DenseCodec()).check(payload, reference, what)
    return number


def sent_bytes(result: Payload) -> int:
    """The tensor bytes of a device's result: what its uplink codec sent (framing and metadata aside)."""
    return sum(int(t.nbytes) for t in result.tensors.values())


def upload_stats(reports: Mapping[str, Payload]) -> tuple[int, int]:
    """(tensor bytes uploaded by aggregated devices, distinct aggregated devices) summed over cell reports;
    a report whose counts are not integers in [0, MAX_COUNT] (a cell's word: 10**400 is valid JSON) counts nothing."""
    sent = devices = 0
    for r in reports.values():
        b, d = r.meta.get("upload_bytes", 0), r.meta.get("upload_devices", 0)
        if is_count(b) and is_count(d):
            sent, devices = sent + b, devices + d
    return sent, devices


class CommUnits:
    """Per-device upload volume in full-model units, per round and cumulative (HIST paper, Sec. V), from the
    bytes the aggregated devices sent over the full model's dense float32 bytes."""

    def __init__(self, full_bytes: int) -> None:
        self.full, self.total = full_bytes, 0.0

    def update(self, reports: Mapping[str, Payload]) -> dict[str, float]:
        sent, devices = upload_stats(reports)
        units = sent / (self.full * devices) if devices else 0.0
        self.total += units
        return {"upload_units": units, "upload_units_total": self.total}


class ModelCloud(CloudRole):
    """A cloud role that keeps a global model, steps it with the server optimizer (``server_optimizer``,
    amplification) and counts uploads in full-model units; checkpoints all three."""

    def __init__(self, params: TrainParams, initial: Mapping[str, np.ndarray]) -> None:
        self.p = params
        self.model = P.copy(initial)
        self.opt = ServerOptimizer(params)
        self.comm = CommUnits(4 * P.num_values(self.model))  # the dense float32 model

    def global_params(self) -> dict[str, np.ndarray]:
        return self.model

    def state(self) -> Payload:
        opt = self.opt.state()
        return Payload({**opt.meta, "upload_units_total": self.comm.total}, {**self.model, **opt.tensors})

    def load_state(self, state: Payload) -> None:
        model = split_state(state)
        P.check_like(model, self.model, "checkpoint")
        self.opt.load_state(state, self.model)
        self.model = P.copy(model)
        self.comm.total = float(state.meta.get("upload_units_total", 0.0))


class FedAvgCloud(ModelCloud):
    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {c: task for c in cells}

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("weight") == 0 and not report.tensors:
            return  # no device of the cell answered this round
        check_delta(report, self.model, f"report of cell {cell}")

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        reports = {c: r for c, r in reports.items() if r.meta.get("weight")}
        if not reports:
            comm = self.comm.update({})
            self.model, amplified = self.opt.step(round, self.model, None)
            return Outcome({"cells": 0, **comm, **({"amplified": 1} if amplified else {})})
        agg = aggregate(
            robust_params(self.p).cloud_aggregator,
            [(c, r.meta["weight"], r.tensors) for c, r in reports.items()],
            self.p,
        )
        comm = self.comm.update({c: reports[c] for c in agg.kept})  # the devices of the cells aggregated
        self.model, amplified = self.opt.step(round, self.model, agg.delta)
        metrics = {"cells": len(reports), "weight": agg.weight, **comm, **({"amplified": 1} if amplified else {})}
        return Outcome({**metrics, **agg.notes()}, excluded=agg.excluded)


class FedAvgCell(CellRole):
    def __init__(self, params: TrainParams, cell: str) -> None:
        self.p, self.cell = params, cell
        self.edge_rounds = params.edge_rounds
        self.base: dict[str, np.ndarray] = {}
        self.model: dict[str, np.ndarray] = {}
        self.weights: dict[str, float] = {}
        self.upload_bytes = 0
        self.codec = make_codec(params)

    def begin(self, round: int, task: Payload) -> None:
        self.base = task.tensors
        self.model = task.tensors
        self.weights = {}
        self.upload_bytes = 0

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        task = Payload({}, self.model)
        return {d: task for d in available}

    def check(self, device: str, result: Payload) -> None:
        check_delta(result, self.model, f"result of device {device}", self.codec)

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        if not results:
            return Outcome()
        ordered = sorted(results.items())
        deltas = [(d, r.meta["weight"], self.codec.decode(r, self.model)) for d, r in ordered]
        agg = aggregate(robust_params(self.p).cell_aggregator, deltas, self.p)
        self.model = P.add(self.model, agg.delta)
        kept = set(agg.kept)
        for d, w, _ in deltas:
            if d in kept:  # the report's weight: the samples the cell's progress represents
                self.weights[d] = float(w)
                self.upload_bytes += sent_bytes(results[d])
        return Outcome(agg.notes(), excluded=agg.excluded)

    def upload_meta(self) -> dict[str, int]:
        """What the aggregated devices uploaded this cloud round (for the full-model-units metric)."""
        return {"upload_bytes": self.upload_bytes, "upload_devices": len(self.weights)}

    def report(self) -> Payload:
        weight = sum(self.weights.values())
        if weight == 0:
            return Payload({"weight": 0, **self.upload_meta()}, {})
        return Payload({"weight": weight, **self.upload_meta()}, P.sub(self.model, self.base))


class FedAvgDevice(DeviceRole):
    writes_task = False  # it copies what it changes (its task is read-only, shared by its cell in sim)

    def __init__(self, params: TrainParams) -> None:
        self.p = params
        self.codec = make_codec(params)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        trainer.set_params(task.tensors)
        steps = num_steps(len(data), self.p.batch_size, self.p.local_steps, self.p.local_epochs)
        mu, beta = (self.p.prox_mu, self.p.momentum) if isinstance(self.p, FedAvgParams) else (0.0, 0.0)
        options: dict[str, Any] = {**({"prox_mu": mu} if mu else {}), **({"momentum": beta} if beta else {})}
        stats = trainer.sgd(
            data,
            steps=steps,
            batch_size=self.p.batch_size,
            lr=self.p.lr,
            rng=rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches"),
            weight_decay=self.p.weight_decay,
            **options,
        )
        # read once (no copy where the trainer can), written where its message will be (framed without a copy)
        delta, record = P.sub_for_wire(trainer.params_view(), task.tensors)
        out = self.codec.encode(delta, uplink_seed(ctx) if self.codec.seeded else 0)
        out.meta.update({"weight": len(data), "loss": stats.loss, "steps": stats.steps})
        if record is not None and record.holds(out.tensors):  # the delta as it is (dense): framed where it is
            out.headroom = record
        return out


class FedAvgParams(ServerParams, RobustParams, AsyncParams, UplinkParams):
    """FedAvg's parameters: the server optimizer and amplification (cloud), robust aggregation (cells and
    cloud), the asynchronous mode (FedBuff), FedProx's proximal term (devices) and the device -> cell codec
    (``uplink``)."""

    prox_mu: float = Field(
        default=0.0,
        ge=0,
        description="FedProx (Li et al. 2020): devices minimise their loss "
        "+ mu/2 ||w - w_task||^2 (0: FedAvg, bit for bit)",
    )
    momentum: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="devices' local SGD heavy-ball beta (torch's rule; "
        "the buffer starts at zero every edge round; 0: plain SGD, bit for bit)",
    )

    @model_validator(mode="after")
    def _async_fits(self) -> FedAvgParams:
        # which algorithms can run by versions is their trait (Trait.VERSIONED, checked by compose.check_layers)
        if self.mode == "async" and (self.cell_aggregator, self.cloud_aggregator) != ("mean", "mean"):
            raise ValueError(
                'mode = "async" aggregates with staleness weights: set cell_aggregator and cloud_aggregator to "mean"'
            )
        return self


class FedAvg(Algorithm):
    """Hierarchical FedAvg; with one cell and E = 1 it is plain FedAvg (amplified with ``amplify_*``)."""

    name = "fedavg"
    Params = FedAvgParams
    traits = frozenset({Trait.CELL_SUM, Trait.CLOUD_SUM, Trait.PLAIN_DELTA_UPLINK, Trait.VERSIONED})

    def tier_refusal(self, tier: str, memory: int | None = None) -> str | None:
        return buffers_refusal(self.params, self.model.num_params(), tier, memory)  # type: ignore[arg-type]

    def cloud(self) -> CloudRole:
        return FedAvgCloud(self.params, self.initial_params())

    def cell(self, cell: str) -> CellRole:
        return FedAvgCell(self.params, cell)

    def device(self, device: str) -> DeviceRole:
        return FedAvgDevice(self.params)
