"""Click parameter types of fedtier's flags (no import of the command line, so any module may use them)."""

from __future__ import annotations

import math
from typing import Any

import click

from protocols.limits import MAX_PROCESSES, MAX_SECONDS


class Finite(click.FloatRange):
    """A :class:`click.FloatRange` that refuses NaN and infinity too (a range lets NaN through: no comparison
    with it holds), with ``max`` :data:`~protocols.limits.MAX_SECONDS` unless given: every float flag is a
    number of seconds, samples or a fraction, and a wait past that overflows the platform's timers."""

    name = "finite number"

    def __init__(self, min: float | None = None, max: float | None = MAX_SECONDS, **kwargs: bool) -> None:
        super().__init__(min, max, **kwargs)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return float(number)


SECONDS = Finite(min=0)
"""A flag's seconds: finite, 0 to :data:`~protocols.limits.MAX_SECONDS`."""
PROCESSES = click.IntRange(1, MAX_PROCESSES)
"""A flag's count of processes: 1 to :data:`~protocols.limits.MAX_PROCESSES`."""
