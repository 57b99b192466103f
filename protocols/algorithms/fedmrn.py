"""FedMRN (Li et al., ACM MM 2024): devices learn 1-bit masks over seeded noise; the uplink is a seed
plus the packed mask bits.

Device (Alg. 1): the cell model ``w`` stays frozen; per masked tensor the device draws noise ``n`` from a
fresh seed (``codecs/mrn.py`` documents the scheme) and trains a shadow update ``u`` (zero at the
start of every edge round) with plain SGD through progressive stochastic masking: at local step
``tau`` of ``S`` the forward pass uses ``w + u_hat``, ``u_hat`` mixing the stochastically masked noise
(probability ``tau/S``) and the clipped ``u``; the gradient at ``w + u_hat`` is applied to ``u``
unchanged (straight-through). Tensors that are not masked (1-D: biases, norm scales) are trained as
ordinary parameters and sent in float32. The final mask is one fresh sample from the final ``u``.
Gradients come from ``Trainer.loss_and_grad`` at the substituted parameters, so any backend that
computes gradients works.

Cell: rebuilds each device's ``n * m`` from its seed and mask and averages (weighted by samples) as
hierarchical FedAvg does, or with ``cell_aggregator``. Its report to the cloud is the cheaper, in exact encoded
bytes, of the dense cell delta and the forwarded masks and seeds of every kept device result of the round (each
with its edge round and weight, from which the cloud rebuilds the same edge-round averages; only when the cell's
aggregator is a weighted mean of the kept devices: mean, krum, multikrum); the choice and both sizes appear in
the cell aggregation record's ``metrics``. The cloud combines the cells' (rebuilt) deltas with ``cloud_aggregator``.

What a lying device can send: masked values ``n * m`` only (``|n| <= alpha`` for uniform and bernoulli noise;
gauss noise is unbounded in principle, and the seed is the device's word), but float32 extras and a weight
(bounded by ``security.max_device_weight``) of its choosing: under the mean one device's extras move the model
anywhere (``tests/test_robust_fedalign_fedmrn.py``); a robust aggregator bounds them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from .. import params as P
from ..numbers import finite_number
from ..rejections import Rejected, RejectKind
from ..seeding import derive_seed, rng
from ..trainer import LocalData, Trainer, batches, num_steps
from ..wire.payload import Payload
from .base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole
from .codecs.base import expect_array, parse_seed, unpack_bits, wire_size
from .codecs.mrn import FedMRNCodec, NoiseKind, masked_value, sample_mask
from .fedavg import FedAvgCell, FedAvgCloud
from .outcome import Outcome
from .robust import RobustParams
from .traits import Trait

FORWARD_MASK = "mask."
MEAN_OF_KEPT = ("mean", "krum", "multikrum")  # cell aggregators whose result the forwarded masks rebuild


class FedMRNParams(RobustParams):
    """FedMRN's ``[algorithm]`` keys (FedMRN-S: ``signed = true``), with the robust aggregators: a device's
    masked tensors are bounded by construction (each value ``n * m``, ``|n| <= alpha`` for uniform and bernoulli
    noise), its float32 extras (1-D tensors) are not, so ``cell_aggregator`` / ``cloud_aggregator`` bound them."""

    noise: NoiseKind = Field(default="uniform", description="distribution of the seeded noise the masks select from")
    alpha: float = Field(default=0.01, gt=0, description="noise scale: U[-a, a], N(0, a) or {-a, +a}")
    signed: bool = Field(default=False, description="signed masks {-1,+1} (FedMRN-S) instead of {0,1}")
    stochastic: bool = Field(default=True, description="stochastic masking (false: deterministic, ablation)")
    progressive: bool = Field(default=True, description="progressive masking tau/S (false: p = 1, ablation)")
    mask_vectors: bool = Field(default=False, description="mask 1-D tensors too (else float32)")
    cell_uplink: Literal["auto", "dense", "masks"] = Field(
        default="auto",
        description="cell -> cloud: the cheaper (auto), the dense delta, or the forwarded masks (only under "
        "cell_aggregator mean, krum or multikrum; under another, auto is dense)",
    )

    @model_validator(mode="after")
    def _forwarding_fits(self) -> FedMRNParams:
        if self.cell_uplink == "masks" and self.cell_aggregator not in MEAN_OF_KEPT:
            raise ValueError(
                'cell_uplink = "masks" forwards the kept devices\' masks, from which the cloud rebuilds their '
                f'weighted mean: a cell_aggregator = "{self.cell_aggregator}" result is no such mean, so it '
                f'cannot travel as masks (use cell_uplink = "dense" or "auto", or cell_aggregator = '
                '"mean" | "krum" | "multikrum")'
            )
        return self


@dataclass
class MaskedUpdate:
    """What a device's local training produced: the seed, its noise, the final masks, the extras."""

    seed: int
    noise: OrderedDict[str, np.ndarray]
    masks: OrderedDict[str, np.ndarray]
    extras: OrderedDict[str, np.ndarray]
    loss: float
    steps: int

    def delta(self) -> OrderedDict[str, np.ndarray]:
        """The masked noise ``n * m`` of every masked tensor."""
        return OrderedDict((k, self.noise[k] * self.masks[k]) for k in self.masks)


class FedMRNDevice(DeviceRole):
    writes_task = False  # it copies what it changes (its task is read-only, shared by its cell in sim)

    def __init__(self, params: FedMRNParams, codec: FedMRNCodec) -> None:
        self.p, self.codec = params, codec

    def local_update(
        self, w: Mapping[str, np.ndarray], data: LocalData, trainer: Trainer, ctx: DeviceContext
    ) -> MaskedUpdate:
        """Progressive stochastic masking from the frozen model ``w`` (Alg. 1, ClientLocalUpdate)."""
        p, codec = self.p, self.codec
        seed = derive_seed(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "fedmrn-noise")
        noise = codec.noise_for(seed, w)
        u = OrderedDict((k, np.zeros_like(n)) for k, n in noise.items())
        extras = OrderedDict((k, np.array(w[k], dtype=np.float32)) for k in codec.extra_names(w))
        g = rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "fedmrn-masking")
        steps = num_steps(len(data), p.batch_size, p.local_steps, p.local_epochs)
        lr, wd = np.float32(p.lr), np.float32(p.weight_decay)
        total, samples = 0.0, 0
        order = batches(
            len(data), p.batch_size, steps, rng(ctx.seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, "batches")
        )
        for tau, idx in enumerate(order, start=1):
            prob = tau / steps if p.progressive else 1.0
            current = OrderedDict()
            for k, v in w.items():
                if k in noise:
                    current[k] = v + masked_value(u[k], noise[k], p.signed, prob, g, p.stochastic)
                else:
                    current[k] = extras[k]
            trainer.set_params(current)
            loss, grads = trainer.loss_and_grad(*data.batch(idx))
            for k, grad in grads.items():
                if wd:
                    grad = grad + wd * current[k]
                target = u[k] if k in u else extras[k]
                target -= lr * grad  # straight-through: the gradient at w + u_hat updates u
            total += loss * len(idx)
            samples += len(idx)
        masks = OrderedDict((k, sample_mask(u[k], n, p.signed, g if p.stochastic else None)) for k, n in noise.items())
        extra_delta = OrderedDict((k, extras[k] - w[k]) for k in extras)
        return MaskedUpdate(seed, noise, masks, extra_delta, total / max(1, samples), steps)

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        update = self.local_update(task.tensors, data, trainer, ctx)
        out = self.codec.pack(update.seed, update.masks, update.extras)
        out.meta.update({"weight": len(data), "loss": update.loss, "steps": update.steps})
        return out


class FedMRNCell(FedAvgCell):
    """Hierarchical FedAvg over decoded masked noise; reports dense or forwarded masks, whichever is smaller."""

    def __init__(self, params: FedMRNParams, cell: str, codec: FedMRNCodec) -> None:
        super().__init__(params, cell)
        self.codec: FedMRNCodec = codec
        self.mode = params.cell_uplink
        self.forwards = params.cell_aggregator in MEAN_OF_KEPT  # else the dense delta is the only report
        self.entries: list[tuple[int, float, str, np.ndarray]] = []
        self._report: Payload | None = None

    def begin(self, round: int, task: Payload) -> None:
        super().begin(round, task)
        self.entries, self._report = [], None

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        out = super().aggregate(edge_round, results)
        for _, r in sorted((d, r) for d, r in results.items() if d not in out.excluded):  # the kept devices
            self.entries.append((edge_round, float(r.meta["weight"]), r.meta["seed"], r.tensors["mask"]))
        if edge_round == self.edge_rounds - 1:
            self._report, choice = self._choose()
            out = out.with_metrics(**choice)
        return out

    def _choose(self) -> tuple[Payload, dict[str, Any]]:
        dense = super().report()
        if not dense.tensors:
            return dense, {}
        dense.meta["uplink"] = "dense"
        if not self.forwards:
            return dense, {"cell_uplink": "dense", "cell_uplink_bytes": wire_size(dense)}
        forward = self._forward(dense)
        sizes = {"dense": wire_size(dense), "masks": wire_size(forward)}
        pick = self.mode if self.mode != "auto" else min(sizes, key=lambda m: (sizes[m], m != "masks"))
        return (forward if pick == "masks" else dense), {
            "cell_uplink": pick,
            "cell_uplink_bytes": sizes[pick],
            "cell_dense_bytes": sizes["dense"],
            "cell_masks_bytes": sizes["masks"],
        }

    def _forward(self, dense: Payload) -> Payload:
        tensors: OrderedDict[str, np.ndarray] = OrderedDict(
            (f"{FORWARD_MASK}{i}", mask) for i, (_, _, _, mask) in enumerate(self.entries)
        )
        for k in self.codec.extra_names(self.base):
            tensors[k] = dense.tensors[k]
        meta = {**dense.meta, "uplink": "masks", "entries": [[e, w, s] for e, w, s, _ in self.entries]}
        return Payload(meta, tensors)

    def report(self) -> Payload:
        if self._report is None:
            self._report, _ = self._choose()
        return self._report


class FedMRNCloud(FedAvgCloud):
    """FedAvg's cloud that also accepts cell reports made of forwarded masks and seeds."""

    def __init__(self, params: FedMRNParams, initial: Mapping[str, np.ndarray], codec: FedMRNCodec) -> None:
        super().__init__(params, initial)
        self.codec = codec

    def check(self, cell: str, report: Payload) -> None:
        if report.meta.get("uplink") != "masks":
            return super().check(cell, report)
        what = f"report of cell {cell}"
        weight = report.meta.get("weight")
        if (number := finite_number(weight)) is None or number <= 0:
            raise Rejected(RejectKind.BOUND, f"{what}: weight must be a positive number, got {str(weight)[:40]}")
        entries = report.meta.get("entries")
        if not isinstance(entries, list) or not entries:
            raise Rejected(RejectKind.MALFORMED, f"{what}: entries must be a non-empty list")
        count = self.codec.masked_count(self.model)
        extras = self.codec.extra_names(self.model)
        names = [f"{FORWARD_MASK}{i}" for i in range(len(entries))] + extras
        if list(report.tensors) != names:
            raise Rejected(
                RejectKind.SHAPE, f"{what}: expected tensors {names[:3]}..., got {list(report.tensors)[:3]}..."
            )
        for i, entry in enumerate(entries):
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and isinstance(entry[0], int)
                and 0 <= entry[0] < self.p.edge_rounds
                and (weight := finite_number(entry[1])) is not None
                and weight > 0
            ):
                raise Rejected(
                    RejectKind.MALFORMED,
                    f"{what}: entry {i} must be [edge round < {self.p.edge_rounds}, weight > 0, seed]",
                )
            parse_seed(entry[2], f"{what}: entry {i}")
            unpack_bits(report.tensors[f"{FORWARD_MASK}{i}"], count, f"{what}: mask {i}")
        if any(a[0] > b[0] for a, b in zip(entries, entries[1:])):
            raise Rejected(RejectKind.INCONSISTENT, f"{what}: entries must be in edge-round order")
        for k in extras:
            expect_array(report.tensors[k], np.float32, self.model[k].shape, f"{what}: {k}")

    def rebuild(self, report: Payload) -> Payload:
        """The dense delta a forwarded-masks report stands for: the sum over edge rounds of the weighted
        means of ``n * m`` (as the cell applied them), plus the cell's float32 extras."""
        masked = OrderedDict((k, self.model[k]) for k in self.codec.masked_names(self.model))
        total = P.zeros_like(masked)
        entries = report.meta["entries"]
        for e in sorted({entry[0] for entry in entries}):
            group = [
                (
                    entry[1],
                    self.codec.masked_delta(
                        parse_seed(entry[2], "seed"), report.tensors[f"{FORWARD_MASK}{i}"], self.model
                    ),
                )
                for i, entry in enumerate(entries)
                if entry[0] == e
            ]
            mean, _ = P.weighted_mean(group)
            total = P.add(total, mean)
        delta = OrderedDict((k, total[k] if k in total else report.tensors[k]) for k in self.model)
        return Payload(report.meta, delta)

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        dense = {c: self.rebuild(r) if r.meta.get("uplink") == "masks" else r for c, r in reports.items()}
        return super().aggregate(round, dense)


class FedMRN(Algorithm):
    """FedMRN / FedMRN-S over the device -> cell -> cloud hierarchy (hierarchical FedAvg aggregation)."""

    name = "fedmrn"
    Params = FedMRNParams
    traits = frozenset({Trait.CLOUD_SUM})
    without = {
        Trait.CELL_SUM: "FedMRN's cell decodes each device's seed and masks; use fedavg/hist with dense updates",
        Trait.PLAIN_DELTA_UPLINK: "FedMRN's devices send a seed and packed mask bits",
        Trait.VERSIONED: "FedMRN's cells choose their uplink once per synchronous cloud round",
    }

    def codec(self) -> FedMRNCodec:
        p = self.params
        return FedMRNCodec(p.noise, p.alpha, p.signed, p.mask_vectors)  # type: ignore[attr-defined]

    def cloud(self) -> CloudRole:
        return FedMRNCloud(self.params, self.initial_params(), self.codec())  # type: ignore[arg-type]

    def cell(self, cell: str) -> CellRole:
        return FedMRNCell(self.params, cell, self.codec())  # type: ignore[arg-type]

    def device(self, device: str) -> DeviceRole:
        return FedMRNDevice(self.params, self.codec())  # type: ignore[arg-type]
