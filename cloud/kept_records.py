"""What the long-lived cloud last published, retained, on each topic it owns (the federation's roster, the job list,
the job in progress), and the one rule that keeps the broker holding that: whatever else the broker hands back on such
a topic (a genuine but older record, from a broker restored from an older database; a record not this cloud's; junk;
the record cleared) is replaced by this cloud's last one. Without it a restored broker held a stale signed job list
(or job in progress) until the next job ended: the cloud published its records again only when its reconnect found no
session at the broker.

The cloud reads its own records back (it subscribes to these topics): a record of its own coming back, or anything the
broker hands it before a record of its own still on its way (the retained record as it subscribes again, just before
it publishes its newer one), is no stale record: the broker holds, or is about to hold, this cloud's. Before, each
such echo overtaken by a newer publish was published again and logged, 2-4 times a job (`fedtier cloud -v`)."""

from __future__ import annotations

import logging
from collections import deque

from protocols.transport.base import Transport

log = logging.getLogger("fedtier.cloud.service")
MAX_COMING = 16
"""Publishes per topic this cloud awaits back at most (the oldest forgotten past it: one lost costs a publish more)."""


class KeptRecords:
    """The bytes this cloud last published retained on each of its topics (empty: the record cleared), and those it
    published there that have not come back to it yet, oldest first."""

    def __init__(self) -> None:
        self.last: dict[str, bytes] = {}
        self.coming: dict[str, deque[bytes]] = {}

    def publish(self, transport: Transport, topic: str, data: bytes) -> None:
        """Publish ``data`` retained on ``topic``, and keep it as what the broker must hold there."""
        self.last[topic] = data
        self.coming.setdefault(topic, deque(maxlen=MAX_COMING)).append(data)
        transport.publish(topic, data, retain=True)

    def forget_coming(self) -> None:
        """A new connection (or a broker that lost this cloud's session): what was on its way may never come back."""
        self.coming.clear()

    def on_record(self, transport: Transport | None, topic: str, data: bytes) -> None:
        """What the broker handed on ``topic`` (the retained record as this cloud subscribes, or a live one): if it is
        not byte-equal to this cloud's last there, and no publish of its own is on its way there after it (which the
        broker delivers after it, and holds), publish its last one again. One of its own coming back is taken off what
        is on its way (with any published before it): put back only if it is older than the last and none follows it
        (the last set without a publish: a newer roster adopted, which this one overwrote at the broker)."""
        last, coming = self.last.get(topic), self.coming.get(topic)
        if coming and data in coming:  # its own, back: those published before it came back before it, or never will
            while coming.popleft() != data:
                pass
            if coming or data == last:
                return  # (else the broker holds it, older than its last: a newer roster adopted as it came back)
        elif last is None or data == last or coming:
            return
        if transport is None or last is None:
            return
        log.info(
            "%s: the broker held another record than this cloud's last (%d bytes): published it again", topic, len(data)
        )
        self.publish(transport, topic, last)
