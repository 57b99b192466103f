"""Baseline update compressors: SignSGD (1 bit + scale), top-k sparsification, QSGD quantization.

All three work tensor by tensor on the flat delta (model order) and send no names or shapes: the
cell knows the layout from its model. Stochastic choices draw from ``protocols.seeding.rng(seed, ...)``.

- **SignSGD** (stochastic binarization, as the FedMRN paper runs it): per tensor ``R = max|x|``;
  ``+R`` with probability ``(1 + x/R)/2``, else ``-R`` (unbiased). ``mode="scaled"`` is the
  deterministic ``mean|x| * sign(x)``. Wire: ``bits`` (1 bit per value, 1 = positive) and ``scale``
  (one float32 per tensor): ``ceil(d/8) + 4T`` bytes.
- **Top-k**: per tensor the ``k = max(1, ceil(fraction * n))`` largest magnitudes (ties broken by
  position). Wire: ``idx`` (uint32 flat positions, increasing) and ``val`` (float32): ``8 * sum k``.
- **QSGD** (Alistarh et al. 2017) with ``s`` levels: per tensor ``norm = ||x||_2``; each value becomes
  ``norm * sign(x) * l/s`` where ``l`` rounds ``s|x|/norm`` stochastically to a neighbouring integer
  (unbiased). Wire: ``codes`` (``l*sign + s`` in ``ceil(log2(2s+1))`` bits each) and ``scale``
  (norms): ``ceil(d*b/8) + 4T`` bytes.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal

import numpy as np

from ... import params as P
from ...rejections import Rejected, RejectKind
from ...seeding import rng
from ...wire.payload import Payload
from .base import (
    UplinkCodec,
    expect_array,
    expect_names,
    flatten,
    pack_bits,
    pack_codes,
    segments,
    unflatten,
    unpack_bits,
    unpack_codes,
)


class SignSGDCodec(UplinkCodec):
    """1 bit per value plus one float32 scale per tensor."""

    name = "signsgd"

    def __init__(self, mode: Literal["stochastic", "scaled"] = "stochastic") -> None:
        self.mode = mode

    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        x = flatten(delta)
        bits = np.zeros(x.size, np.uint8)
        scales = np.zeros(len(delta), np.float32)
        g = rng(seed, "signsgd")
        for i, (a, b) in enumerate(segments(delta)):
            seg = x[a:b]
            if self.mode == "stochastic":
                r = np.float32(np.abs(seg).max()) if seg.size else np.float32(0)
                if r > 0:
                    prob = (np.float32(1) + seg / r) * np.float32(0.5)
                    bits[a:b] = g.random(seg.size, dtype=np.float32) < prob
                scales[i] = r
            else:
                bits[a:b] = seg >= 0
                scales[i] = np.abs(seg).mean(dtype=np.float64) if seg.size else 0.0
        return Payload({"codec": self.name}, OrderedDict(bits=pack_bits(bits), scale=scales))

    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        self._check_codec(payload, what)
        expect_names(payload, ["bits", "scale"], what)
        unpack_bits(payload.tensors["bits"], P.num_values(like), f"{what}: bits")
        scale = expect_array(payload.tensors["scale"], np.float32, (len(like),), f"{what}: scale")
        if (scale < 0).any():
            raise Rejected(RejectKind.BOUND, f"{what}: negative scale")

    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        signs = unpack_bits(payload.tensors["bits"], P.num_values(like), "bits").astype(np.float32) * 2 - 1
        scale = payload.tensors["scale"]
        out = np.empty_like(signs)
        for i, (a, b) in enumerate(segments(like)):
            out[a:b] = signs[a:b] * scale[i]
        return unflatten(out, like)

    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        return math.ceil(P.num_values(like) / 8) + 4 * len(like)

    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        return [("bits", 1), ("scale", 1)]


class TopKCodec(UplinkCodec):
    """The largest-magnitude ``fraction`` of each tensor, as (uint32 position, float32 value) pairs."""

    name = "topk"
    seeded = False

    def __init__(self, fraction: float = 0.03) -> None:
        if not 0 < fraction <= 1:
            raise ValueError(f"top-k fraction must be in (0, 1], got {fraction}")
        self.fraction = fraction

    def k_of(self, n: int) -> int:
        return min(n, max(1, math.ceil(self.fraction * n)))

    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        x = flatten(delta)
        picks = []
        for a, b in segments(delta):
            order = np.argsort(-np.abs(x[a:b]), kind="stable")[: self.k_of(b - a)]
            picks.append(np.sort(order) + a)
        idx = np.concatenate(picks).astype(np.uint32) if picks else np.zeros(0, np.uint32)
        return Payload({"codec": self.name}, OrderedDict(idx=idx, val=x[idx.astype(np.int64)].astype(np.float32)))

    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        self._check_codec(payload, what)
        expect_names(payload, ["idx", "val"], what)
        total = sum(self.k_of(v.size) for v in like.values())
        idx = expect_array(payload.tensors["idx"], np.uint32, (total,), f"{what}: idx")
        expect_array(payload.tensors["val"], np.float32, (total,), f"{what}: val")
        if total and (int(idx[-1]) >= P.num_values(like) or (np.diff(idx.astype(np.int64)) <= 0).any()):
            raise Rejected(RejectKind.BOUND, f"{what}: indices must be increasing and below {P.num_values(like)}")

    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        out = np.zeros(P.num_values(like), np.float32)
        out[payload.tensors["idx"].astype(np.int64)] = payload.tensors["val"]
        return unflatten(out, like)

    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        return 8 * sum(self.k_of(v.size) for v in like.values())

    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        return [("idx", 1), ("val", 1)]


class QSGDCodec(UplinkCodec):
    """Unbiased stochastic quantization to ``levels`` levels per sign, scaled by the tensor's L2 norm."""

    name = "qsgd"

    def __init__(self, levels: int = 4) -> None:
        if levels < 1:
            raise ValueError(f"QSGD needs at least 1 level, got {levels}")
        self.levels = levels
        self.width = math.ceil(math.log2(2 * levels + 1))

    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        x = flatten(delta).astype(np.float64)
        s = self.levels
        codes = np.full(x.size, s, np.uint32)  # code s = level 0
        norms = np.zeros(len(delta), np.float32)
        g = rng(seed, "qsgd")
        for i, (a, b) in enumerate(segments(delta)):
            seg = x[a:b]
            # a norm beyond float32's range (values near its maximum) is sent as the largest float32:
            # biased for such a tensor, but finite and within the checks of every receiver
            norm = float(np.float32(min(np.sqrt(np.dot(seg, seg)), np.finfo(np.float32).max)))
            norms[i] = norm
            if norm == 0:
                continue
            scaled = np.minimum(np.abs(seg) / norm * s, s)
            low = np.floor(scaled)
            level = low + (g.random(seg.size) < scaled - low)
            codes[a:b] = (np.sign(seg) * level + s).astype(np.uint32)
        return Payload({"codec": self.name}, OrderedDict(codes=pack_codes(codes, self.width), scale=norms))

    def _codes(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> np.ndarray:
        return unpack_codes(payload.tensors["codes"], P.num_values(like), self.width, f"{what}: codes")

    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        self._check_codec(payload, what)
        expect_names(payload, ["codes", "scale"], what)
        codes = self._codes(payload, like, what)
        if codes.size and int(codes.max()) > 2 * self.levels:
            raise Rejected(RejectKind.BOUND, f"{what}: quantization code above {2 * self.levels}")
        scale = expect_array(payload.tensors["scale"], np.float32, (len(like),), f"{what}: scale")
        if (scale < 0).any():
            raise Rejected(RejectKind.BOUND, f"{what}: negative norm")

    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        levels = self._codes(payload, like, "codes").astype(np.float32) - np.float32(self.levels)
        scale = payload.tensors["scale"]
        out = np.empty_like(levels)
        for i, (a, b) in enumerate(segments(like)):
            out[a:b] = levels[a:b] * (scale[i] / np.float32(self.levels))
        return unflatten(out, like)

    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        return math.ceil(P.num_values(like) * self.width / 8) + 4 * len(like)

    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        return [("codes", 1), ("scale", 1)]
