"""The pub/sub contract every runtime uses, whatever carries the bytes.

A node (device agent, cell server, cloud) owns one :class:`Transport`. Handlers run on the node's
:class:`EventLoop`, one at a time, so a runtime never needs locks. Two implementations fit this
contract: the deterministic in-memory hub (``memory.py``) and MQTT (``mqtt.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..wire.envelope import Segments

Handler = Callable[[str, bytes], None]
"""Called with (topic, payload) on the node's event loop."""


class TimerHandle:
    """Opaque handle of a scheduled callback; pass it to :meth:`EventLoop.cancel`."""

    __slots__ = ("when", "seq", "fn", "cancelled")

    def __init__(self, when: float, seq: int, fn: Callable[[], None]) -> None:
        self.when, self.seq, self.fn, self.cancelled = when, seq, fn, False

    def cancel(self) -> None:
        """Never run; the callback is dropped now, so what it holds (on a long-lived node, an ended job's server,
        model and connection) is freed at once, not when the timer would have come due (a startup wait, a deadline:
        minutes), while the cancelled handle waits in its loop's queue."""
        self.cancelled = True
        self.fn = _nothing

    def __lt__(self, other: TimerHandle) -> bool:
        return (self.when, self.seq) < (other.when, other.seq)


def _nothing() -> None:
    """A cancelled timer's callback."""


class EventLoop(ABC):
    """Serialises a node's work: message handlers, timers and posted calls run one at a time."""

    @abstractmethod
    def now(self) -> float:
        """Seconds on this loop's clock (virtual in simulation, monotonic wall time otherwise)."""

    @abstractmethod
    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop as soon as possible, after what is already queued."""

    @abstractmethod
    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        """Run ``fn`` on the loop after ``delay`` seconds of this loop's clock."""

    def cancel(self, handle: TimerHandle | None) -> None:
        """Cancel a timer; cancelling twice or cancelling ``None`` is harmless."""
        if handle is not None:
            handle.cancel()


@dataclass(frozen=True)
class Will:
    """Last will: published by the broker (or hub) when the node vanishes without closing."""

    topic: str
    payload: bytes
    retain: bool = True


class Transport(ABC):
    """Publish/subscribe for one node. Topics use MQTT syntax; patterns may use ``+`` and ``#``.

    Delivery is at-least-once (QoS 1): a handler may see the same message twice, so receivers
    de-duplicate by the envelope's message id (see ``protocols.wire.dedup``).
    """

    client_id: str
    loop: EventLoop
    takes_segments: bool = False
    """Whether :meth:`publish` carries a message as :class:`~protocols.wire.envelope.Segments` to the handlers that
    take them, unjoined (the in-memory transport); every transport accepts them (one that needs one buffer joins)."""

    @abstractmethod
    def publish(
        self, topic: str, payload: bytes | memoryview | Segments, *, qos: int = 1, retain: bool = False
    ) -> None:
        """Queue ``payload`` for everyone subscribed to ``topic``. Never blocks on the network. ``payload``: a
        message's bytes, a read-only view of lent bytes (a message framed in place,
        ``protocols.wire.payload.Headroom``), or its segments (``protocols.wire.envelope.Segments``)."""

    @abstractmethod
    def subscribe(self, pattern: str, handler: Handler, *, qos: int = 1, segments: bool = False) -> None:
        """Deliver messages matching ``pattern`` to ``handler`` on this node's loop. ``segments``: the handler takes a
        message as :class:`~protocols.wire.envelope.Segments` (it reads it with ``Messenger.receive``), which a
        transport that carries them (``takes_segments``) then hands it unjoined; otherwise it always gets bytes."""

    @abstractmethod
    def unsubscribe(self, pattern: str) -> None:
        """Stop delivering ``pattern``."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect cleanly: the will is *not* published."""

    @property
    def connected(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        """True once the node closed (or crashed) this transport; a connection that is being
        re-established is not closed (what is published meanwhile is sent after the reconnect)."""
        return not self.connected

    def keep_ack(self) -> Callable[[], None] | None:
        """Called by a handler: the acknowledgement of the message it handles, which then no longer goes when the
        handler returns; the caller calls it once the message is taken (a node killed before, or a client closed,
        gets the message again in its next session: a call after that is void). ``None`` where nothing is
        acknowledged by hand (in memory, a clean session, QoS 0, or outside a handler)."""
        return None

    def configure_wire(self, *, auth: Any = None, max_message_bytes: int | None = None) -> None:  # noqa: B027 optional: only chunking transports use it
        """Chunk signing/verification (a ``protocols.wire.chunking.ChunkAuth``) and the bound on one
        incoming message, for transports that chunk (MQTT). The node's messenger calls this; a
        transport without chunking ignores it (the messenger bounds whole messages itself)."""


def topic_matches(pattern: str, topic: str) -> bool:
    """MQTT topic filter matching: ``+`` matches one level, a trailing ``#`` matches the rest."""
    p_parts, t_parts = pattern.split("/"), topic.split("/")
    for i, part in enumerate(p_parts):
        if part == "#":
            return i == len(p_parts) - 1
        if i >= len(t_parts):
            return False
        if part != "+" and part != t_parts[i]:
            return False
    return len(p_parts) == len(t_parts)
