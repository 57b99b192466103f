"""Differential privacy for hierarchical FedAvg and HIST: per-device clipping and Gaussian noise.

:class:`PrivateAlgorithm` wraps an algorithm's roles, so every runtime (``fedtier sim`` with either engine,
``fedtier run``, deployed agents and cells) runs the same mechanism:

* every device clips its update (the dense delta, before it is sent) to L2 norm ``clip`` and claims weight
  1 (sample counts would leak and would let a device outweigh the clip); it leaves its training loss and
  its step count out (``reveals_data_size = False``: its runtime announces no sample count either, and
  its secure-aggregation weight bound is 1);
* ``mode = "local"``: the device adds N(0, (z clip)^2) to each coordinate of its clipped update;
* ``mode = "cell"``: the cell clips every result again (so a device that skips clipping, e.g. a
  Byzantine one, is bounded too), and adds N(0, (z clip)^2) once to the sum of the clipped updates; the
  cell's update is that noisy sum over the number of answering devices (a count treated as public);
* ``mode = "cell"`` under secure aggregation (the cell sees only the sum): each device adds
  N(0, (z clip)^2 / m) (``shares`` = m) and secure aggregation unmasks no sum of fewer than m survivors,
  so every sum released carries at least the noise of cell DP (distributed DP);
* the cloud adds the epsilon spent so far (``protocols.privacy.accountant``) to each round's metrics and
  says when the next round would exceed the budget (``stop_reason``).

Noise is drawn from ``rng(noise_seed, round, edge_round, cell, device, "dp-noise")``: the same seed gives the
same model. Whoever knows that seed can subtract the noise, so a deployment gives it only to the noising
party (``privacy.noise_seed = "system"`` draws it from the OS, not reproducible).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from ..algorithms.base import Algorithm, CellRole, CloudRole, DeviceContext, DeviceRole
from ..algorithms.outcome import Outcome
from ..algorithms.traits import Trait
from ..divergence import nonfinite
from ..round_text import nth
from ..seeding import rng
from ..trainer import LocalData, Trainer
from ..wire.payload import Payload
from .accountant import Accountant

NOISE = "dp-noise"


@dataclass(frozen=True)
class DpSettings:
    """The mechanism of a run: ``mode``, clip norm ``C``, noise multiplier ``z``, noise seed."""

    mode: Literal["local", "cell"]
    clip: float
    noise_multiplier: float
    noise_seed: int | Literal["system"]
    shares: int | None = None  # cell DP under secure aggregation: devices add 1/shares of the noise's variance

    @property
    def std(self) -> float:
        """Standard deviation of the Gaussian noise (z C)."""
        return self.noise_multiplier * self.clip

    @property
    def device_std(self) -> float:
        """The noise a device adds: all of it (local DP), its share (cell DP under secure aggregation), none."""
        if self.mode == "local":
            return self.std
        return self.std / math.sqrt(self.shares) if self.shares else 0.0

    def seed(self) -> int:
        """The noise seed of this process (``system``: a fresh secret one)."""
        return secrets.randbits(63) if self.noise_seed == "system" else int(self.noise_seed)


def l2_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of all tensors together (in float64)."""
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in tensors.values()))


def clip(tensors: Mapping[str, np.ndarray], bound: float) -> tuple[dict[str, np.ndarray], float]:
    """``tensors`` scaled to L2 norm at most ``bound`` (their dtypes kept), and their norm before."""
    norm = l2_norm(tensors)
    if not math.isfinite(norm):
        raise ValueError("cannot clip a non-finite update")
    factor = min(1.0, bound / norm) if norm > 0 else 1.0
    if factor == 1.0:
        return {k: np.asarray(v) for k, v in tensors.items()}, norm
    # the scaled float32 values may exceed ``bound`` by rounding: shrink by one ulp-scale margin
    factor *= 1 - 1e-6
    return {k: (np.asarray(v, dtype=np.float64) * factor).astype(v.dtype) for k, v in tensors.items()}, norm


def add_noise(tensors: Mapping[str, np.ndarray], std: float, gen: np.random.Generator) -> dict[str, np.ndarray]:
    """``tensors`` plus i.i.d. N(0, std^2) noise, drawn in key order (float64, cast to each tensor's dtype)."""
    if std == 0:
        return dict(tensors)
    return {
        k: (np.asarray(v, dtype=np.float64) + gen.normal(0.0, std, size=np.shape(v))).astype(v.dtype)
        for k, v in tensors.items()
    }


class PrivateDevice(DeviceRole):
    """Trains like ``inner``; clips the update, adds its noise (local DP: all of it; cell DP under secure
    aggregation: its share), claims weight 1 and says nothing of its data's size."""

    reveals_data_size = False

    def __init__(self, inner: DeviceRole, dp: DpSettings) -> None:
        self.inner, self.dp, self.noise_seed = inner, dp, dp.seed()
        self.writes_task = inner.writes_task  # it writes into none of the task itself

    def train(self, task: Payload, data: LocalData, trainer: Trainer, ctx: DeviceContext) -> Payload:
        out = self.inner.train(task, data, trainer, ctx)
        if nonfinite(out) is not None:  # diverged: the runtime sends it as "diverged", never aggregated
            return out
        update, _ = clip(out.tensors, self.dp.clip)
        if self.dp.device_std > 0:
            update = add_noise(
                update, self.dp.device_std, rng(self.noise_seed, ctx.round, ctx.edge_round, ctx.cell, ctx.device, NOISE)
            )
        meta = {k: v for k, v in out.meta.items() if k not in ("loss", "steps")}  # both tell the data's size
        meta["weight"] = 1
        return Payload(meta, update)


class PrivateCell(CellRole):
    """``inner`` with cell-level DP: results clipped, weight 1 each, noise added once to their sum."""

    def __init__(self, inner: CellRole, dp: DpSettings, cell: str) -> None:
        self.inner, self.dp, self.cell, self.noise_seed = inner, dp, cell, dp.seed()
        self.edge_rounds = inner.edge_rounds
        self.round = 0

    def begin(self, round: int, task: Payload) -> None:
        self.round = round
        self.inner.begin(round, task)

    def plan(self, edge_round: int, available: Sequence[str]) -> dict[str, Payload]:
        return self.inner.plan(edge_round, available)

    def check(self, device: str, result: Payload) -> None:
        self.inner.check(device, result)

    def aggregate(self, edge_round: int, results: Mapping[str, Payload]) -> Outcome:
        if (
            self.dp.mode != "cell" or self.dp.shares or not results
        ):  # shares: the devices noised, secure aggregation summed
            return self.inner.aggregate(edge_round, results)
        clipped: dict[str, Payload] = {}
        n_clipped = 0
        for device, result in sorted(results.items()):
            update, norm = clip(result.tensors, self.dp.clip)
            n_clipped += norm > self.dp.clip
            clipped[device] = Payload({**result.meta, "weight": 1}, update)
        # the inner role averages with equal weights: noise on one term is noise on the sum
        first = next(iter(clipped))
        gen = rng(self.noise_seed, self.round, edge_round, self.cell, NOISE)
        clipped[first] = Payload(clipped[first].meta, add_noise(clipped[first].tensors, self.dp.std, gen))
        return self.inner.aggregate(edge_round, clipped).with_metrics(dp_clipped=int(n_clipped))

    def report(self) -> Payload:
        return self.inner.report()


class PrivateCloud(CloudRole):
    """``inner`` plus the epsilon spent after each round (the outcome's ``epsilon``) and a stop
    before a round that would spend more than ``budget`` (``stop_reason``)."""

    def __init__(self, inner: CloudRole, accountant: Accountant, budget: float | None) -> None:
        self.inner, self.accountant, self.budget = inner, accountant, budget

    def plan(self, round: int, cells: Sequence[str]) -> dict[str, Payload]:
        return self.inner.plan(round, cells)

    def check(self, cell: str, report: Payload) -> None:
        self.inner.check(cell, report)

    def weight_keys(self) -> dict[str, float]:
        return self.inner.weight_keys()

    def member_keys(self) -> tuple[str, ...]:
        return self.inner.member_keys()

    def member_weight_keys(self) -> dict[str, str]:
        return self.inner.member_weight_keys()

    def aggregate(self, round: int, reports: Mapping[str, Payload]) -> Outcome:
        parties = self.accountant.by_party(round + 1)
        return replace(
            self.inner.aggregate(round, reports),
            epsilon=parties["cloud"],  # against the cloud (what the budget bounds)
            # against a device's cell and the other devices; None: no guarantee (the cell sees the updates)
            epsilon_by_party={k: (v if math.isfinite(v) else None) for k, v in parties.items()},
            epsilon_basis=self.accountant.basis,
        )

    def stop_reason(self, round: int) -> str | None:
        """Why cloud round ``round`` must not start (it would exceed the budget), or None."""
        if self.budget is None:
            return None
        spent = self.accountant.epsilon(round + 1)
        if spent <= self.budget:
            return None
        return (
            f"privacy budget: round {nth(round)} would spend epsilon {spent:.4g} > privacy.epsilon_budget "
            f"{self.budget:g} (delta {self.accountant.delta:g})"
        )

    def global_params(self) -> dict[str, np.ndarray]:
        return self.inner.global_params()

    def state(self) -> Payload:
        return self.inner.state()

    def log_tail(self, start: int) -> dict[str, np.ndarray] | None:
        return self.inner.log_tail(start)

    def load_state(self, state: Payload) -> None:
        self.inner.load_state(state)


class PrivateAlgorithm(Algorithm):
    """``inner`` with its roles wrapped for differential privacy (see the module)."""

    def __init__(self, inner: Algorithm, dp: DpSettings, accountant: Accountant, budget: float | None) -> None:
        super().__init__(inner.params, inner.model, inner.seed, inner.init_seed)
        self.inner, self.dp, self.accountant, self.budget = inner, dp, accountant, budget
        self.name = inner.name  # type: ignore[misc]

    def stack_traits(self) -> frozenset[Trait]:
        return self.inner.stack_traits()

    def initial_params(self) -> dict[str, np.ndarray]:
        return self.inner.initial_params()

    def bind_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        self.inner.bind_topology(cells)

    def tier_refusal(self, tier: str, memory: int | None = None) -> str | None:
        return self.inner.tier_refusal(tier, memory)

    def largest_message(self) -> tuple[int, int, str] | None:
        return self.inner.largest_message()

    def cloud(self) -> CloudRole:
        return PrivateCloud(self.inner.cloud(), self.accountant, self.budget)

    def cell(self, cell: str) -> CellRole:
        return PrivateCell(self.inner.cell(cell), self.dp, cell)

    def device(self, device: str) -> DeviceRole:
        return PrivateDevice(self.inner.device(device), self.dp)
