"""Messages that arrive before any handler wants them: a bounded hold for a resumed MQTT session.

A node restarted under its client id with a persistent session gets, right after the broker's
CONNACK, the QoS-1 messages the broker queued for it while it was down (e.g. a cell's device results),
before the node has subscribed its handlers again. Dropping them would lose exactly what the
persistent session exists to keep, so the transport holds them and hands them to the first handler
subscribed to a matching pattern. Hostile or stale input must not grow memory: the hold keeps at most
``messages`` messages and ``bytes`` bytes, each for at most ``seconds``; what does not fit, or is
not claimed in time, is dropped and logged (rate-limited). Pure code: no sockets, no threads of its
own (the caller serialises access); time comes from a clock function.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..wire.ratelog import RateLimitedLog
from .base import topic_matches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HoldLimits:
    """Bounds of a :class:`Hold`: at most ``messages`` messages of ``bytes`` bytes in all, each kept at
    most ``seconds``."""

    messages: int = 4096
    bytes: int = 64 * 1024 * 1024
    seconds: float = 120.0


class Hold:
    """Whole messages (topic, payload) waiting for their first handler, oldest first."""

    def __init__(
        self, owner: str, limits: HoldLimits = HoldLimits(), clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.owner, self.limits, self.clock = owner, limits, clock
        self._items: deque[tuple[float, str, bytes]] = deque()
        self.nbytes = 0
        self.dropped = 0  # refused (hold full) or expired, over the hold's life
        self._log = RateLimitedLog(log)

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, topic: str, payload: bytes) -> bool:
        """Keep a message for a later handler; ``False`` (logged) when the hold is full."""
        self.expire()
        lim = self.limits
        if len(self._items) >= lim.messages or self.nbytes + len(payload) > lim.bytes:
            self.dropped += 1
            self._log.warning(
                "%s: a message on %s arrived before any handler of it and the hold is full "
                "(%d messages, %d bytes; at most %d, %d): dropped",
                self.owner,
                topic,
                len(self._items),
                self.nbytes,
                lim.messages,
                lim.bytes,
            )
            return False
        if not self._items:
            log.info(
                "%s: holding messages that arrived before their handler (a resumed session's queue), first on %s",
                self.owner,
                topic,
            )
        self._items.append((self.clock(), topic, payload))
        self.nbytes += len(payload)
        return True

    def take(self, pattern: str) -> list[tuple[str, bytes]]:
        """Remove and return, in arrival order, the held messages whose topic ``pattern`` matches."""
        self.expire()
        taken = [(t, p) for _, t, p in self._items if topic_matches(pattern, t)]
        if taken:
            self._items = deque(item for item in self._items if not topic_matches(pattern, item[1]))
            self.nbytes -= sum(len(p) for _, p in taken)
            log.info("%s: %d held messages go to the handler of %s", self.owner, len(taken), pattern)
        return taken

    def expire(self) -> int:
        """Drop (and log) the messages held longer than ``seconds``; returns how many."""
        cutoff = self.clock() - self.limits.seconds
        gone: list[str] = []
        while self._items and self._items[0][0] < cutoff:
            _, topic, payload = self._items.popleft()
            self.nbytes -= len(payload)
            gone.append(topic)
        if gone:
            self.dropped += len(gone)
            self._log.warning(
                "%s: %d held messages (first on %s) found no handler within %g s: dropped",
                self.owner,
                len(gone),
                gone[0],
                self.limits.seconds,
            )
        return len(gone)

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
