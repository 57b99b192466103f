"""A device whose training diverged (a loss or parameters that overflowed to inf, or NaN) sends a
small "diverged" result instead of numbers nobody can use: the cell records it (``diverged`` in its
aggregation record), counts the device as answered and keeps it out of the aggregate, and its report tells
the cloud how many; a job in which every answering device diverges for ``STALLED_ROUNDS`` rounds in a
row is failed by the cloud.

The result is a payload with only ``meta = {"diverged": reason}`` (no tensors), so it encodes whatever
the role produced, and a receiver tells it from a real result by that key alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np

from .wire.payload import Payload, all_finite, known_squares
from .wire.topics import check_name

_N = TypeVar("_N", int, float)

KEY = "diverged"
MAX_REASON = 200  # characters of a reason a cell keeps
# cloud rounds in a row in which devices answered and every one of them diverged (nothing aggregated
# anywhere: the global model cannot move) after which the cloud fails the job
# (the default of runtime.max_stalled_rounds, protocols.failures.StallWatch)
STALLED_ROUNDS = 3
MAX_BLAMED = 3
"""A diverged global model's failure names at most this many contributors of its aggregate, the largest updates;
a cell's report names at most this many of its devices so (``largest_updates``)."""


def nonfinite(result: Payload) -> str | None:
    """Where ``result`` holds a non-finite number (metadata value or float tensor), else ``None``."""
    where = _nonfinite_meta(result.meta, "")
    if where is not None:
        return f"{where} is not finite"
    for name, arr in result.tensors.items():
        a = np.asarray(arr)
        if a.dtype.kind in "fc" and not (all_finite(a) if a.dtype.kind == "f" else np.isfinite(a).all()):
            bad = int(a.size - np.count_nonzero(np.isfinite(a)))
            return f"tensor {name!r} has {bad} non-finite values"
    return None


def _nonfinite_meta(value: Any, path: str) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"meta {path or 'value'} ({value})"
    if isinstance(value, dict):
        for k, v in value.items():
            if (where := _nonfinite_meta(v, f"{path}.{k}" if path else str(k))) is not None:
                return where
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if (where := _nonfinite_meta(v, f"{path}[{i}]")) is not None:
                return where
    return None


def diverged_result(reason: str) -> Payload:
    """The result a device sends when its training diverged."""
    return Payload(meta={KEY: reason[:MAX_REASON]})


def diverged_reason(result: Payload) -> str | None:
    """The reason of a "diverged" result (``None`` for any other payload)."""
    reason = result.meta.get(KEY)
    if isinstance(reason, str) and not result.tensors:
        return reason[:MAX_REASON] or "diverged"
    return None


def update_norm(tensors: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of an update's floating-point tensors: one BLAS pass a tensor (``np.vdot``, ~25 us a 800 KB
    float32 tensor; none for a received result's tensor whose sum of squares the wire's finiteness check took,
    :func:`~protocols.wire.payload.known_squares`), summed in float64 again for a tensor whose float32 sum of squares
    overflowed (values near the float32 maximum); ``inf`` for one that is not finite. A ranking of updates, not a
    figure to 7 digits."""
    total = 0.0
    for t in tensors.values():
        if t.dtype.kind != "f":
            continue
        if t.dtype.char in "fd" and t.dtype.isnative and t.flags.c_contiguous:
            squares = known_squares(t)  # the wire's finiteness check of a received result took it
            if squares is None:
                squares = float(np.vdot(t, t))
            if math.isfinite(squares) or t.dtype.char == "d":
                total += squares
                continue
        flat = np.asarray(t, dtype=np.float64).ravel()
        total += float(np.dot(flat, flat))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def largest(norms: Mapping[str, _N]) -> list[tuple[str, _N]]:
    """The :data:`MAX_BLAMED` largest of ``norms`` (name -> update norm, or its exponent), largest first (then by
    name)."""
    return sorted(norms.items(), key=lambda kv: (-kv[1], kv[0]))[:MAX_BLAMED]


def declared_norms(value: object) -> dict[str, int]:
    """The ``largest_updates`` a cell's report declares (device -> the decimal exponent of its update norm, its
    word): at most :data:`MAX_BLAMED` entries whose device is a valid id and whose exponent an int of a float's
    range; others are left out."""
    if not isinstance(value, dict):
        return {}
    return {
        d: e
        for d, e in itertools.islice(value.items(), MAX_BLAMED)
        if _is_id(d) and isinstance(e, int) and not isinstance(e, bool) and -400 < e < 400
    }


def _is_id(name: object) -> bool:
    try:
        check_name("device", name)  # type: ignore[arg-type]  # (it refuses a non-string)
    except ValueError:
        return False
    return True
