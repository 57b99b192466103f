"""Where a cell's aggregation records go: kept in memory, appended to its JSONL log, handed to its
observers (``monitor.exporter``) and published (signed, QoS 1: a deployed cloud keeps every record);
and the rejections the next record lists."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protocols.failures import count_reasons
from protocols.jsonl import JsonlWriter
from protocols.records import MAX_LISTED_REJECTIONS, CellRecord
from protocols.rejections import RejectKind
from protocols.wire import topics
from protocols.wire.signed import seal_record

from .parts import EdgeRound

if TYPE_CHECKING:
    from protocols.algorithms.outcome import Outcome
    from protocols.transport.base import Transport
    from protocols.wire.keys import Trust


def absence(absent: dict[str, str], limit: int, not_participating: int = 0) -> dict[str, Any]:
    """The record's ``absent`` (device -> reason, for reasons with at most ``limit`` devices) and
    ``absent_counts`` (reason -> devices), the latter only when some were left out; ``not_participating``
    devices were counted and never named."""
    counts: dict[str, int] = {"not participating": not_participating} if not_participating else {}
    for why in absent.values():
        counts[why] = counts.get(why, 0) + 1
    listed = {d: why for d, why in sorted(absent.items()) if counts[why] <= limit}
    left_out = not_participating or len(listed) < len(absent)
    return {"absent": listed, "absent_counts": dict(sorted(counts.items())) if left_out else None}


def edge_record(edge: EdgeRound, outcome: Outcome, now: float, absent_ids: int, **fields: Any) -> dict[str, Any]:
    """The aggregation record of the closed edge round ``edge`` (``outcome``: the role's; ``now``: the loop
    time); ``fields`` are the record's other fields (which round of which cell, who answered, why it closed)."""
    mean, spread = edge.loss_stats()
    return CellRecord(
        **fields,
        planned=edge.planned,
        **absence(edge.absent, absent_ids, edge.not_participating),
        bytes_in=edge.bytes_in,
        bytes_out=edge.bytes_out,
        bytes_resent=edge.bytes_resent or None,
        loss_mean=mean,
        loss_std=spread,
        duration_s=round(time.perf_counter() - edge.wall0, 6),
        clock_s=round(now - edge.t0, 6),
        clock_end_s=round(now, 6),
        time=round(time.time(), 3),
        metrics=dict(outcome.metrics),
        excluded=outcome.excluded or None,  # robust aggregation: who was left out, why
        diverged=edge.diverged or None,
        failed=dict(sorted(edge.failed.items())[:MAX_LISTED_REJECTIONS]) or None,
        failed_counts=count_reasons(edge.failed) or None,
    ).to_dict()


class CellTelemetry:
    """A cell's records and the rejections since the last one (``log_path``: the JSONL log, rotated past
    ``max_record_bytes``, for long-lived nodes)."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        cell: str,
        trust: Trust | None,
        log_path: str | None = None,
        max_record_bytes: int | None = None,
    ) -> None:
        self.transport, self.run, self.cell, self.trust = transport, run, cell, trust
        self.log = JsonlWriter(log_path, max_record_bytes)
        self.records: list[dict[str, Any]] = []
        self.observers: list[Callable[[dict[str, Any]], None]] = []  # get each record (monitor.exporter)
        self.rejected: list[dict[str, str]] = []  # refused since the last record (even between rounds)
        self.rejected_more = 0  # refused beyond the listed ones

    def on_reject(self, topic: str, kind: RejectKind, reason: str, sender: str | None) -> None:
        """A message refused (the messenger's hook): listed in the next record, counted beyond the bound."""
        parts = topic.split("/")
        who = sender or (parts[-2] if len(parts) >= 2 and parts[-1] == "result" else topic)
        if len(self.rejected) < MAX_LISTED_REJECTIONS:
            self.rejected.append({"device": who, "kind": kind.value, "reason": reason})
        else:
            self.rejected_more += 1

    def emit(self, record: dict[str, Any]) -> None:
        """Keep, log and publish an aggregation record; the rejections it lists are reset."""
        if self.rejected_more:
            record["rejected_more"] = self.rejected_more
        self.rejected, self.rejected_more = [], 0
        self.records.append(record)
        self.log.write(record)
        for observe in self.observers:
            observe(record)
        topic = topics.telemetry_cell(self.run, self.cell)
        self.transport.publish(topic, seal_record(record, topic, self.trust.sign if self.trust else None), qos=1)

    def close(self) -> None:
        self.log.close()
