"""FedMRN's uplink: 1-bit masks over seeded random noise (Li et al., ACM MM 2024).

An update is ``n * m`` with ``n = G(seed)`` and ``m`` a binary ({0,1}) or signed ({-1,+1}) mask.
What travels is the seed (16 hex digits in the metadata) and the masks of the masked tensors packed
8 per byte into one ``uint8`` tensor ``mask`` (``ceil(M/8)`` bytes for M masked values); tensors
that are not masked (1-D tensors: biases, normalisation scales, unless ``mask_vectors``) travel as
float32 deltas under their own names and are counted separately.

**Noise scheme** (deterministic across processes and machines; CPU, numpy only). For the masked
tensors in model order, tensor ``i`` with ``k`` values draws from
``g = protocols.seeding.rng(seed, i)`` (numpy ``PCG64(SeedSequence([seed, i]))``), all in float32:

- ``uniform``:   ``n = (g.random(k, dtype=float32) * 2 - 1) * alpha``  (U[-alpha, alpha])
- ``gauss``:     ``n = g.standard_normal(k, dtype=float32) * alpha``   (std alpha)
- ``bernoulli``: ``n = (2 * g.integers(0, 2, k, dtype=int8) - 1) * alpha``  ({-alpha, +alpha})

then ``n[|n| < 1e-8] = 1e-8`` (never 0: the masks divide by n), reshaped to the tensor's shape.

**Masking** (paper Eq. 6/7, 10): stochastic masking (SM) sets a binary mask to 1 with probability
``clip(u/n, 0, 1)`` and a signed mask to +1 with probability ``clip((u+n)/(2n), 0, 1)``; it is
unbiased (``E[n*m] = u``) while ``u`` lies between 0 and ``n`` (binary) or within ``|n|`` (signed).
Deterministic masking (DM, the ablation) takes ``m = [sign u == sign n]`` or ``m = sign(u/n)``.
The clipped value is ``clip(u/n, 0|-1, 1) * n``. Progressive masking mixes, element-wise with a
Bernoulli(p) selector, the masked value and the clipped value (:func:`masked_value`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Literal

import numpy as np

from ...rejections import Rejected, RejectKind
from ...seeding import rng
from ...wire.payload import Payload
from .base import UplinkCodec, expect_array, expect_names, pack_bits, parse_seed, seed_hex, unpack_bits

NoiseKind = Literal["uniform", "gauss", "bernoulli"]
MASK = "mask"
NOISE_FLOOR = np.float32(1e-8)


def make_noise(seed: int, shape: tuple[int, ...], index: int, kind: NoiseKind, alpha: float) -> np.ndarray:
    """The noise of masked tensor number ``index`` (see the module docstring for the scheme)."""
    k = math.prod(shape)
    g = rng(seed, index)
    a = np.float32(alpha)
    if kind == "uniform":
        n = (g.random(k, dtype=np.float32) * np.float32(2) - np.float32(1)) * a
    elif kind == "gauss":
        n = g.standard_normal(k, dtype=np.float32) * a
    elif kind == "bernoulli":
        n = (g.integers(0, 2, k, dtype=np.int8) * 2 - 1).astype(np.float32) * a
    else:
        raise ValueError(f"unknown noise {kind!r} (uniform, gauss or bernoulli)")
    n[np.abs(n) < NOISE_FLOOR] = NOISE_FLOOR
    return n.reshape(shape)


def sample_mask(u: np.ndarray, n: np.ndarray, signed: bool, g: np.random.Generator | None) -> np.ndarray:
    """Stochastic mask (``g`` given) or deterministic mask (``g`` None) of ``u`` over ``n``, as float32
    {0,1} (binary) or {-1,+1} (signed)."""
    ratio = u / n
    if g is None:
        if signed:
            return np.where(ratio >= 0, np.float32(1), np.float32(-1))
        return (ratio > 0).astype(np.float32)
    draw = g.random(u.shape, dtype=np.float32)
    if signed:
        prob = np.clip((ratio + np.float32(1)) * np.float32(0.5), 0, 1)
        return np.where(draw < prob, np.float32(1), np.float32(-1))
    return (draw < np.clip(ratio, 0, 1)).astype(np.float32)


def clipped(u: np.ndarray, n: np.ndarray, signed: bool) -> np.ndarray:
    """``u`` clipped into the reach of ``n``: ``clip(u/n, 0|-1, 1) * n``."""
    return np.clip(u / n, -1 if signed else 0, 1) * n


def masked_value(
    u: np.ndarray, n: np.ndarray, signed: bool, prob: float, g: np.random.Generator, stochastic: bool = True
) -> np.ndarray:
    """The forward value of progressive (stochastic) masking at masking probability ``prob``.

    Each element is the masked noise ``n * m`` with probability ``prob``, else ``clipped(u, n)``;
    ``prob >= 1`` draws no selector (pure masking). Gradients pass straight through to ``u`` (STE),
    which the caller realises by applying the gradient at this value to ``u`` directly.
    """
    value = n * sample_mask(u, n, signed, g if stochastic else None)
    if prob >= 1:
        return value
    select = g.random(u.shape, dtype=np.float32) < np.float32(prob)
    return np.where(select, value, clipped(u, n, signed))


class FedMRNCodec(UplinkCodec):
    """Packs FedMRN masks with their seed; decodes to the masked noise ``n * m``.

    ``encode(delta, seed)`` masks an arbitrary dense delta post hoc with stochastic masking ("FedAvg
    w. SM" in the paper); the FedMRN device role trains its masks and calls :meth:`pack` instead.
    """

    name = "fedmrn"

    def __init__(
        self, noise: NoiseKind = "uniform", alpha: float = 0.01, signed: bool = False, mask_vectors: bool = False
    ) -> None:
        if not alpha > 0:
            raise ValueError(f"noise alpha must be positive, got {alpha}")
        self.noise, self.alpha, self.signed, self.mask_vectors = noise, alpha, signed, mask_vectors

    # ---------------------------------------------------------------- layout
    def is_masked(self, name: str, value: np.ndarray) -> bool:
        """Weights (2-D and up) are masked; vectors (biases, norm scales) only with ``mask_vectors``."""
        return value.ndim >= 2 or self.mask_vectors

    def masked_names(self, like: Mapping[str, np.ndarray]) -> list[str]:
        return [k for k, v in like.items() if self.is_masked(k, v)]

    def extra_names(self, like: Mapping[str, np.ndarray]) -> list[str]:
        return [k for k, v in like.items() if not self.is_masked(k, v)]

    def noise_for(self, seed: int, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """The noise of every masked tensor of ``like`` for ``seed``."""
        return OrderedDict(
            (k, make_noise(seed, like[k].shape, i, self.noise, self.alpha))
            for i, k in enumerate(self.masked_names(like))
        )

    # ---------------------------------------------------------------- wire
    def pack(self, seed: int, masks: Mapping[str, np.ndarray], extras: Mapping[str, np.ndarray]) -> Payload:
        """The payload of trained ``masks`` (values {0,1} or {-1,+1}) plus full-precision ``extras``."""
        bits = np.concatenate([(np.asarray(m).ravel() > 0) for m in masks.values()]) if masks else np.zeros(0, bool)
        tensors: OrderedDict[str, np.ndarray] = OrderedDict([(MASK, pack_bits(bits))])
        for k, v in extras.items():
            tensors[k] = np.asarray(v, dtype=np.float32)
        return Payload({"codec": self.name, "seed": seed_hex(seed)}, tensors)

    def masks_of(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        """The masks (float32 {0,1} or {-1,+1}) of a checked payload."""
        names = self.masked_names(like)
        count = sum(like[k].size for k in names)
        bits = unpack_bits(payload.tensors[MASK], count, "mask").astype(np.float32)
        if self.signed:
            bits = bits * 2 - 1
        out, pos = OrderedDict(), 0
        for k in names:
            out[k] = bits[pos : pos + like[k].size].reshape(like[k].shape)
            pos += like[k].size
        return out

    def encode(self, delta: Mapping[str, np.ndarray], seed: int) -> Payload:
        noise = self.noise_for(seed, delta)
        g = rng(seed, "fedmrn-posthoc-sm")
        masks = OrderedDict(
            (k, sample_mask(np.asarray(delta[k], np.float32), n, self.signed, g)) for k, n in noise.items()
        )
        return self.pack(seed, masks, OrderedDict((k, delta[k]) for k in self.extra_names(delta)))

    def check(self, payload: Payload, like: Mapping[str, np.ndarray], what: str) -> None:
        self._check_codec(payload, what)
        parse_seed(payload.meta.get("seed"), what)
        extras = self.extra_names(like)
        if MASK in like:
            raise Rejected(
                RejectKind.MALFORMED, f"{what}: the model has a tensor named {MASK!r}, which FedMRN reserves"
            )
        expect_names(payload, [MASK, *extras], what)
        count = sum(like[k].size for k in self.masked_names(like))
        unpack_bits(payload.tensors[MASK], count, f"{what}: mask")
        for k in extras:
            expect_array(payload.tensors[k], np.float32, like[k].shape, f"{what}: {k}")

    def masked_delta(
        self, seed: int, packed: np.ndarray, like: Mapping[str, np.ndarray]
    ) -> OrderedDict[str, np.ndarray]:
        """``n * m`` of every masked tensor, rebuilt from the seed and the packed mask bits."""
        noise = self.noise_for(seed, like)
        masks = self.masks_of(Payload({}, {MASK: packed}), like)
        return OrderedDict((k, noise[k] * masks[k]) for k in noise)

    def decode(self, payload: Payload, like: Mapping[str, np.ndarray]) -> OrderedDict[str, np.ndarray]:
        masked = self.masked_delta(parse_seed(payload.meta.get("seed"), "fedmrn payload"), payload.tensors[MASK], like)
        return OrderedDict((k, masked[k] if k in masked else payload.tensors[k]) for k in like)

    def data_bytes(self, like: Mapping[str, np.ndarray]) -> int:
        masked = sum(like[k].size for k in self.masked_names(like))
        return math.ceil(masked / 8) + 4 * sum(like[k].size for k in self.extra_names(like))

    def layout(self, like: Mapping[str, np.ndarray]) -> list[tuple[str, int]]:
        return [(MASK, 1), *((k, like[k].ndim) for k in self.extra_names(like))]

    def masked_count(self, like: Mapping[str, np.ndarray]) -> int:
        return int(sum(like[k].size for k in self.masked_names(like)))
