"""The cloud round records of a run as ``fedtier report`` draws them, in bounded memory: :class:`RoundSeries`.

The figures the report states are kept exact as the records are read (the count, the first and the last round, the
last evaluated and the best-accuracy round, whether epsilon or the clock moved). The per-round series it plots keep
at most :data:`MAX_POINTS` points each (:class:`Thinned`: one per bucket of rounds, the buckets doubling in width as
more come), plus the first, last and best-accuracy rounds: a RoundPoint costs ~0.5 KB, ~500 MB at 10^6 rounds.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from protocols.records import RoundRecord

MAX_POINTS = 2_000  # points a per-round series keeps (between half of it and all of it once thinned)


@dataclass(slots=True)
class RoundPoint:
    """What the report draws of one cloud round record (the record itself held ~5 KB: 0.5 GB at 10^5 rounds)."""

    run: str | None
    round: int
    accuracy: float | None
    loss: float | None
    epsilon: float | None
    clock_s: float
    clock_start_s: float | None
    bytes: dict[str, int]
    cumulative_bytes: dict[str, int]

    @classmethod
    def of(cls, r: RoundRecord) -> RoundPoint:
        tiers = (r.bytes, r.cumulative_bytes)
        b, cum = ({sys.intern(k): v for k, v in t.items()} for t in tiers)
        return cls(r.run, r.round, r.accuracy, r.loss, r.epsilon, r.clock_s, r.clock_start_s, b, cum)


class Thinned:
    """At most ``cap`` points of a series, in any order of arrival: every point while there are at most ``cap``,
    else the lowest round of each bucket of ``width`` rounds; past ``cap`` buckets the width doubles (pairs of
    buckets merged), so it is a stride over the rounds."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap, self.width, self.count = cap or MAX_POINTS, 1, 0
        self._every: list[RoundPoint] | None = []  # all of them, until there are more than cap
        self._by_bucket: dict[int, RoundPoint] = {}

    def add(self, p: RoundPoint) -> None:
        self.count += 1
        if self._every is not None:
            self._every.append(p)
            if self.count > self.cap:
                self._every = None
        b = p.round // self.width
        kept = self._by_bucket.get(b)
        if kept is None or p.round < kept.round:
            self._by_bucket[b] = p
        while len(self._by_bucket) > self.cap:
            self.width *= 2
            merged: dict[int, RoundPoint] = {}
            for bucket, point in sorted(self._by_bucket.items()):  # bucket 2b's round is below 2b+1's: it stays
                merged.setdefault(bucket // 2, point)
            self._by_bucket = merged

    def points(self) -> list[RoundPoint]:
        return list(self._every if self._every is not None else self._by_bucket.values())


def _later(p: RoundPoint | None, q: RoundPoint) -> bool:
    return p is None or q.round >= p.round  # equal rounds: the one read last (as a stable sort leaves it)


@dataclass
class Rounds:
    """A run's rounds as read: exact figures and the bounded series (``points``, ``evaluated``) sorted by round."""

    points: list[RoundPoint]
    """Every round, or where there were more than :data:`MAX_POINTS` a stride over them (one per ``width`` rounds)
    with the first, the last and the best-accuracy round."""
    evaluated: list[RoundPoint]
    """The rounds with an accuracy, likewise (one per ``evaluated_width`` rounds), with the last and the best."""
    count: int
    evaluated_count: int
    width: int
    evaluated_width: int
    first: RoundPoint
    last: RoundPoint
    last_evaluated: RoundPoint | None
    best: RoundPoint | None
    has_epsilon: bool
    max_clock_s: float


class RoundSeries:
    """The rounds, added one at a time (:meth:`add`), in bounded memory; :meth:`finish` gives the :class:`Rounds`."""

    def __init__(self, cap: int | None = None) -> None:
        self.all, self.evaluated = Thinned(cap), Thinned(cap)
        self.first: RoundPoint | None = None
        self.last: RoundPoint | None = None
        self.last_evaluated: RoundPoint | None = None
        self.best: RoundPoint | None = None
        self.has_epsilon, self.max_clock_s = False, float("-inf")

    def add(self, p: RoundPoint) -> None:
        self.all.add(p)
        if self.first is None or p.round < self.first.round:
            self.first = p
        if _later(self.last, p):
            self.last = p
        self.has_epsilon = self.has_epsilon or p.epsilon is not None
        self.max_clock_s = max(self.max_clock_s, p.clock_s)
        if p.accuracy is None:
            return
        self.evaluated.add(p)
        if _later(self.last_evaluated, p):
            self.last_evaluated = p
        best = self.best
        if best is None or best.accuracy is None or (p.accuracy, -p.round) > (best.accuracy, -best.round):
            self.best = p

    def finish(self) -> Rounds:
        """The rounds read (``ValueError`` where there was none)."""
        if self.first is None or self.last is None:
            raise ValueError("no cloud round record")
        extra = [self.first, self.last, self.best]
        evaluated = _merged(self.evaluated.points(), [self.last_evaluated, self.best])
        points = _merged(self.all.points(), extra)
        return Rounds(
            points,
            evaluated,
            self.all.count,
            self.evaluated.count,
            self.all.width,
            self.evaluated.width,
            self.first,
            self.last,
            self.last_evaluated,
            self.best,
            self.has_epsilon,
            self.max_clock_s,
        )


def _merged(points: list[RoundPoint], extra: list[RoundPoint | None]) -> list[RoundPoint]:
    """``points`` and the ``extra`` not among them, sorted by round (stable: equal rounds in the order read)."""
    ids = {id(p) for p in points}
    for p in extra:
        if p is not None and id(p) not in ids:
            points.append(p)
            ids.add(id(p))
    return sorted(points, key=lambda p: p.round)
