"""A device whose training diverged (a loss or parameters that overflowed to inf, or NaN) sends a
small "diverged" result instead of numbers nobody can use: the cell records it (``diverged`` in its
aggregation record), counts the device as answered and keeps it out of the aggregate, and its report tells
the cloud how many; a job in which every answering device diverges for ``STALLED_ROUNDS`` rounds in a
row is failed by the cloud.

The result is a payload with only ``meta = {"diverged": reason}`` (no tensors), so it encodes whatever
the role produced, and a receiver tells it from a real result by that key alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .wire.payload import Payload, all_finite

KEY = "diverged"
MAX_REASON = 200  # characters of a reason a cell keeps
# cloud rounds in a row in which devices answered and every one of them diverged (nothing aggregated
# anywhere: the global model cannot move) after which the cloud fails the job
# (the default of runtime.max_stalled_rounds, protocols.failures.StallWatch)
STALLED_ROUNDS = 3


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
