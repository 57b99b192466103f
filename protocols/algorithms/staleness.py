"""Staleness-weighted buffers of asynchronous aggregation (FedBuff) and the async mode's parameters.

See :mod:`.fedbuff` for the mode; this module holds what ``fedavg``'s parameters and both tiers share.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import Field

from .. import params as P
from ..limits import MAX_SECONDS, memory_refusal
from ..rejections import Rejected, RejectKind
from .base import TrainParams
from .outcome import Outcome
from .traits import Layer, Trait


class AsyncParams(TrainParams):
    """The asynchronous mode's parameters (ignored with ``mode = "sync"``)."""

    mode: Literal["sync", "async"] = Field(
        default="sync", description="async: buffered asynchronous aggregation at cells and cloud (FedBuff; fedavg only)"
    )
    async_buffer: int = Field(default=5, ge=1, description="K: device results per cell update")
    async_push_every: int = Field(default=1, ge=1, description="M: cell updates per push to the cloud")
    async_push_seconds: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SECONDS,
        description="T: a cell with unpushed progress pushes "
        "at least this often (loop-clock seconds; 0: only every M updates)",
    )
    async_cloud_buffer: int = Field(default=1, ge=1, description="cell pushes per cloud update")

    def layers(self) -> tuple[Layer, ...]:
        if self.mode == "sync":
            return super().layers()
        versions = Layer(
            "algorithm.mode",
            self.mode,
            removes=frozenset({Trait.CELL_SUM, Trait.CLOUD_SUM}),
            adds=frozenset({Trait.ASYNC}),
            needs=frozenset({Trait.VERSIONED}),
            why="results are aggregated one by one with staleness weights, by model versions instead of rounds",
        )
        return (*super().layers(), versions)

    def idle_keys(self) -> dict[str, str]:
        out = super().idle_keys()
        if self.mode != "async":
            keys = ("async_buffer", "async_push_every", "async_push_seconds", "async_cloud_buffer")
            out.update(dict.fromkeys((*keys, "staleness_exponent", "max_staleness"), 'mode = "async"'))
        return out

    staleness_exponent: float = Field(
        default=0.5,
        ge=0,
        description="a result s versions old weighs (1 + s)^-exponent (0.5: FedBuff's 1/sqrt(1 + s); 0: no discount)",
    )
    max_staleness: int = Field(
        default=20, ge=0, description="results (and cell pushes) staler than this many versions are dropped and logged"
    )


def buffers_refusal(p: AsyncParams, num_params: int, tier: str, memory: int | None = None) -> str | None:
    """Why ``tier``'s async buffer ("cell" or "cloud") of a model of ``num_params`` float32 parameters would not fit
    ``memory`` (default: this machine's), naming the key; ``None`` in sync mode or when it fits. A cell holds each of
    its ``async_buffer`` results decoded until the buffer is full (:class:`StalenessBuffer`: one model each,
    whichever devices sent them, a device sending again and again); up to ``async_cloud_buffer`` pushes of one cell
    may wait in the cloud behind a version (``cloud.async_server``: one model each). Any such buffer fills (a
    device, or a cell, answers again at once), so only their memory bounds them."""
    if p.mode != "async" or tier not in ("cell", "cloud"):
        return None
    if tier == "cell":
        what = f"algorithm.async_buffer: {p.async_buffer:,} results a cell holds decoded until its buffer is full"
        return memory_refusal(p.async_buffer * 4 * num_params, what, memory)
    what = f"algorithm.async_cloud_buffer: {p.async_cloud_buffer:,} pushes of a cell waiting in the cloud"
    return memory_refusal(p.async_cloud_buffer * 4 * num_params, what, memory)


def staleness_weight(staleness: int, exponent: float) -> float:
    """``(1 + s)^-exponent``."""
    return float((1.0 + staleness) ** -exponent)


@dataclass
class Entry:
    sender: str
    base: int
    weight: float
    delta: Mapping[str, np.ndarray]
    pushes: int = 1
    """How many results it holds: a cloud sums a cell's pushes from one base into one (``fedbuff.FedBuffCloud``)."""


class StalenessBuffer:
    """Holds results until ``size`` arrived, then forms the staleness-weighted step (see the module doc)."""

    def __init__(self, size: int, exponent: float, max_staleness: int) -> None:
        self.size, self.exponent, self.max_staleness = size, exponent, max_staleness
        self.entries: list[Entry] = []

    def admit(self, version: int, base: Any, what: str) -> int:
        """The staleness of a result trained from ``base`` when the holder is at ``version``; raise
        :class:`Rejected` for a version that is not a known past one or that is too stale."""
        if not isinstance(base, int) or isinstance(base, bool) or base < 0:
            raise Rejected(RejectKind.MALFORMED, f"{what}: model version {base!r} is not a version")
        if base > version:
            raise Rejected(RejectKind.STALE, f"{what}: model version {base} is in the future (current {version})")
        staleness = version - base
        if staleness > self.max_staleness:
            raise Rejected(
                RejectKind.STALE,
                f"{what}: stale: version {base} is {staleness} versions old (bound {self.max_staleness})",
            )
        return staleness

    def add(self, sender: str, base: int, weight: float, delta: Mapping[str, np.ndarray]) -> None:
        self.entries.append(Entry(sender, base, float(weight), delta))

    @property
    def held(self) -> int:
        """How many results the buffer holds (an entry may hold several, summed)."""
        return sum(e.pushes for e in self.entries)

    @property
    def full(self) -> bool:
        return self.held >= self.size

    def flush(self, version: int) -> tuple[dict[str, np.ndarray], float, Outcome]:
        """(step, total sample weight, outcome: the senders and staleness numbers) over the buffered results;
        the buffer is emptied. Summed in float64 in (sender, base) order, so the step does not depend on
        arrival order."""
        entries = sorted(self.entries, key=lambda e: (e.sender, e.base))
        self.entries = []
        total = sum(e.weight for e in entries)
        stale = [version - e.base for e in entries]
        acc = P.weighted_sum([(e.weight * staleness_weight(s, self.exponent), e.delta) for e, s in zip(entries, stale)])
        step = {k: (v / total).astype(np.float32) for k, v in acc.items()}
        numbers = {"staleness_mean": float(np.mean(stale)), "staleness_max": int(max(stale))}
        return step, total, Outcome(numbers, senders=tuple(e.sender for e in entries))
