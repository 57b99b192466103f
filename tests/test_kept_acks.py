"""Kept acknowledgements (``Transport.keep_ack``: the async cloud's pushes waiting past their cell's share) within
the chunk budget: a cell flooding chunked pushes cannot take the whole budget, so another cell's chunked push
arriving meanwhile is still held unacknowledged until it is handled (a cloud killed in its handler gets it again)."""

from __future__ import annotations

import os
from collections.abc import Callable

import paho.mqtt.client as mqtt

from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.wire import chunking

WAIT = 10.0


class FakeBroker:
    """Hands a persistent node's network callback the chunks of messages, as its broker would, and records the
    node's acknowledgements (their message ids)."""

    def __init__(self, node: MqttTransport) -> None:
        self.node, self.acks, self._mids = node, list[int](), iter(range(1, 1000))
        node._client = self  # type: ignore[assignment]

    def ack(self, mid: int, qos: int) -> None:
        self.acks.append(mid)

    def push(self, topic: bytes, size: int) -> list[int]:
        """A message of ``size`` random bytes on ``topic`` in chunks of 1000 bytes; their message ids."""
        sent = []
        for chunk in chunking.split(os.urandom(size), 1000):
            msg = mqtt.MQTTMessage(next(self._mids), topic)
            msg.payload, msg.qos = chunk, 1
            self.node._on_message(self, None, msg)  # type: ignore[arg-type]
            sent.append(msg.mid)
        return sent


def test_a_flooding_cells_kept_pushes_leave_room_for_another_cells_chunked_push() -> None:
    """c0's pushes are kept (as waiting past its share): 6 chunks, then 6 more. Before, both were kept (12 of the
    12 chunks), so c1's push of 5 chunks, arriving meanwhile, was acknowledged chunk by chunk as it came, before its
    handler ran (lost if the cloud died in it). Kept acknowledgements hold at most half the budget: c0's second is
    not kept (acknowledged when its handler returned), c1's push is held whole and acknowledged once handled, and
    c0's first, kept, once the cloud calls it; nothing is left in the budget."""
    loop = ThreadLoop("acks")
    node = MqttTransport("fedtier-t-cloud", loop, "127.0.0.1", 1, persistent=True)
    broker = FakeBroker(node)
    acks, push = broker.acks, broker.push
    kept: list[Callable[[], None] | None] = []
    acked_in_handler: list[list[int]] = []
    node.subscribe("t/c0/push", lambda t, p: kept.append(node.keep_ack()))
    node.subscribe("t/c1/push", lambda t, p: acked_in_handler.append(list(acks)))
    first = push(b"t/c0/push", 6 * 950)
    assert loop.run(until=lambda: len(kept) == 1, timeout=WAIT)
    second = push(b"t/c0/push", 6 * 950)
    assert loop.run(until=lambda: len(kept) == 2, timeout=WAIT)
    assert kept[0] is not None and kept[1] is None  # before: both kept, the budget full
    assert sorted(acks) == second and node._chunk_acks.held == 6
    honest = push(b"t/c1/push", 5 * 950)
    assert loop.run(until=lambda: len(acked_in_handler) == 1, timeout=WAIT)
    assert not set(honest) & set(acked_in_handler[0])  # held unacknowledged until handled
    assert loop.run(until=lambda: set(honest) <= set(acks), timeout=WAIT)
    kept[0]()
    assert sorted(acks) == sorted(first + second + honest) and node._chunk_acks.held == 0


def test_a_kept_chunked_message_holds_its_chunks_in_the_budget_until_acknowledged() -> None:
    """A handler may keep its message's acknowledgement (the async cloud's push waiting for a version). A chunked
    message's is all its chunks: kept, they hold places in the broker's window for as long as the version takes,
    so they count in the chunk budget again (12) until acknowledged, at most half of it (6); one that would pass that
    is not kept (acknowledged when its handler returns), so sets not whole yet can always complete."""
    node = MqttTransport("fedtier-t-cloud", ThreadLoop("acks"), "127.0.0.1", 1, persistent=True)
    broker = FakeBroker(node)
    acks = broker.acks
    kept: list[Callable[[], None] | None] = []
    node.subscribe("t/push", lambda t, p: kept.append(node.keep_ack()))

    def push(size: int) -> list[int]:
        return broker.push(b"t/push", size)

    first = push(3 * 950)  # 3 chunks
    assert node.loop.run(until=lambda: len(kept) == 1, timeout=WAIT)
    assert kept[0] is not None and acks == [] and node._chunk_acks.held == 3  # kept: in the budget
    second, third = push(3 * 950), push(3 * 950)  # each held whole as it came (3 + 3), both whole before handled
    assert node._chunk_acks.held == 3
    assert node.loop.run(until=lambda: len(kept) == 3, timeout=WAIT)
    assert kept[1] is not None and node._chunk_acks.held == 6  # kept: 3 + 3
    assert kept[2] is None and sorted(acks) == third  # 6 + 3 > 6 kept: not kept, acknowledged when its handler returned
    for ack in (kept[0], kept[1], kept[0]):  # (once each)
        ack()
    assert sorted(acks) == sorted(first + second + third) and node._chunk_acks.held == 0
