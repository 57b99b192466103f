"""DeComFL's messages (``protocols.algorithms.decomfl``): the history a downlink carries, and the checks of what
arrives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..rejections import Rejected, RejectKind
from ..wire.payload import Payload


def expect_shape(arr: Any, shape: tuple[int, ...], dtype: str, what: str) -> np.ndarray:
    """``arr``, if it is a ``dtype`` array of ``shape`` (finite, if floating); else :class:`Rejected`."""
    if not isinstance(arr, np.ndarray) or arr.shape != shape or arr.dtype != np.dtype(dtype):
        got = (getattr(arr, "shape", None), getattr(arr, "dtype", None))
        raise Rejected(RejectKind.SHAPE, f"{what}: expected {dtype} {shape}, got {got}")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise Rejected(RejectKind.NON_FINITE, f"{what}: non-finite values")
    return arr


def meta_int(meta: Mapping[str, Any], key: str, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``meta[key]``, if it is an integer in ``[lo, hi]``; else :class:`Rejected`."""
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        raise Rejected(RejectKind.BOUND, f"{what}: {key} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def history_payload(meta: dict[str, Any], seeds: Sequence[int] | np.ndarray, g: np.ndarray) -> Payload:
    """A downlink: ``seeds`` (history rounds then the current round) as uint64, history scalars float32."""
    return Payload(meta, {"s": np.asarray(seeds, dtype=np.uint64), "g": np.asarray(g, dtype=np.float32)})


def read_history(task: Payload, round: int, K: int, Pn: int, what: str) -> tuple[int, np.ndarray, np.ndarray]:
    """(from, seeds [h+1], scalars [h, K, P]) of a downlink for ``round``; Rejected if inconsistent."""
    start = meta_int(task.meta, "from", what, 0, round)
    h = round - start
    seeds = expect_shape(task.tensors.get("s"), (h + 1,), "uint64", f"{what} seeds")
    g = expect_shape(task.tensors.get("g"), (h, K, Pn), "float32", f"{what} scalars")
    return start, seeds, g


def stack_rounds(g: list[np.ndarray], K: int, Pn: int) -> np.ndarray:
    """Rounds' ``(K, P)`` scalars as one ``(rounds, K, P)`` array (a copy)."""
    return np.stack(g) if g else np.zeros((0, K, Pn), np.float32)
