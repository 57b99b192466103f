"""Where the cloud's round records go: kept (``history``), appended to ``metrics.jsonl``, handed to its
observers (``monitor.exporter``) and published on the cloud's telemetry topic (signed in signed runs: a
reader with the keys checks it); the rejections the next record lists; and the job's retained ``finished`` record
(:func:`send_finished`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols.jsonl import JsonlWriter
from protocols.records import MAX_LISTED_REJECTIONS
from protocols.rejections import RejectKind
from protocols.round_text import nth
from protocols.wire import topics
from protocols.wire.payload import Payload
from protocols.wire.signed import seal_record

if TYPE_CHECKING:
    from protocols.transport.base import Transport
    from protocols.wire.keys import Trust
    from protocols.wire.messenger import Messenger

log = logging.getLogger("fedtier.cloud")


def send_finished(
    messenger: Messenger, run: str, rnd: int, session: str, stopped: str | None = None, failed: str | None = None
) -> None:
    """Publish the job's retained ``finished`` control record: its round, session, and why it stopped or failed if
    it did; nodes that come late, and job watchers, read it."""
    why = {k: v for k, v in (("stopped", stopped), ("failed", failed)) if v}
    meta = {"event": "finished", "round": rnd, "session": session, **why}
    messenger.send(topics.control(run), "control", Payload(meta), round=rnd, retain=True)


class CloudTelemetry:
    """The cloud's round records (``metrics_path``: its JSONL file, rotated past ``max_record_bytes``)."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        trust: Trust | None,
        metrics_path: str | Path | None = None,
        max_record_bytes: int | None = None,
    ) -> None:
        self.transport, self.run, self.trust = transport, run, trust
        self.metrics = JsonlWriter(metrics_path, max_record_bytes)
        self.history: list[dict[str, Any]] = []
        self.observers: list[Callable[[dict[str, Any]], None]] = []  # get each round record (monitor.exporter)
        self.rejected: list[dict[str, str]] = []  # refused since the last record
        self.rejected_more = 0  # refused beyond the listed ones

    def on_reject(self, topic: str, kind: RejectKind, reason: str, sender: str | None) -> None:
        """A message refused (the messenger's hook): listed in the next record, counted beyond the bound."""
        if len(self.rejected) < MAX_LISTED_REJECTIONS:
            self.rejected.append({"from": sender or topic, "kind": kind.value, "reason": reason})
        else:
            self.rejected_more += 1

    def take_rejections(self) -> tuple[list[dict[str, str]], int | None]:
        """The rejections the next record lists (and how many more), counted afresh from now on."""
        taken = self.rejected, self.rejected_more or None
        self.rejected, self.rejected_more = [], 0
        return taken

    def emit(self, record: dict[str, Any]) -> None:
        """Keep, write, observe and publish a round record."""
        self.history.append(record)
        self.metrics.write(record)
        for observe in self.observers:
            observe(record)
        topic = topics.telemetry_cloud(self.run)
        self.transport.publish(topic, seal_record(record, topic, self.trust.sign if self.trust else None), qos=0)

    @staticmethod
    def log_round(record: dict[str, Any], rounds: int) -> None:
        """One info line per round (of ``rounds``): what an operator watching the cloud's log needs."""
        accuracy = record.get("accuracy")
        log.info(
            "cloud: round %s/%d closed (%s): cells %d/%d answered, devices %d%s, accuracy %s, %s bytes, %.2f s",
            nth(record["round"]),
            rounds,
            record["closed_by"],
            len(record["cells_reported"]),
            len(record["cells_planned"]),
            sum(record["devices"].values()),
            f" (failed {sum(record['devices_failed'].values())})" if record.get("devices_failed") else "",
            f"{accuracy:.4f}" if isinstance(accuracy, float) else "-",
            f"{sum(record['bytes'].values()):,}",
            record["duration_s"],
        )

    def close(self) -> None:
        self.metrics.close()
