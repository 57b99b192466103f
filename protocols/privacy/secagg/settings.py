"""What both sides of secure aggregation derive from the run's config and the round, never from the wire:
the settings (degree, threshold, bound), the round's identity, the public neighbour graph, and which algorithm
stacks secure aggregation can serve."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ...algorithms.base import TrainParams
from ...algorithms.compose import needs
from ...algorithms.traits import Trait
from ...seeding import rng


@dataclass(frozen=True)
class SecAggSettings:
    """What both sides derive from the run's config (``[privacy]``): nothing here comes over the wire."""

    seed: int
    threshold: float = 0.5  # t = floor(threshold * degree) + 1 shares reconstruct a secret (> half: see module)
    neighbours: int = 0  # degree of the graph; 0: default_degree (survives 30% dropping; capped at n - 1)
    bound: float = 1.0  # every update value is clipped to [-bound, bound] before quantisation
    min_survivors: int = 0  # no sum of fewer survivors is unmasked (cell DP: each adds 1/min_survivors of the noise)

    def degree(self, n: int) -> int:
        """Neighbours per device among ``n`` devices: ``neighbours``, or by default the smallest even degree
        from 4 log2 n up at which a round with 30% of the devices dropping after sharing fails with
        probability at most 1% (:func:`default_degree`)."""
        if n <= 1:
            return 0
        k = self.neighbours or default_degree(n, self.threshold)
        return min(k + k % 2, n - 1)  # even below n - 1: the ring graph is then symmetric

    def t(self, n: int) -> int:
        """Shares needed to reconstruct a secret of a device among ``n``: more than half its neighbours by
        default (``t > degree / 2``: no two disjoint groups of neighbours both reach it)."""
        k = self.degree(n)
        return min(k, max(2, math.floor(self.threshold * k) + 1)) if k > 1 else 1  # never one share alone

    def survivors_needed(self, n: int) -> int:
        """The fewest survivors whose sum may be unmasked among ``n``: the threshold, or ``min_survivors``."""
        return max(self.t(n), self.min_survivors)


DESIGN_DROPOUT = 0.3  # the default degree survives this fraction of a cell dropping after sharing ...
DESIGN_FAILURE = 0.01  # ... but with this probability (a union bound over the devices)


@functools.lru_cache(maxsize=256)
def default_degree(n: int, threshold: float) -> int:
    """The smallest even k >= 4 log2 n (at most n - 1) such that ``n`` times the chance that a device keeps
    fewer than t = floor(threshold k) + 1 of its k neighbours, each dropping with probability
    ``DESIGN_DROPOUT``, is at most ``DESIGN_FAILURE``: a secret of one of them would then be lost. With
    t > k/2 (the default, against a lying cell) this needs k of about 9-12 log2 n, against 4 log2 n at
    t = k/3."""
    k = 2 * math.ceil(2 * math.log2(n))
    while k < n - 1:
        t = max(2, math.floor(threshold * k) + 1)
        keep = 1 - DESIGN_DROPOUT
        lost = sum(math.comb(k, i) * keep**i * DESIGN_DROPOUT ** (k - i) for i in range(min(t, k + 1)))
        if n * lost <= DESIGN_FAILURE:
            break
        k += 2
    return min(k, n - 1)


@dataclass(frozen=True)
class RoundId:
    """Which aggregation: every key, ciphertext and commitment is bound to it (no replay across rounds)."""

    run: str
    cell: str
    round: int
    edge_round: int

    def label(self, *parts: str) -> bytes:
        return "/".join(["fedtier-secagg", self.run, self.cell, str(self.round), str(self.edge_round), *parts]).encode()


def refusal(params: TrainParams) -> str | None:
    """Why secure aggregation cannot run with these algorithm parameters (``None``: it can). The cell
    only ever sees the sum, so the stack must aggregate a cell's devices by a (weighted) sum of dense
    updates (``Trait.CELL_SUM``)."""
    why = needs(params, Trait.CELL_SUM)
    return None if why is None else f"the cell would see only the sum of its devices' updates; {why}"


def neighbour_graph(devices: Sequence[str], settings: SecAggSettings, rid: RoundId) -> dict[str, list[str]]:
    """A Harary-style graph over ``devices``: in a seeded ring order, each device is joined to its
    ``degree / 2`` successors and predecessors (all others when the degree is n - 1). Public and
    deterministic: every device checks the cell's roster against it."""
    ring = sorted(devices)
    n, k = len(ring), settings.degree(len(ring))
    if k >= n - 1:
        return {d: [e for e in ring if e != d] for d in ring}
    order = [ring[i] for i in rng(settings.seed, rid.round, rid.edge_round, rid.cell, "secagg graph").permutation(n)]
    at = {d: i for i, d in enumerate(order)}
    half = k // 2
    out = {}
    for d in ring:
        i = at[d]
        near = {order[(i + s) % n] for s in range(1, half + 1)} | {order[(i - s) % n] for s in range(1, half + 1)}
        out[d] = sorted(near)
    return out
