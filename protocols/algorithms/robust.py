"""Robust aggregation of model deltas at a cell (over devices) or at the cloud (over cells).

``aggregator`` (``cell_aggregator`` / ``cloud_aggregator`` of :class:`RobustParams`):

* ``mean``: the weighted mean (weights: samples), exactly :func:`protocols.params.weighted_mean`.
* ``median``: the coordinate-wise median (Yin et al. 2018), unweighted.
* ``trimmed_mean``: per coordinate, drop the ``b = floor(trim_beta * n)`` largest and smallest values and
  average the rest (Yin et al. 2018), unweighted.
* ``krum``: the one input whose summed squared distance to its ``n - f - 2`` nearest others is smallest
  (Blanchard et al. 2017), ``f = floor(krum_byzantine * n)``.
* ``multikrum``: the weighted mean of the ``m`` inputs with the best Krum scores (``multikrum_keep``;
  0: ``n - f``).
* ``majority``: signSGD with majority vote (Bernstein et al. 2019), the 1-bit baseline beside the scaled
  SignSGD codec: per coordinate the sign of the unweighted sum of the inputs' signs (a tie gives 0),
  times, per tensor, the inputs' mean absolute value (so with ``uplink = "signsgd"`` and
  ``signsgd_mode = "scaled"`` it needs no extra learning rate). One input, one vote.

Weights are claims of the senders, so the coordinate-wise rules ignore them (a Byzantine sender could
claim any weight). Every aggregation says whom it left out and why: Krum/Multi-Krum name the inputs
not selected, with their score; median and trimmed mean name the inputs whose values fell outside the
kept band (the ``b``-th to ``(n-1-b)``-th order statistics, ``b >= 1`` for the median) in more than half
of the coordinates. Inputs are taken in sender-id order, so the result does not depend on arrival order.

Where a runtime puts the sums elsewhere (``protocols.params.sums_on``: ``fedtier sim``'s cells on the cohort
engine's GPU), the weighted means go there (``mean``, and Krum's and Multi-Krum's kept inputs), bit for bit; the
coordinate-wise rules and Krum's distances stay numpy's (a GPU sort may order -0.0 and +0.0 otherwise, a GPU matrix
product rounds otherwise, majority's mean is numpy's pairwise sum: not the same bits).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from .. import params as P
from .base import TrainParams
from .traits import Layer, Trait

log = logging.getLogger("fedtier.aggregate")
AggregatorName = Literal["mean", "median", "trimmed_mean", "krum", "multikrum", "majority"]


class RobustParams(TrainParams):
    """How cells aggregate their devices' deltas and the cloud its cells' reports."""

    cell_aggregator: AggregatorName = Field(
        default="mean",
        description="mean | median | trimmed_mean | krum | "
        "multikrum | majority: how a cell combines its devices' deltas",
    )
    cloud_aggregator: AggregatorName = Field(default="mean", description="the same, for the cloud over cells")
    trim_beta: float = Field(
        default=0.2, ge=0, lt=0.5, description="trimmed_mean: fraction cut at each end per coordinate"
    )
    krum_byzantine: float = Field(
        default=0.2, ge=0, lt=0.5, description="krum/multikrum: fraction f/n of the inputs assumed Byzantine"
    )
    multikrum_keep: int = Field(default=0, ge=0, description="multikrum: inputs averaged (0: n - f)")

    def layers(self) -> tuple[Layer, ...]:
        out = list(super().layers())
        if self.cell_aggregator != "mean":
            why = "the cell's robust aggregator needs each device's update, not their sum"
            out.append(Layer("algorithm.cell_aggregator", self.cell_aggregator, frozenset({Trait.CELL_SUM}), why=why))
        if self.cloud_aggregator != "mean":
            why = "the cloud's robust aggregator needs each cell's update, not their sum"
            out.append(
                Layer("algorithm.cloud_aggregator", self.cloud_aggregator, frozenset({Trait.CLOUD_SUM}), why=why)
            )
        return tuple(out)

    def check_topology(self, cells: Mapping[str, Sequence[str]]) -> None:
        super().check_topology(cells)
        smallest = min((len(devices) for devices in cells.values()), default=0)
        check_tier("cell", self.cell_aggregator, smallest, "devices in the smallest cell", self)
        check_tier("cloud", self.cloud_aggregator, len(cells), "cells", self)

    def idle_keys(self) -> dict[str, str]:
        out = super().idle_keys()
        chosen = {self.cell_aggregator, self.cloud_aggregator}
        uses = {
            "trim_beta": ("trimmed_mean",),
            "krum_byzantine": ("krum", "multikrum"),
            "multikrum_keep": ("multikrum",),
        }
        for key, rules in uses.items():
            if not chosen & set(rules):
                out[key] = "cell_aggregator or cloud_aggregator = " + " | ".join(f'"{r}"' for r in rules)
        return out


def robust_params(params: TrainParams) -> RobustParams:
    """The robust aggregation settings of ``params`` (their defaults, the plain mean, for algorithms whose
    parameters have none)."""
    return params if isinstance(params, RobustParams) else RobustParams(name=params.name)


def too_few(rule: str, n: int, params: TrainParams, what: str = "inputs") -> str | None:
    """Why aggregator ``rule`` cannot do what it says over ``n`` inputs (``what`` names them), or ``None``: Krum
    needs ``n > 2f + 2`` (:func:`_krum_short` says what fails), a trimmed mean must cut one at each end
    and Multi-Krum must leave one out (else either is the plain mean). The rule of the configuration's check
    (:func:`check_tier`) and of a round that got fewer inputs (:func:`aggregate` says so)."""
    p = robust_params(params)
    f = math.floor(p.krum_byzantine * n)
    if rule == "krum" and n <= 2 * f + 2:
        return (
            f"needs more than 2f + 2 inputs (f = floor(krum_byzantine x n) = {f}); the {n} {what} are not: "
            + _krum_short(n, f)
        )
    if rule == "trimmed_mean" and math.floor(p.trim_beta * n) == 0:
        return f"trim_beta = {p.trim_beta:g} cuts floor({p.trim_beta:g} x {n}) = 0 of the {n} {what} at each end"
    if rule == "multikrum" and (p.multikrum_keep or n - f) >= n:
        keep = f"multikrum_keep = {p.multikrum_keep}" + (
            f": n - f, f = floor(krum_byzantine x n) = {f}" if not p.multikrum_keep else ""
        )
        return f"keeps all {n} {what} ({keep}): it is their plain mean"
    return None


def _krum_short(n: int, f: int) -> str:
    """What fails when Krum gets ``n <= 2f + 2`` inputs: the rule with its numbers, and what Krum then does."""
    rule = f"n = {n} <= 2f + 2 = {2 * f + 2}"
    if n <= 1:
        return f"{rule}; its one input is its result"
    if n <= f + 3:  # each score sums the n - f - 2 (at least 1) nearest distances: one, shared by the closest pair
        return (
            f"{rule}, and n <= f + 3 = {f + 3}: each input's score is its distance to its nearest other, so the two "
            "closest inputs tie and it always keeps the first"
        )
    return (
        f"{rule}: its bound on how far f = {f} Byzantine inputs can pull the input it selects holds only for "
        "n > 2f + 2 (Blanchard et al. 2017)"
    )


def check_tier(key: str, rule: str, n: int, what: str, params: TrainParams, where: str = "") -> None:
    """Raise ``ValueError`` naming the tier (``key``: cell or cloud, ``where`` it aggregates), ``n`` and the
    parameter when ``{key}_aggregator = rule`` can never do what it says over the ``n`` inputs that tier gets
    (:func:`too_few`)."""
    reason = too_few(rule, n, params, what)
    if reason is None:
        return
    if rule == "krum":
        raise ValueError(f'{key}_aggregator = "krum"{where} {reason} (use median, or more {what})')
    if rule == "multikrum":
        raise ValueError(
            f'{key}_aggregator = "multikrum"{where} {reason} (set multikrum_keep below {n}, or use median)'
        )
    raise ValueError(
        f'algorithm.{reason}{where}: {key}_aggregator = "{rule}" would be the plain mean; set trim_beta '
        f">= {1 / n:.3g} (or use median)"
    )


@dataclass
class Aggregate:
    """The combined delta, the total weight of the inputs it represents, and who was left out, why."""

    delta: dict[str, np.ndarray]
    weight: float
    excluded: dict[str, str] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    too_few: str | None = None  # why the aggregator could not do what it says over these inputs (:func:`too_few`)

    def notes(self) -> dict[str, str]:
        """What a record says of this aggregation beyond who was left out: ``too_few_inputs``, when so."""
        return {"too_few_inputs": self.too_few} if self.too_few is not None else {}


def aggregate(
    kind: str, items: Sequence[tuple[str, float, Mapping[str, np.ndarray]]], params: TrainParams
) -> Aggregate:
    """Combine ``(sender, weight, delta)`` items (sorted by sender here) with aggregator ``kind``. A round that got
    fewer inputs than the rule needs (:func:`too_few`) is aggregated all the same (Krum keeps the first of its tied
    scores, a trimmed mean that cuts nobody is the mean, one input is itself), logged, and said in
    :attr:`Aggregate.too_few`, which the roles put in their records (:meth:`Aggregate.notes`)."""
    out = _combine(kind, sorted(items, key=lambda it: it[0]), params)
    out.too_few = too_few(kind, len(items), params)
    if out.too_few is not None:
        log.warning("%s over %d inputs %s", kind, len(items), out.too_few)
    return out


def _combine(kind: str, items: Sequence[tuple[str, float, Mapping[str, np.ndarray]]], params: TrainParams) -> Aggregate:
    """:func:`aggregate`'s arithmetic over ``items`` sorted by sender."""
    if not items:
        raise ValueError("aggregate of nothing")
    ids = [i for i, _, _ in items]
    if kind == "mean" or len(items) == 1:
        mean, total = P.weighted_mean((w, d) for _, w, d in items)
        return Aggregate(dict(mean), total, {}, ids)
    names = list(items[0][2])
    stack = {k: np.stack([np.asarray(d[k], dtype=np.float64) for _, _, d in items]) for k in names}
    n, total = len(items), float(sum(w for _, w, _ in items))
    if kind == "majority":
        votes = {
            k: (np.abs(s).reshape(n, -1).mean(axis=1).mean() * np.sign(np.sign(s).sum(axis=0))).astype(np.float32)
            for k, s in stack.items()
        }
        return Aggregate(votes, total, {}, ids)
    if kind in ("median", "trimmed_mean"):
        beta = robust_params(params).trim_beta
        b = min(int(math.floor(beta * n)), (n - 1) // 2)
        out: dict[str, np.ndarray] = {}
        outside = np.zeros(n)
        coords = 0
        for k, s in stack.items():
            ordered = np.sort(s, axis=0)
            out[k] = (np.median(s, axis=0) if kind == "median" else ordered[b : n - b].mean(axis=0)).astype(np.float32)
            band = max(b, 1) if kind == "median" else b
            if band:
                lo, hi = ordered[band], ordered[n - 1 - band]
                outside += ((s < lo) | (s > hi)).reshape(n, -1).sum(axis=1)
            coords += s[0].size
        share = outside / max(coords, 1)
        excluded = {
            ids[i]: f"{kind}: {share[i]:.0%} of its coordinates outside the kept band"
            for i in range(n)
            if share[i] > 0.5
        }
        return Aggregate(out, total, excluded, ids)
    if kind in ("krum", "multikrum"):
        flat = np.concatenate([s.reshape(n, -1) for s in stack.values()], axis=1)
        sq = (flat * flat).sum(axis=1)
        dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T, 0.0)
        f = int(math.floor(robust_params(params).krum_byzantine * n))
        near = min(max(n - f - 2, 1), n - 1)
        scores = np.array([np.sort(np.delete(dist[i], i))[:near].sum() for i in range(n)])
        order = sorted(range(n), key=lambda i: (scores[i], i))
        keep_n = 1 if kind == "krum" else (robust_params(params).multikrum_keep or n - f)
        keep = sorted(order[: min(keep_n, n)])
        rank = {i: r for r, i in enumerate(order, start=1)}
        mean, weight = P.weighted_mean((items[i][1], items[i][2]) for i in keep)
        excluded = {
            ids[i]: f"{kind}: score {scores[i]:.4g} ranked {rank[i]} of {n}, {len(keep)} kept (f = {f})"
            for i in range(n)
            if i not in keep
        }
        return Aggregate(dict(mean), weight, excluded, [ids[i] for i in keep])
    raise ValueError(f"unknown aggregator {kind!r}")
