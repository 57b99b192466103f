"""Rounds as people read them: counted from 1 ("round 3/10", "edge round 3.1") in every text a human reads (logs,
failure reasons, rejections, the CLI, the monitor, the report). Records on disk, states, metric labels and wire
headers count from 0 and stay so: they are formats tools parse. Text that shows a round goes through these."""

from __future__ import annotations

from collections.abc import Sequence


def nth(index: object) -> str:
    """Round (or edge round) ``index``, counted from 0 as records hold it, as people read it: from 1 (the cloud's
    "round 20/20" and its cells' last record "20.1" are the same round); "?" for a value that is no count."""
    return str(index + 1) if isinstance(index, int) and not isinstance(index, bool) else "?"


def nth_edge(index: object, edge: object) -> str:
    """Edge round ``edge`` of round ``index`` (both from 0) as people read it: ``"3.1"`` for (2, 0)."""
    return round_key_text((index, edge))


def round_key_text(key: Sequence[object]) -> str:
    """A round key, (round,) or (round, edge round), counted from 0, as people read it: ``"3.1"`` for (2, 0)."""
    return ".".join(nth(part) for part in key)


def rounds_span(first: int, last: int) -> str:
    """``"round 3"`` or ``"rounds 3-5"`` for rounds ``first`` to ``last`` (from 0, both included)."""
    return f"round {nth(first)}" if first == last else f"rounds {nth(first)}-{nth(last)}"
