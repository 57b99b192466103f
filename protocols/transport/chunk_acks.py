"""A persistent client's chunked messages acknowledged whole, within a budget of the broker's in-flight window.

A QoS-1 message is acknowledged once its handlers returned, so a node killed in one gets it again in its next
session (``protocols.transport.inbound``). A chunked message is many PUBLISH packets: acknowledged only once
its handlers returned, its chunks keep places in the broker's in-flight window for the client (Mosquitto's
``max_inflight_messages``: 20 by default, 64 where fedtier writes the config; the broker sends nothing more
once it is full, and matches each PUBACK to its message by id, in any order). A set whose chunks all stayed
unacknowledged must complete with the window's other places, so the chunks of incomplete sets held
unacknowledged stay within :data:`MAX_UNACKED_CHUNKS` (12), well under any such window: a set is held whole when its
chunk count fits in what is left of the budget at its first chunk, and all its chunks are acknowledged together
once every handler of the message returned (or at once when the set is dropped: expired, evicted, a wrong hash,
or the message held or refused whole). A whole message waiting for its handler leaves the budget: it needs no
more of the window, and its unacknowledged chunks only make the broker wait for the loop, as one-chunk messages
do. A set that does not fit is acknowledged chunk by chunk as it comes, as before, with a warning naming its
size (once a connection): a node killed in its handler loses that message (its next session gets only the chunks not yet
acknowledged, which expire). A handler that keeps a chunked message's acknowledgement past its return
(``Transport.keep_ack``: the async cloud's push waiting for a version, ``cloud.async_server.UNACKED_WAITING`` of
them, 4, one-chunk or not) puts its chunks in the budget again until it acknowledges them, or, over the budget,
does not keep it; so what is held unacknowledged for long stays within 12 + 4 places of Mosquitto's default
window of 20, and a set can always complete. Kept acknowledgements hold at most half the budget (6): those kept
are the pushes of a cell past its share (pushing too fast), for as long as a version takes, so with all 12 a
flooding cell made every other chunked message arriving meanwhile be acknowledged chunk by chunk (lost if the node
died in its handler); half stays for the sets coming in. Called with the transport's reassembly lock held."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from ..wire.chunking import ChunkSet
from ..wire.ratelog import RateLimitedLog

log = logging.getLogger("protocols.transport.mqtt")

MAX_UNACKED_CHUNKS = 12
"""Chunks a persistent client holds unacknowledged at once (Mosquitto's default window is 20; 4 more places may be
kept by a handler: the async cloud's waiting pushes)."""

Ack = Callable[[], None]
_said = RateLimitedLog(log)  # one for the process: a transport's own would be one more object a connection


class ChunkAcks:
    """The acknowledgements of the chunk sets held whole (see the module doc)."""

    def __init__(self, client_id: str, budget: int = MAX_UNACKED_CHUNKS) -> None:
        self.client_id, self.budget = client_id, budget
        self.held = 0  # chunks reserved by the sets held whole not whole yet, and by kept acknowledgements
        self.kept = 0  # ... by kept acknowledgements (at most half the budget)
        self._sets: dict[tuple[str, str, bytes], tuple[int, list[Ack]]] = {}  # ident -> (count, acks)
        self._over: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()  # sets acknowledged as they come
        self._warned = False  # an over-budget set was logged (once a connection: else a device's every task, a cell's
        # every device's result)

    def take(self, chunk: ChunkSet, ack: Ack) -> bool:
        """Hold ``ack`` (of a chunk of ``chunk``'s set, not whole yet) until the set is; False: acknowledge it now
        (the set does not fit in the budget, or already holds two acknowledgements a chunk)."""
        entry = self._sets.get(chunk.ident)
        if entry is None:
            if chunk.ident in self._over:
                return False
            if self.held + chunk.chunks > self.budget:
                self._over_budget(chunk)
                return False
            self.held += chunk.chunks
            entry = self._sets[chunk.ident] = (chunk.chunks, [])
        count, acks = entry
        if len(acks) >= 2 * count:  # duplicates (a resend after a reconnect: the older acknowledgements are void)
            return False
        acks.append(ack)
        return True

    def whole(self, ident: tuple[str, str, bytes]) -> tuple[Ack, int] | None:
        """The acknowledgement of the chunks held of the set ``ident``, now whole, and their number (None if none were
        held): to call once its message is handled (or held, or refused). Its chunks leave the budget now: a whole
        message waiting for its handler needs no more of the window (the broker waits for the loop, whatever comes
        next), unless its handler keeps the acknowledgement (:meth:`reserve`)."""
        entry = self._sets.pop(ident, None)
        if entry is None:
            return None
        count, acks = entry
        self.held -= count
        done = False

        def ack_all() -> None:
            nonlocal done
            if not done:
                done = True
                for ack in acks:
                    ack()

        return ack_all, count

    def reserve(self, chunks: int) -> bool:
        """A handler keeps the acknowledgement of a whole message of ``chunks`` chunks past its return (``keep_ack``:
        the async cloud's push waiting for a version): they count in the budget again until :meth:`release`, as a set
        not whole does (a message kept may wait for what other messages bring). False: over the budget, or over the
        half of it kept acknowledgements may hold, not kept."""
        if self.held + chunks > self.budget or self.kept + chunks > self.budget // 2:
            return False
        self.held += chunks
        self.kept += chunks
        return True

    def release(self, chunks: int) -> None:
        """The kept acknowledgement of ``chunks`` chunks went (:meth:`reserve`)."""
        self.held -= chunks
        self.kept -= chunks

    def dropped(self, ident: tuple[str, str, bytes]) -> None:
        """The set ``ident`` was dropped before it was whole: its chunks are acknowledged now (it is lost)."""
        held = self.whole(ident)
        if held is not None:
            held[0]()

    def _over_budget(self, chunk: ChunkSet) -> None:
        self._over[chunk.ident] = None
        while len(self._over) > 1024:
            self._over.popitem(last=False)
        if self._warned:
            return
        self._warned = True
        _said.warning(
            "%s: a chunked message of %d bytes (%d chunks) on %s is acknowledged chunk by chunk: with %d chunks held "
            "unacknowledged it would exceed the budget of %d (the broker's in-flight window), so a node killed in "
            "its handler loses it (said once a connection)",
            self.client_id,
            chunk.total,
            chunk.chunks,
            chunk.ident[0],
            self.held,
            self.budget,
        )
