"""Numbers a peer sent: JSON bounds no integer (``10**400`` is valid), and ``float()`` or ``math.isfinite`` of one
beyond the float range raises ``OverflowError`` (numpy's ``isfinite`` of one beyond int64 a ``TypeError``): a check
that calls them on a peer's number fails the handler, and so the job, instead of refusing the message. Checks of
a peer's numbers go through :func:`finite_number`, its counts through :func:`is_count`."""

from __future__ import annotations

import math
from typing import TypeGuard

MAX_COUNT = 2**40
"""The largest count a peer may declare in one message (bytes, devices; ~10^12): the sums a node keeps of them over
cells and rounds stay exact in a float and far inside an int64 (what a record may hold, ``protocols.records``)."""


def is_count(value: object) -> TypeGuard[int]:
    """Whether a peer's ``value`` is a count: an int (not a bool) in [0, :data:`MAX_COUNT`]."""
    return type(value) is int and 0 <= value <= MAX_COUNT


def declared_count(value: object) -> int:
    """A count a peer declared: ``value`` if it :func:`is_count`, else 0."""
    return value if is_count(value) else 0


def finite_number(value: object) -> float | None:
    """``value`` as a finite float; ``None`` if it is no number (a bool is none), beyond the float range,
    infinite or NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None
