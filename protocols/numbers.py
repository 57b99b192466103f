"""Numbers a peer sent: JSON bounds no integer (``10**400`` is valid), and ``float()`` or ``math.isfinite`` of one
beyond the float range raises ``OverflowError`` (numpy's ``isfinite`` of one beyond int64 a ``TypeError``): a check
that calls them on a peer's number fails the handler, and so the job, instead of refusing the message. Checks of
a peer's numbers go through :func:`finite_number`."""

from __future__ import annotations

import math


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
