"""In-memory transport: a deterministic broker on a virtual clock in one thread (the loop:
``protocols/transport/virtual_loop.py``).

Every publish is delivered after the current handler returns, in publish order, to subscribers in
subscription order; timers fire in (time, creation) order once nothing else is queued. The same
seed therefore gives the same interleaving every time, and a simulated deadline costs no real time.

A simulation declares its nodes' sides (:attr:`MemoryHub.side_of`): the loop then runs the cloud's side and the
cells' in turns at each virtual instant, and a message between them crosses at the turn, among the others in the
order of their senders: the order a simulation split across processes follows (``sim/cell_processes.py``), so it
is the same run either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeGuard

from ..wire.envelope import Segments
from ..wire.payload import Lent
from .base import Handler, Transport, Will, topic_matches
from .virtual_loop import CELLS, MAIN, VirtualLoop

__all__ = ["CELLS", "MAIN", "MemoryHub", "MemoryTransport", "VirtualLoop", "frozen"]


class _Sub:
    """One subscription; ``seq`` orders deliveries (subscription order, as one list would)."""

    __slots__ = ("seq", "client_id", "pattern", "handler", "group", "segments", "side")

    def __init__(
        self,
        seq: int,
        client_id: str,
        pattern: str,
        handler: Handler,
        group: dict[int, _Sub],
        segments: bool,
        side: int | None = MAIN,
    ) -> None:
        self.seq, self.client_id, self.pattern, self.handler, self.group = seq, client_id, pattern, handler, group
        self.segments = segments  # the handler takes a message as Segments (else it gets the joined bytes)
        self.side = side  # its client's side of the loop (``None``: neither, it takes messages as they are sent)


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

    def __init__(
        self,
        loop: VirtualLoop | None = None,
        link_delay: Callable[[str, int], float] | None = None,
        side_of: Callable[[str], int | None] | None = None,
    ) -> None:
        """``link_delay(topic, nbytes)``: virtual seconds a message takes to arrive (a network
        model, see ``sim/clock.py``); without it every message arrives at once. ``side_of(client_id)``: the side of
        the loop a client is on (:data:`MAIN`, :data:`CELLS`: ``sim.sim_cells.loop_sides``); a message from one side
        to a client of the other crosses at its turn (:meth:`VirtualLoop.cross`). A client of neither (``None``: an
        observer, a test's intruder) takes a message on the side it was sent from, at once, and what it sends is of
        the side acting then. Without ``side_of``, one side."""
        self.loop = loop or VirtualLoop()
        self.link_delay = link_delay
        self.side_of = side_of
        self._seq = itertools.count()
        self._exact: dict[str, dict[int, _Sub]] = {}  # topic -> its subscriptions by seq
        self._wild: dict[tuple[int, str], dict[int, _Sub]] = {}  # literal prefix -> wildcard subscriptions
        self._by_client: dict[str, dict[int, _Sub]] = {}
        self._routes: dict[str, list[_Sub]] = {}  # topic -> _matching's answer, until a subscription changes
        self._reached: dict[str, frozenset[int | None]] = {}  # topic -> the sides of its subscribers (likewise)
        self._retained: dict[str, bytes] = {}
        self._retained_under: dict[str, dict[str, None]] = {}  # parent topic -> its retained topics, in order
        self._clients: dict[str, MemoryTransport] = {}
        self.tap: Callable[[str, bytes | Segments, bool, str], None] | None = None
        """Sees each message published here ``(topic, payload, retain, sender)``, not those :meth:`inject` brings: a
        simulation split across processes forwards what the others' nodes subscribe to (``sim/cell_processes.py``)."""

    def connect(self, client_id: str, will: Will | Callable[[], Will] | None = None) -> MemoryTransport:
        """Connect a client; an existing session with the same id is taken over (as MQTT does). ``will``: its last
        will, or what makes it when it is due (a sim's device agent: most never crash, and its signed status record
        cost ~25 us an agent built)."""
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
                self._forget_routes()
            found = self._routes[topic] = self._match(topic)
        return found

    def _sides_reached(self, topic: str) -> frozenset[int | None]:
        """The sides of the clients subscribed to ``topic`` (kept as :meth:`_matching`'s answer is)."""
        sides = self._reached.get(topic)
        if sides is None:
            sides = self._reached[topic] = frozenset(sub.side for sub in self._matching(topic))
        return sides

    def _forget_routes(self, pattern: str | None = None) -> None:
        """Drop the routes kept of the topics ``pattern`` matches (a subscription to it came or went: only their
        subscribers changed), or all of them (too many topics were kept). A sim's device agent subscribes its own
        task topic as it is built and leaves when idle: every topic was matched again every round."""
        if pattern is None:
            self._routes.clear()
            self._reached.clear()
        elif _literal_key(pattern) is None:  # one topic
            self._routes.pop(pattern, None)
            self._reached.pop(pattern, None)
        else:
            for topic in [t for t in self._routes.keys() | self._reached.keys() if topic_matches(pattern, t)]:
                self._routes.pop(topic, None)
                self._reached.pop(topic, None)

    def _reroute(self, topic: str) -> None:
        """Keep the route of ``topic`` (if kept) right after a subscription to exactly it came or went: its exact
        subscriptions now, merged by ``seq`` with the wildcard ones it had (what :meth:`_match` would find again,
        without matching every wildcard group: a sim's device agent subscribes its task topic as it is built and leaves
        when idle, and each of a round's task topics was matched again)."""
        route = self._routes.get(topic)
        if route is None:
            self._reached.pop(topic, None)
            return
        exact = self._exact.get(topic)
        found = [s for s in route if s.pattern != topic] + (list(exact.values()) if exact else [])
        found.sort(key=lambda s: s.seq)
        self._routes[topic] = found
        self._reached[topic] = frozenset(sub.side for sub in found)

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

    def _route(self, topic: str, payload: bytes | Segments, retain: bool, sender: str, side: int | None) -> None:
        """A message ``sender`` (of ``side``: :attr:`side_of`'s, as its transport keeps it) published here: shown to
        the :attr:`tap`, then delivered (:meth:`inject`), to the other side's clients when its turn comes."""
        if self.tap is not None:
            self.tap(topic, payload, retain, sender)
        if self.side_of is None:
            self.inject(topic, payload, retain)
            return
        side = self.loop.acting_side if side is None else side
        self.inject(topic, payload, retain, side)
        other = MAIN if side == CELLS else CELLS
        if other in self._sides_reached(topic):  # (retained once, here and now)
            self.loop.cross(other, sender, lambda: self.inject(topic, payload, False, other, crossed=True))

    def inject(
        self, topic: str, payload: bytes | Segments, retain: bool, side: int | None = None, crossed: bool = False
    ) -> None:
        """Deliver ``payload`` to the subscriptions ``topic`` reaches: with ``side``, only those of its clients and
        of clients of neither side (not when it ``crossed`` to ``side``: they had it where it was sent), on ``side``;
        a message as :class:`Segments` to the handlers that take them, else joined (once for all of them), as a
        retained message is."""
        joined = payload if type(payload) is bytes else None
        if retain:
            joined = joined or bytes(payload)
            self._retain(topic, joined)
        delay = self.link_delay(topic, len(payload)) if self.link_delay is not None else 0.0
        for sub in self._matching(topic):
            if side is not None and sub.side != side and (crossed or sub.side is not None):
                continue
            if sub.segments or type(payload) is not Segments:
                data: bytes | Segments = payload
            else:
                data = joined = joined or bytes(payload)
            self._schedule(_bind(sub.handler, topic, data, self, sub.client_id), delay, side)

    def _schedule(self, deliver: Callable[[], None], delay: float, side: int | None) -> None:
        """``deliver`` on the loop after ``delay`` (at once: posted), on ``side`` of a loop with sides (a hub without
        :attr:`side_of` may run on any :class:`EventLoop`: tests put one on a ``ThreadLoop``)."""
        if self.side_of is None or side is None:
            if delay > 0:
                self.loop.call_later(delay, deliver)
            else:
                self.loop.post(deliver)
        elif delay > 0:
            self.loop.call_later(delay, deliver, side)
        else:
            self.loop.post(deliver, side)

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

    def _subscribe(self, client_id: str, pattern: str, handler: Handler, segments: bool, side: int | None) -> None:
        key = _literal_key(pattern)
        if key is not None:
            self._forget_routes(pattern)
        group = self._exact.setdefault(pattern, {}) if key is None else self._wild.setdefault(key, {})
        sub = _Sub(next(self._seq), client_id, pattern, handler, group, segments, side)
        group[sub.seq] = sub
        if key is None:
            self._reroute(pattern)
        self._by_client.setdefault(client_id, {})[sub.seq] = sub
        for topic in self._retained_for(pattern):
            self._schedule(_bind(handler, topic, self._retained[topic], self, client_id), 0.0, side)

    def _unsubscribe(self, client_id: str, pattern: str | None = None) -> None:
        mine = self._by_client.get(client_id)
        if not mine:
            return
        for seq, sub in list(mine.items()):
            if pattern is None or sub.pattern == pattern:
                exact = _literal_key(sub.pattern) is None
                if not exact:
                    self._forget_routes(sub.pattern)
                del mine[seq], sub.group[seq]
                if exact:
                    self._reroute(sub.pattern)
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

    def __init__(self, hub: MemoryHub, client_id: str, will: Will | Callable[[], Will] | None) -> None:
        self.hub, self.client_id, self.loop, self._will = hub, client_id, hub.loop, will
        self._open = True
        self.side = hub.side_of(client_id) if hub.side_of is not None else MAIN
        """Its side of the hub's loop (:attr:`MemoryHub.side_of`, asked once: a publish routes by it)."""

    def publish(
        self, topic: str, payload: bytes | memoryview | Segments, *, qos: int = 1, retain: bool = False
    ) -> None:
        """Route ``payload`` as it is where it cannot change (``bytes``, a message framed in lent bytes: the
        handlers read it as they read bytes, ``Messenger.receive``; a message's :class:`Segments`: its envelope and
        an immutable shared payload), else a copy of it."""
        if self._open:
            if isinstance(payload, Segments):
                self.hub._route(topic, payload, retain, self.client_id, self.side)
            else:
                self.hub._route(
                    topic, payload if frozen(payload) else bytes(payload), retain, self.client_id, self.side
                )

    def subscribe(self, pattern: str, handler: Handler, *, qos: int = 1, segments: bool = False) -> None:
        if self._open:
            self.hub._subscribe(self.client_id, pattern, handler, segments, self.side)

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
            will = self._will() if callable(self._will) else self._will
            if will is not None:
                self.hub._route(will.topic, will.payload, will.retain, self.client_id, self.side)


def frozen(data: bytes | memoryview) -> TypeGuard[bytes]:
    """Whether ``data`` can never change: ``bytes``, or a read-only view of :class:`~protocols.wire.payload.Lent`
    bytes (a message framed in place), which its handlers read as ``bytes`` (it is passed on as one)."""
    return type(data) is bytes or (isinstance(data, memoryview) and data.readonly and isinstance(data.obj, Lent))
