"""What an aggregation returns: the algorithm's own numbers and the few facts the runtimes record.

A cell role's ``aggregate`` (one edge round), a cloud role's ``aggregate`` (one cloud round) and an
asynchronous buffer's flush return an :class:`Outcome`. The runtimes read its typed fields (who the robust
aggregator left out, the privacy spent, whose updates an asynchronous flush used) into the records' own
fields, and put ``metrics`` under the records' free-form ``metrics``: no key of the metrics has a meaning
to a runtime. Whether the run may go on is asked separately, before each round
(``CloudRole.stop_reason``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Outcome(Mapping[str, Any]):
    """The outcome of one aggregation.

    Read as a mapping it is ``metrics`` plus ``excluded`` / ``epsilon`` / ``senders`` when set (for callers
    that only look at numbers, e.g. tests and benchmarks); the runtimes read the fields.
    """

    metrics: dict[str, Any] = field(default_factory=dict)
    """the algorithm's own numbers (recorded under the record's ``metrics``)"""
    excluded: dict[str, str] = field(default_factory=dict)
    """parties (devices of a cell, cells of the cloud) the robust aggregator left out, with why"""
    epsilon: float | None = None
    """differential privacy: the epsilon spent after this round (cloud outcomes of DP runs), against the cloud"""
    epsilon_by_party: dict[str, float | None] | None = None
    """differential privacy: epsilon against the cloud, a device's cell, the other devices (None: no guarantee)"""
    epsilon_basis: str | None = None
    """differential privacy: what the epsilon assumes (sampling rate, neighbouring relation, noise)"""
    senders: tuple[str, ...] = ()
    """asynchronous flushes: whose buffered updates went into the new version"""

    def with_metrics(self, **more: Any) -> Outcome:
        """This outcome with ``more`` numbers added to its metrics."""
        return replace(self, metrics={**self.metrics, **more})

    def _view(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.excluded:
            extra["excluded"] = self.excluded
        if self.epsilon is not None:
            extra["epsilon"] = self.epsilon
        if self.senders:
            extra["senders"] = list(self.senders)
        return {**self.metrics, **extra}

    def __getitem__(self, key: str) -> Any:
        return self._view()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._view())

    def __len__(self) -> int:
        return len(self._view())


def aggregated(role: Any, *args: Any) -> Outcome:
    """``role.aggregate(*args)``, the :class:`Outcome` a role's ``aggregate`` returns; a ``TypeError`` naming the role
    and what it returned otherwise (a plugin's role returning its metrics as a dict failed the job with "'dict' object
    has no attribute 'epsilon'", naming neither)."""
    out = role.aggregate(*args)
    if not isinstance(out, Outcome):
        raise TypeError(
            f"{type(role).__qualname__}.aggregate returned {type(out).__name__}, not an Outcome (return "
            "protocols.algorithms.outcome.Outcome(metrics))"
        )
    return out
