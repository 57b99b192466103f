"""How secure aggregation encodes updates and reads its messages: fixed-point quantisation into Z_2^32, the flat
vector and its layout, and the checked reading of device lists and byte fields (a bad one is :class:`Rejected`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...rejections import Rejected, RejectKind
from ...wire.payload import Payload
from .settings import SecAggSettings

QUANT_MAX = 2**31 - 1  # |sum of quantised values| stays below this: no wrap-around in Z_2^32


def scale_for(settings: SecAggSettings, total_weight: float) -> float:
    """Fixed-point scale: the weighted sum of ``total_weight`` samples' clipped values fits in ±QUANT_MAX."""
    return QUANT_MAX / (settings.bound * total_weight)


def quantize(values: np.ndarray, weight: float, settings: SecAggSettings, total_weight: float) -> np.ndarray:
    """``round(weight * clip(values) * scale) mod 2^32`` as uint32."""
    v = np.clip(values.astype(np.float64), -settings.bound, settings.bound) * (
        weight * scale_for(settings, total_weight)
    )
    return (np.rint(v).astype(np.int64) & 0xFFFFFFFF).astype(np.uint32)


def dequantize(total: np.ndarray, settings: SecAggSettings, total_weight: float) -> np.ndarray:
    """The weighted sum (float64) from a sum of :func:`quantize` outputs mod 2^32."""
    return total.astype(np.uint32).view(np.int32).astype(np.float64) / scale_for(settings, total_weight)


Layout = list[tuple[str, tuple[int, ...]]]


def flatten(tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, Layout]:
    """One float64 vector of the tensors, in their order, and the layout that undoes it."""
    names = list(tensors)
    layout = [(n, tuple(int(s) for s in np.shape(tensors[n]))) for n in names]
    flat = np.concatenate([np.ravel(tensors[n]).astype(np.float64) for n in names]) if names else np.zeros(0)
    return flat, layout


def unflatten(flat: np.ndarray, layout: Layout, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """The tensors of :func:`flatten`'s vector, by ``layout``, as ``dtype``."""
    out, at = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = flat[at : at + size].reshape(shape).astype(dtype)
        at += size
    return out


def layout_of(meta: Any) -> Layout:
    """A layout from JSON (``[[name, [dims]], ...]``), validated."""
    if not isinstance(meta, list) or not meta or len(meta) > 4096:
        raise Rejected(RejectKind.MALFORMED, "secure aggregation: missing or bad layout")
    out = []
    for item in meta:
        if (
            not isinstance(item, list)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], list)
            or len(item[1]) > 8
            or not all(isinstance(s, int) and 0 <= s < 2**31 for s in item[1])
        ):
            raise Rejected(RejectKind.MALFORMED, "secure aggregation: bad layout entry")
        out.append((item[0], tuple(item[1])))
    return out


def device_list(value: Any, what: str) -> list[str]:
    """``value`` as a sorted list of distinct device ids; :class:`Rejected` otherwise (``what`` names it)."""
    if not isinstance(value, list) or not all(isinstance(d, str) for d in value) or len(set(value)) != len(value):
        raise Rejected(RejectKind.MALFORMED, f"secure aggregation: {what} is not a list of distinct device ids")
    return sorted(value)


def fixed_bytes(payload: Payload, name: str, size: int, what: str) -> bytes:
    """Tensor ``name`` of ``payload`` as exactly ``size`` bytes; :class:`Rejected` otherwise."""
    arr = payload.tensors.get(name)
    if arr is None or arr.dtype != np.uint8 or arr.shape != (size,):
        raise Rejected(RejectKind.MALFORMED, f"secure aggregation: {what} needs {name!r} as {size} bytes")
    return arr.tobytes()


def as_u8(data: bytes) -> np.ndarray:
    """``data`` as a uint8 array (a payload tensor)."""
    return np.frombuffer(data, dtype=np.uint8).copy()
