"""In-memory transport: a deterministic broker and a virtual clock in one thread.

Every publish is delivered after the current handler returns, in publish order, to subscribers in
subscription order; timers fire in (time, creation) order once nothing else is queued. The same
seed therefore gives the same interleaving every time, and a simulated deadline costs no real time.

Work done outside the loop (device training in worker processes, ``sim/executors.py``) is registered
with :meth:`VirtualLoop.hold`: while any is unfinished the clock does not advance (timers due now
still fire), and the loop blocks until the oldest one completes. Completions run in the order the
work was registered, so the run does not depend on which worker finishes first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeGuard

from ..wire.envelope import Segments
from ..wire.payload import Lent
from .base import EventLoop, Handler, TimerHandle, Transport, Will, topic_matches


class VirtualLoop(EventLoop):
    """A single-threaded loop whose clock jumps to the next timer when there is nothing to do."""

    def __init__(self) -> None:
        self._now = 0.0
        self._ready: deque[Callable[[], None]] = deque()
        self._timers: list[TimerHandle] = []
        self._seq = itertools.count()
        self._held: deque[_Held] = deque()  # outstanding outside work, oldest first
        self._done = threading.Condition()
        self.on_idle: Callable[[], None] | None = None
        """Called when the loop would wait for outside work: nothing ready, no timer due now (the
        cohort engine trains its queued devices then, ``edge_agent/cohort.py``)."""

    def now(self) -> float:
        return self._now

    def start_at(self, t: float) -> None:
        """Move the clock, before anything ran, to ``t`` (a resumed run goes on from its virtual time); the timers
        already set move with it."""
        shift = t - self._now
        self._now = t
        for handle in self._timers:
            handle.when += shift

    def post(self, fn: Callable[[], None]) -> None:
        self._ready.append(fn)

    def call_later(self, delay: float, fn: Callable[[], None]) -> TimerHandle:
        handle = TimerHandle(self._now + max(0.0, delay), next(self._seq), fn)
        heapq.heappush(self._timers, handle)
        return handle

    def hold(self) -> Callable[[Callable[[], None]], None]:
        """Register work done outside the loop; returns ``complete(fn)``, callable from any thread
        once, which makes ``fn`` run on the loop (after earlier registered work completed)."""
        held = _Held()
        self._held.append(held)

        def complete(fn: Callable[[], None]) -> None:
            with self._done:
                held.fn = fn
                self._done.notify_all()

        return complete

    @property
    def outstanding(self) -> int:
        """Registered outside work not yet completed on the loop."""
        return len(self._held)

    def step(self) -> bool:
        """Run one queued call or the next timer; False when nothing is left.

        With outside work outstanding, only timers due now fire; otherwise the loop waits for the
        oldest work and runs its completion."""
        if self._ready:
            self._ready.popleft()()
            return True
        if self._held:
            while self._timers and self._timers[0].cancelled:
                heapq.heappop(self._timers)
            if self._timers and self._timers[0].when <= self._now:
                heapq.heappop(self._timers).fn()
                return True
            held = self._held[0]
            if held.fn is None and self.on_idle is not None:
                self.on_idle()
            with self._done:
                while held.fn is None:
                    self._done.wait(1.0)
            self._held.popleft()
            held.fn()
            return True
        while self._timers:
            handle = heapq.heappop(self._timers)
            if handle.cancelled:
                continue
            self._now = max(self._now, handle.when)
            handle.fn()
            return True
        return False

    def run_due(self, until: Callable[[], bool] | None = None) -> None:
        """Run everything due at the current time (queued calls, outside work, timers due now) without moving the
        clock, or until ``until()`` is true: one process of a simulation split across processes runs to the end
        of the present before it trades messages with the others (``sim/cell_processes.py``)."""
        while not (until and until()):
            if not self._ready and not self._held:
                next_at = self.next_timer()
                if next_at is None or next_at > self._now:
                    return
            self.step()

    def next_timer(self) -> float | None:
        """When the next timer fires; ``None``: no timer is set."""
        while self._timers and self._timers[0].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0].when if self._timers else None

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` (never back; no later than :meth:`next_timer`: the processes of a split
        simulation move to the earliest timer of them all)."""
        self._now = max(self._now, t)

    def run(self, until: Callable[[], bool] | None = None, max_steps: int | None = None) -> None:
        """Run until ``until()`` is true, nothing is left, or ``max_steps`` calls have run."""
        steps = 0
        while not (until and until()):
            if max_steps is not None and steps >= max_steps:
                return
            if not self.step():
                return
            steps += 1


class _Held:
    """One piece of outside work: its completion, once known."""

    __slots__ = ("fn",)

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None


class _Sub:
    """One subscription; ``seq`` orders deliveries (subscription order, as one list would)."""

    __slots__ = ("seq", "client_id", "pattern", "handler", "group", "segments")

    def __init__(
        self, seq: int, client_id: str, pattern: str, handler: Handler, group: dict[int, _Sub], segments: bool
    ) -> None:
        self.seq, self.client_id, self.pattern, self.handler, self.group = seq, client_id, pattern, handler, group
        self.segments = segments  # the handler takes a message as Segments (else it gets the joined bytes)


def _literal_key(pattern: str) -> tuple[int, str] | None:
    """``(levels, prefix)`` of the literal levels before a pattern's first wildcard; ``None``: no wildcard."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if part in ("+", "#"):
            return i, "/".join(parts[:i])
    return None


MAX_ROUTES = 65_536
"""Topics whose subscriptions a hub keeps looked up (all of them are forgotten at once past it)."""


class MemoryHub:
    """The broker of the in-memory transport: routes, retains and fires last wills.

    Routing costs what matches, not what is subscribed: exact topics are a table, wildcard
    subscriptions are grouped by their literal prefix (a publish looks up each prefix of its topic),
    and retained messages are indexed by parent topic (a ``prefix/+`` subscription reads only its
    own). Deliveries keep subscription order, and retained ones the order they were first retained."""

    def __init__(self, loop: VirtualLoop | None = None, link_delay: Callable[[str, int], float] | None = None) -> None:
        """``link_delay(topic, nbytes)``: virtual seconds a message takes to arrive (a network
        model, see ``sim/clock.py``); without it every message arrives at once."""
        self.loop = loop or VirtualLoop()
        self.link_delay = link_delay
        self._seq = itertools.count()
        self._exact: dict[str, dict[int, _Sub]] = {}  # topic -> its subscriptions by seq
        self._wild: dict[tuple[int, str], dict[int, _Sub]] = {}  # literal prefix -> wildcard subscriptions
        self._by_client: dict[str, dict[int, _Sub]] = {}
        self._routes: dict[str, list[_Sub]] = {}  # topic -> _matching's answer, until a subscription changes
        self._retained: dict[str, bytes] = {}
        self._retained_under: dict[str, dict[str, None]] = {}  # parent topic -> its retained topics, in order
        self._clients: dict[str, MemoryTransport] = {}
        self.tap: Callable[[str, bytes | Segments, bool], None] | None = None
        """Sees each message published here ``(topic, payload, retain)``, not those :meth:`inject` brings: a
        simulation split across processes forwards what the others' nodes subscribe to (``sim/cell_processes.py``)."""

    def connect(self, client_id: str, will: Will | None = None) -> MemoryTransport:
        """Connect a client; an existing session with the same id is taken over (as MQTT does)."""
        old = self._clients.get(client_id)
        if old is not None:
            old._detach()
        transport = MemoryTransport(self, client_id, will)
        self._clients[client_id] = transport
        return transport

    def _matching(self, topic: str) -> list[_Sub]:
        """The subscriptions ``topic`` reaches, in subscription order (not to be changed: kept for the topic's next
        message until any subscription changes; a run publishes on the same topics every round)."""
        found = self._routes.get(topic)
        if found is None:
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            found = self._routes[topic] = self._match(topic)
        return found

    def _match(self, topic: str) -> list[_Sub]:
        exact = self._exact.get(topic)
        found = list(exact.values()) if exact else []
        if self._wild:
            groups = 0
            parts = topic.split("/")
            for k in range(len(parts) + 1):
                group = self._wild.get((k, "/".join(parts[:k])))
                if group:
                    groups += 1
                    found.extend(s for s in group.values() if topic_matches(s.pattern, topic))
            if groups + (1 if exact else 0) > 1:
                found.sort(key=lambda s: s.seq)
        return found

    def _route(self, topic: str, payload: bytes | Segments, retain: bool) -> None:
        """A message published here: shown to the :attr:`tap`, then delivered (:meth:`inject`)."""
        if self.tap is not None:
            self.tap(topic, payload, retain)
        self.inject(topic, payload, retain)

    def inject(self, topic: str, payload: bytes | Segments, retain: bool) -> None:
        """Deliver ``payload`` to the subscriptions ``topic`` reaches; a message as :class:`Segments` to the handlers
        that take them, else joined (once for all of them), as a retained message is."""
        joined = payload if type(payload) is bytes else None
        if retain:
            joined = joined or bytes(payload)
            self._retain(topic, joined)
        delay = self.link_delay(topic, len(payload)) if self.link_delay is not None else 0.0
        for sub in self._matching(topic):
            if sub.segments or type(payload) is not Segments:
                data: bytes | Segments = payload
            else:
                data = joined = joined or bytes(payload)
            if delay > 0:
                self.loop.call_later(delay, _bind(sub.handler, topic, data, self, sub.client_id))
            else:
                self.loop.post(_bind(sub.handler, topic, data, self, sub.client_id))

    def _retain(self, topic: str, payload: bytes) -> None:
        parent = topic.rpartition("/")[0]
        if payload:
            if topic not in self._retained:
                self._retained_under.setdefault(parent, {})[topic] = None
            self._retained[topic] = payload
        elif self._retained.pop(topic, None) is not None:
            under = self._retained_under[parent]
            del under[topic]
            if not under:
                del self._retained_under[parent]

    def _retained_for(self, pattern: str) -> list[str]:
        """Retained topics ``pattern`` matches, in the order they were first retained."""
        key = _literal_key(pattern)
        if key is None:
            return [pattern] if pattern in self._retained else []
        if pattern.endswith("/+") and key[0] == pattern.count("/"):  # "prefix/+": one parent's topics
            return list(self._retained_under.get(pattern[:-2], ()))
        return [t for t in self._retained if topic_matches(pattern, t)]

    def _subscribe(self, client_id: str, pattern: str, handler: Handler, segments: bool = False) -> None:
        self._routes.clear()
        key = _literal_key(pattern)
        group = self._exact.setdefault(pattern, {}) if key is None else self._wild.setdefault(key, {})
        sub = _Sub(next(self._seq), client_id, pattern, handler, group, segments)
        group[sub.seq] = sub
        self._by_client.setdefault(client_id, {})[sub.seq] = sub
        for topic in self._retained_for(pattern):
            self.loop.post(_bind(handler, topic, self._retained[topic], self, client_id))

    def _unsubscribe(self, client_id: str, pattern: str | None = None) -> None:
        mine = self._by_client.get(client_id)
        if not mine:
            return
        self._routes.clear()
        for seq, sub in list(mine.items()):
            if pattern is None or sub.pattern == pattern:
                del mine[seq], sub.group[seq]
                if not sub.group:
                    key = _literal_key(sub.pattern)
                    if key is None:
                        self._exact.pop(sub.pattern, None)
                    else:
                        self._wild.pop(key, None)
        if not mine:
            del self._by_client[client_id]

    def _is_connected(self, client_id: str) -> bool:
        return client_id in self._clients


def _bind(
    handler: Handler, topic: str, payload: bytes | Segments, hub: MemoryHub, client_id: str
) -> Callable[[], None]:
    def deliver() -> None:
        if hub._is_connected(client_id):  # a client that left meanwhile gets nothing
            handler(topic, payload)  # type: ignore[arg-type]  # Segments only to a handler subscribed for them

    return deliver


class MemoryTransport(Transport):
    """One node's connection to a :class:`MemoryHub`."""

    takes_segments = True

    def __init__(self, hub: MemoryHub, client_id: str, will: Will | None) -> None:
        self.hub, self.client_id, self.loop, self._will = hub, client_id, hub.loop, will
        self._open = True

    def publish(
        self, topic: str, payload: bytes | memoryview | Segments, *, qos: int = 1, retain: bool = False
    ) -> None:
        """Route ``payload`` as it is where it cannot change (``bytes``, a message framed in lent bytes: the
        handlers read it as they read bytes, ``Messenger.receive``; a message's :class:`Segments`: its envelope and
        an immutable shared payload), else a copy of it."""
        if self._open:
            if isinstance(payload, Segments):
                self.hub._route(topic, payload, retain)
            else:
                self.hub._route(topic, payload if frozen(payload) else bytes(payload), retain)

    def subscribe(self, pattern: str, handler: Handler, *, qos: int = 1, segments: bool = False) -> None:
        if self._open:
            self.hub._subscribe(self.client_id, pattern, handler, segments)

    def unsubscribe(self, pattern: str) -> None:
        self.hub._unsubscribe(self.client_id, pattern)

    @property
    def connected(self) -> bool:
        return self._open

    def _detach(self) -> None:
        self._open = False
        self.hub._unsubscribe(self.client_id)
        if self.hub._clients.get(self.client_id) is self:
            del self.hub._clients[self.client_id]

    def close(self) -> None:
        """Clean disconnect: the will is discarded."""
        if self._open:
            self._detach()

    def crash(self) -> None:
        """Vanish without a clean disconnect: the hub publishes the will, as a broker would."""
        if self._open:
            self._detach()
            if self._will is not None:
                self.hub._route(self._will.topic, self._will.payload, self._will.retain)


def frozen(data: bytes | memoryview) -> TypeGuard[bytes]:
    """Whether ``data`` can never change: ``bytes``, or a read-only view of :class:`~protocols.wire.payload.Lent`
    bytes (a message framed in place), which its handlers read as ``bytes`` (it is passed on as one)."""
    return type(data) is bytes or (isinstance(data, memoryview) and data.readonly and isinstance(data.obj, Lent))
