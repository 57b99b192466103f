"""The receiving side of :class:`~.mqtt.MqttTransport`: every PUBLISH packet counted, chunks reassembled
(signed chunks checked, incomplete sets expired on the loop), each whole message posted to the loop for
every handler subscribed to a matching pattern, or held for a handler not subscribed yet (a resumed
session's backlog, ``protocols.transport.hold``). Runs on the network thread; handlers run on the loop.

QoS-1 acknowledgements are by hand: a message is acknowledged once taken (held, refused, a chunk of a message not
whole yet), and a persistent client's message posted to handlers only once each of its handlers returned (or raised
an ``Exception``: a poison message is not handed again): what the handler made durable (the async cloud journals a
push, fsynced, before it counts) is, and a node killed in the handler (or interrupted there: Ctrl-C) gets the message
again in its next session. A chunked message too, its chunks all acknowledged together once its handlers returned,
while the chunks so held stay within a budget of the broker's in-flight window (``protocols.transport.chunk_acks``);
a larger one's chunks are acknowledged as they come, with a warning: a node killed in its handler loses it. One
that arrives or waits on the loop while the client closes is left to the broker, which hands it to the client's
next session (a node that closes one connection and opens the next, as a long-lived cloud does per job); one whose
handler closes the client is acknowledged before the DISCONNECT. Held messages are acknowledged as they are held
(an unacknowledged one would keep its place in the broker's in-flight window for as long as no handler comes): a
node killed before it subscribed loses them. A client that only borrows a node's session (``protocols.twin``'s check,
which may find the node's live process holding it) holds every acknowledgement back until it knows it keeps the
session (:meth:`Inbound.defer_acks`): refused, it leaves all it received to the live process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import paho.mqtt.client as mqtt

from ..wire import chunking
from .base import EventLoop, Handler, TimerHandle, topic_matches
from .chunk_acks import ChunkAcks
from .hold import Hold
from .traffic import TransportStats, publish_packet_bytes

log = logging.getLogger("protocols.transport.mqtt")


class Inbound:
    """What :class:`~.mqtt.MqttTransport` receives; a base of it, sharing its state (declared here, set by
    its ``__init__``, guarded by its locks)."""

    client_id: str
    loop: EventLoop
    persistent: bool
    stats: TransportStats
    _cv: threading.Condition
    _subs: dict[str, tuple[int, list[Handler]]]
    _unsubscribed: set[str]
    _held: Hold
    _reasm: chunking.Reassembler
    _reasm_lock: threading.Lock
    _chunk_acks: ChunkAcks  # a persistent client's chunk sets acknowledged whole
    _closed: bool
    _chunk_auth: chunking.ChunkAuth | None
    _expiry: TimerHandle | None
    _client: mqtt.Client
    _reactor: Any
    _gen: int  # the connection's number: an acknowledgement belongs to the connection that received the message
    _taking: Callable[[], None] | None  # the acknowledgement of the message whose handler runs now
    _keep: Callable[[], None] | None  # ... its handler's share of it, unless the handler keeps it (keep_ack)
    _keep_chunks = 0  # ... the chunks held unacknowledged with it
    _acked_since_publish = False  # a PUBACK written since the last QoS-1 publish (close() confirms it: _settle)
    _deferred: list[tuple[int, int, int]] | None = None  # (connection, mid, qos): acknowledgements held back

    def _reassemble(self, timeout: float, max_bytes: int, max_message: int | None) -> None:
        """Reassemble chunks with these bounds (``chunking.Reassembler``); a set dropped has its chunks acknowledged."""
        self._reasm = chunking.Reassembler(timeout=timeout, max_bytes=max_bytes, max_message=max_message)
        self._reasm_lock = threading.Lock()
        self._chunk_acks = ChunkAcks(self.client_id)
        self._reasm.on_drop = self._chunk_acks.dropped

    def configure_wire(self, *, auth: chunking.ChunkAuth | None = None, max_message_bytes: int | None = None) -> None:
        """Sign outgoing chunks and require signed incoming ones (``auth``); bound incoming messages."""
        if auth is not None:
            self._chunk_auth = auth
        with self._reasm_lock:
            self._reasm.limit(max_message_bytes, auth)

    @property
    def held(self) -> tuple[int, int]:
        """(messages, bytes) held for a handler not subscribed yet (see the module doc)."""
        with self._cv:
            return len(self._held), self._held.nbytes

    @property
    def reassembly_bytes(self) -> int:
        """Bytes reserved by incomplete chunk sets."""
        return self._reasm.reserved

    def _on_message(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        if self._closed:  # closing: not acknowledged, so the broker hands it to this node's next session
            return
        ack = self._acker(msg.mid, msg.qos) if self.persistent and msg.qos else None
        try:
            if self._receive(msg, ack):
                return  # posted: acknowledged once its handlers ran (_bind)
        except Exception:  # an exception here would kill paho's network thread
            log.exception("%s: failed to handle an incoming message", self.client_id)
        if self._closed and self.persistent:  # closed meanwhile (close() on another thread): dropped or held for
            return  # nobody, so not acknowledged: the broker hands it to the next session
        with self._cv:
            gen = self._gen
        self._send_ack(gen, msg.mid, msg.qos)  # taken (held, refused, or posted by a clean client): may be forgotten

    def _acker(self, mid: int, qos: int) -> Callable[[], None]:
        """Acknowledge ``mid`` once, on the connection that received it (after a reconnect the broker resends it)."""
        with self._cv:
            gen = self._gen
        done = False

        def ack() -> None:
            nonlocal done
            with self._cv:
                if done or gen != self._gen or self._closed:  # closed (or killed): the next session gets it
                    return
                done = True
            self._send_ack(gen, mid, qos)

        return ack

    def _send_ack(self, gen: int, mid: int, qos: int) -> None:
        """Acknowledge ``mid`` (received on connection ``gen``), or keep it for :meth:`release_acks`."""
        if not qos:
            return
        with self._cv:
            if self._deferred is not None:
                self._deferred.append((gen, mid, qos))
                return
        self._client.ack(mid, qos)
        self._acked_since_publish = True  # (set once queued: a publish queued before it does not confirm it)
        if self._reactor is not None:
            self._reactor.wake(self._client)

    def defer_acks(self) -> None:
        """Hold back every acknowledgement from now on (call it before connecting) until :meth:`release_acks`. A
        process that takes a node's persistent session over to check whether the node's live process holds it
        (``protocols.twin``) receives what the broker meant for the live one (what was in flight to it, what came
        meanwhile); acknowledged, it was gone for the live process (a round waited out its deadline for results
        taken by the check), unacknowledged, the broker hands it to the live process again as it takes its session
        back (MQTT 3.1.1: a resumed session's unacknowledged QoS-1 messages are sent again). Never released (a
        refused process closes with them held back), they stay the session's."""
        with self._cv:
            self._deferred = []

    def release_acks(self) -> None:
        """Send the acknowledgements :meth:`defer_acks` held back, of this connection's messages (the broker sends
        an earlier connection's again), and acknowledge as usual from now on."""
        with self._cv:
            deferred, self._deferred, gen = self._deferred or [], None, self._gen
        for at, mid, qos in deferred:
            if at == gen and not self._closed:
                self._send_ack(gen, mid, qos)

    def _receive(self, msg: mqtt.MQTTMessage, ack: Callable[[], None] | None = None) -> bool:
        """Take ``msg``; True when it was posted to handlers and ``ack`` (not None) will acknowledge it."""
        if self._closed:
            return False
        topic, data = msg.topic, msg.payload
        data = bytes(data) if isinstance(data, bytearray) else data  # paho hands bytes (typed: or bytearray)
        self.stats._count(topic, publish_packet_bytes(len(topic.encode()), len(data), msg.qos), len(data), out=False)
        chunk = chunking.chunk_set(topic, data) if ack is not None else None  # a persistent client's chunk
        with self._reasm_lock:
            whole = self._reasm.feed(topic, data)
            if chunk is not None and whole is None:  # held with its set (acknowledged once handled), or now
                return self._reasm.holds(chunk.ident) and self._chunk_acks.take(chunk, ack)  # type: ignore[arg-type]
            held = self._chunk_acks.whole(chunk.ident) if chunk is not None else None  # the set's other chunks
        if whole is None:
            return False
        others, chunks = held if held is not None else (None, 0)
        if others is not None:
            assert ack is not None
            ack = _both(ack, others)
        with self.stats._lock:
            self.stats.messages_in += 1
        with self._cv:  # posted under the lock: a subscribe() handing out held messages cannot interleave
            targets = [(p, h) for p, (_, hs) in self._subs.items() if topic_matches(p, topic) for h in hs]
            if not targets:
                if self.persistent and not any(topic_matches(p, topic) for p in self._unsubscribed):
                    self._held.offer(topic, whole)
                if others is not None:
                    others()  # held or dropped: taken (this chunk's acknowledgement follows)
                return False
            taken = _after_each(len(targets), ack) if ack is not None else None
            for pattern, handler in targets:
                self.loop.post(self._bind(pattern, handler, topic, whole, ack, taken, chunks))
        return ack is not None

    def _bind(
        self,
        pattern: str,
        handler: Handler,
        topic: str,
        payload: bytes,
        ack: Callable[[], None] | None = None,
        taken: Callable[[], None] | None = None,
        chunks: int = 0,
    ) -> Callable[[], None]:
        """The loop's call of ``handler``; ``taken`` (``ack`` once every handler of the message returned) after it
        returned or raised an ``Exception`` (a poison message is not handed again), not after a ``BaseException``
        (Ctrl-C, ``SystemExit`` in the handler: it did not finish, so the next session gets the message). ``chunks``:
        those of a chunked message held unacknowledged with it (``chunk_acks``)."""

        def deliver() -> None:
            if self._closed:  # not acknowledged: the broker hands it to the next session
                return
            entry = self._subs.get(pattern)
            self._taking = ack  # a handler that closes this client: acknowledged before the DISCONNECT
            self._keep, self._keep_chunks = taken, chunks
            try:
                if entry is not None and handler in entry[1]:  # still subscribed
                    handler(topic, payload)
            except Exception:
                if self._keep is not None:
                    self._keep()  # raised: taken all the same (the loop logs it)
                raise
            else:
                if self._keep is not None:
                    self._keep()  # taken once its handlers returned: a node killed in one gets it again
            finally:
                self._taking = self._keep = None

        return deliver

    def keep_ack(self) -> Callable[[], None] | None:
        """The handler running now keeps its message's acknowledgement (``Transport.keep_ack``): not sent when it
        returns, nor before a DISCONNECT it makes (a message kept was not taken yet)."""
        kept, chunks = self._keep, self._keep_chunks
        if kept is not None and chunks:  # a chunked message: its chunks count in the budget again while kept
            with self._reasm_lock:
                if not self._chunk_acks.reserve(chunks):
                    return None  # over the budget: acknowledged when the handler returns
            kept = _both(kept, _once(partial(self._release_chunks, chunks)))
        self._keep = None
        if kept is not None:
            self._taking = None
        return kept

    def _release_chunks(self, chunks: int) -> None:
        with self._reasm_lock:
            self._chunk_acks.release(chunks)

    def _schedule_expiry(self) -> None:
        period = max(0.5, self._reasm.timeout / 2)

        def tick() -> None:
            if self._closed:
                return
            with self._reasm_lock:
                self._reasm.expire()
            with self._cv:
                self._held.expire()
            self._expiry = self.loop.call_later(period, tick)

        self.loop.cancel(self._expiry)
        self._expiry = self.loop.call_later(period, tick)


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def once() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return once


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def both() -> None:
        first()
        then()

    return both


def _after_each(handlers: int, ack: Callable[[], None]) -> Callable[[], None]:
    """``ack`` once it was called ``handlers`` times (each handler of a message, all on the loop's thread)."""
    left = [handlers]

    def one_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            ack()

    return one_done
