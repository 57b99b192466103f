"""What the long-lived cloud last published, retained, on each topic it owns (the federation's roster, the job list,
the job in progress), and the one rule that keeps the broker holding that: whatever else the broker hands back on such
a topic (a genuine but older record, from a broker restored from an older database; a record not this cloud's; junk;
the record cleared) is replaced by this cloud's last one. Without it a restored broker held a stale signed job list
(or job in progress) until the next job ended: the cloud published its records again only when its reconnect found no
session at the broker."""

from __future__ import annotations

import logging

from protocols.transport.base import Transport

log = logging.getLogger("fedtier.cloud.service")


class KeptRecords:
    """The bytes this cloud last published retained on each of its topics (empty: the record cleared)."""

    def __init__(self) -> None:
        self.last: dict[str, bytes] = {}

    def publish(self, transport: Transport, topic: str, data: bytes) -> None:
        """Publish ``data`` retained on ``topic``, and keep it as what the broker must hold there."""
        self.last[topic] = data
        transport.publish(topic, data, retain=True)

    def on_record(self, transport: Transport | None, topic: str, data: bytes) -> None:
        """What the broker handed on ``topic`` (the retained record as this cloud subscribes, or a live one): if it is
        not byte-equal to this cloud's last there, publish that again. Its own records come back equal;
        one of its own overtaken in flight by a newer one costs one publish more."""
        last = self.last.get(topic)
        if last is None or data == last or transport is None:
            return
        log.info(
            "%s: the broker held another record than this cloud's last (%d bytes): published it again", topic, len(data)
        )
        transport.publish(topic, last, retain=True)
