"""Chunk splitting and reassembly, driven by a fake clock."""

from __future__ import annotations

import os
import random

import pytest

from protocols.wire import chunking
from protocols.wire.chunking import HEADER_BYTES, MAGIC, Reassembler, is_chunk, split
from protocols.wire.keys import Trust


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def feed_all(r: Reassembler, key: str, parts: list[bytes]) -> list[bytes]:
    return [out for p in parts if (out := r.feed(key, p)) is not None]


def test_small_message_passes_through() -> None:
    assert split(b"hello", 64) == [b"hello"]
    r = Reassembler()
    assert r.feed("t", b"hello") == b"hello"
    assert r.pending == 0 and r.reserved == 0


def test_small_message_with_chunk_magic_is_framed() -> None:
    data = MAGIC + b"x" * 60
    parts = split(data, 128)
    assert len(parts) == 1 and parts[0] != data and is_chunk(parts[0])
    assert Reassembler().feed("t", parts[0]) == data


@pytest.mark.parametrize("size", [1000, 1024 - HEADER_BYTES, 5000, 64 * 1024 + 7])
def test_roundtrip_any_order(size: int) -> None:
    data = os.urandom(size)
    parts = split(data, 1024)
    assert all(len(p) <= 1024 for p in parts)
    assert len(parts) == (1 if size <= 1024 else -(-size // (1024 - HEADER_BYTES)))
    random.Random(size).shuffle(parts)
    r = Reassembler()
    assert feed_all(r, "t", parts) == [data]
    assert r.pending == 0 and r.reserved == 0


def test_duplicate_chunks_and_duplicate_message() -> None:
    data = os.urandom(10_000)
    parts = split(data, 1024)
    r = Reassembler()
    with_dups = [parts[0], parts[0], *parts[1:5], parts[3], *parts[5:]]
    assert feed_all(r, "t", with_dups) == [data]
    # the whole message delivered again: ignored, and no new incomplete set is left behind
    assert feed_all(r, "t", parts) == []
    assert r.pending == 0 and r.reserved == 0


def test_same_content_on_two_topics_is_two_messages() -> None:
    data = os.urandom(3000)
    parts = split(data, 1024)
    r = Reassembler()
    assert feed_all(r, "a", parts) == [data]
    assert feed_all(r, "b", parts) == [data]


def test_interleaved_messages() -> None:
    a, b = os.urandom(5000), os.urandom(7000)
    pa, pb = split(a, 1024), split(b, 1024)
    mixed = [p for pair in zip(pa, pb) for p in pair] + pb[len(pa) :]
    assert sorted(feed_all(Reassembler(), "t", mixed)) == sorted([a, b])


def test_incomplete_set_expires_and_memory_returns_to_zero() -> None:
    clock = FakeClock()
    r = Reassembler(timeout=10.0, clock=clock)
    parts = split(os.urandom(5000), 1024)
    feed_all(r, "t", parts[:-1])
    assert r.pending == 1 and r.reserved == 5000 - (len(parts[-1]) - HEADER_BYTES)  # only what arrived
    clock.t = 9.9
    assert r.expire() == 0 and r.pending == 1
    clock.t = 20.0
    assert r.expire() == 1
    assert r.pending == 0 and r.reserved == 0 and r.dropped == 1
    # the last chunk arriving late starts a fresh set, which never completes on its own
    assert r.feed("t", parts[-1]) is None and r.pending == 1
    clock.t = 40.0
    r.expire()
    assert r.reserved == 0


def test_activity_keeps_a_set_alive() -> None:
    clock = FakeClock()
    r = Reassembler(timeout=10.0, clock=clock)
    data = os.urandom(5000)
    parts = split(data, 1024)
    out = []
    for p in parts:
        clock.t += 6.0  # slower than the timeout in total, but each gap is shorter
        if (whole := r.feed("t", p)) is not None:
            out.append(whole)
    assert out == [data]


def test_memory_bound_rejects_oversized_message() -> None:
    r = Reassembler(max_bytes=4000)
    parts = split(os.urandom(5000), 1024)
    assert feed_all(r, "t", parts) == []
    assert r.pending == 0 and r.reserved == 0 and r.dropped == len(parts)


def test_memory_bound_evicts_oldest_incomplete_set() -> None:
    clock = FakeClock()
    r = Reassembler(max_bytes=8000, clock=clock)
    a, b = os.urandom(5000), os.urandom(5000)
    pa, pb = split(a, 1024), split(b, 1024)
    feed_all(r, "t", pa[:-1])
    clock.t = 1.0
    assert r.reserved == 5000 - (len(pa[-1]) - HEADER_BYTES)
    assert feed_all(r, "t", pb) == [b]  # needs room: a is evicted
    assert r.pending == 0 and r.reserved == 0 and r.dropped == 1
    assert r.reserved <= r.max_bytes


def test_corrupted_chunk_fails_hash_check() -> None:
    data = os.urandom(3000)
    parts = split(data, 1024)
    bad = bytearray(parts[1])
    bad[-1] ^= 0xFF
    r = Reassembler()
    assert feed_all(r, "t", [parts[0], bytes(bad), *parts[2:]]) == []
    assert r.pending == 0 and r.reserved == 0 and r.dropped == 1


def test_inconsistent_headers_rejected() -> None:
    data = os.urandom(3000)
    parts = split(data, 1024)
    r = Reassembler()
    assert r.feed("t", parts[0][:-1]) is None  # truncated chunk
    forged = chunking._HEAD.pack(MAGIC, b"\0" * 16, 5, 3, 982, 3000, 0, 0) + b"x" * 982  # index >= count
    assert r.feed("t", forged) is None
    assert r.pending == 0 and r.dropped == 2


def test_max_chunk_must_exceed_header() -> None:
    with pytest.raises(ValueError):
        split(b"x" * 100, HEADER_BYTES)


# ------------------------------------------------------------------ memory before trust (issue 13)
def _trusts() -> tuple[Trust, Trust, Trust]:
    """The cell c0 (receiver), its device c0-d0, and an intruder claiming to be c0-d0."""
    from protocols.config import TopologySection
    from protocols.wire.keys import Trust, generate_keys, new_seed

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=1))
    return (
        Trust("c0", ring.private["c0"], ring.public),
        Trust("c0-d0", ring.private["c0-d0"], ring.public),
        Trust("c0-d0", new_seed(), ring.public),
    )


def test_signed_chunks_round_trip_and_bind_the_topic() -> None:
    cell, device, _ = _trusts()
    data = os.urandom(10_000)
    parts = split(data, 1024, topic="t/result", auth=device)
    assert all(len(p) <= 1024 for p in parts) and len(parts) > 1
    assert feed_all(Reassembler(auth=cell), "t/result", parts) == [data]
    r = Reassembler(auth=cell)  # the same chunks replayed on another topic: every one refused
    assert feed_all(r, "t/other", parts) == [] and r.pending == 0 and r.dropped == len(parts)


def test_bogus_chunks_are_dropped_one_by_one_and_the_genuine_set_completes() -> None:
    """An intruder who saw the first genuine chunk injects a bogus copy of every other index (same
    content id) before the genuine ones arrive: signed, each bogus chunk is refused on its own and the
    genuine message is delivered; unsigned (the control), the genuine set is lost."""
    cell, device, intruder = _trusts()
    data = os.urandom(10_000)
    genuine = split(data, 1024, topic="t", auth=device)
    bogus = [
        chunking._HEAD.pack(*chunking._HEAD.unpack_from(p)[:6], 5, 64)
        + b"c0-d0"
        + os.urandom(64)
        + os.urandom(len(p) - chunking.HEADER_BYTES - 5 - 64)
        for p in genuine[1:]
    ]
    forged = split(os.urandom(10_000), 1024, topic="t", auth=intruder)  # validly framed, a key of its own
    r = Reassembler(auth=cell)
    assert feed_all(r, "t", [genuine[0], *bogus, *forged, *genuine[1:]]) == [data]
    assert r.dropped == len(bogus) + len(forged) and r.pending == 0 and r.reserved == 0
    plain = split(data, 1024)
    r = Reassembler()
    fake = [
        chunking._HEAD.pack(*chunking._HEAD.unpack_from(p)[:8]) + os.urandom(len(p) - chunking.HEADER_BYTES)
        for p in plain[1:]
    ]
    assert feed_all(r, "t", [plain[0], *fake, *plain[1:]]) == []  # without signatures: lost


def test_a_tiny_header_announcing_500_mb_reserves_nothing() -> None:
    """The 43-byte chunk (header + 1 byte) that once made a receiver allocate 500 MB: refused by size
    at once, and even a bound-respecting announcement holds only the bytes that arrived."""
    total = 500 * 1024 * 1024
    tiny = chunking._HEAD.pack(MAGIC, b"\1" * 16, 0, total, 1, total, 0, 0) + b"x"
    r = Reassembler(max_message=1_000_000)
    assert r.feed("t", tiny) is None and r.reserved == 0 and r.pending == 0
    ok = chunking._HEAD.pack(MAGIC, b"\2" * 16, 0, 900_000, 1, 900_000, 0, 0) + b"x"
    assert r.feed("t", ok) is None and r.reserved == 1 and r.pending == 1
    assert r.feed("t", os.urandom(1_000_001)) is None  # an unchunked payload over the bound, by size first
    assert r.feed("t", b"small") == b"small"


def test_per_sender_bound_before_authentication() -> None:
    """One sender cannot hold more than its share of incomplete messages; others are unaffected."""
    r = Reassembler(max_message=5000, max_bytes=100_000)
    one = [split(os.urandom(5000), 1024) for _ in range(4)]
    for parts in one:  # four incomplete messages from the same (unauthenticated) sender ""
        feed_all(r, "t", parts[:-1])
    assert r.reserved <= r.max_per_sender == 10_000
    fake_auth = type("Named", (), {"node": "x", "sign": lambda self, data: b"s" * 64})()
    other = os.urandom(5000)
    assert feed_all(r, "t", split(other, 1024, auth=fake_auth)) == [other]  # sender x is not held back


def test_sets_of_a_byte_each_cannot_hold_more_memory_than_the_bounds_allow() -> None:
    """A sender announcing sets it never completes, each of a one-byte chunk: its receiver keeps a record per set
    (~670 bytes), so the bounds count what a set and a chunk cost, not their data alone. Before, 5,000 such sets
    were held (5 KB of data counted, ~3.3 MB kept: 33 times the 100 KB a sender may hold)."""
    import tracemalloc

    r = Reassembler(max_message=50_000)
    tracemalloc.start()
    try:
        for _ in range(5000):
            r.feed("t", chunking._HEAD.pack(MAGIC, os.urandom(16), 0, 1000, 1, 1000, 0, 0) + b"x")
        here = tracemalloc.Filter(True, chunking.__file__)  # what the reassembler keeps (not the logs pytest keeps)
        kept = sum(t.size for t in tracemalloc.take_snapshot().filter_traces([here]).traces)
    finally:
        tracemalloc.stop()
    assert r.cost <= r.max_per_sender == 100_000 and r.pending <= 100_000 // chunking.SET_COST
    assert kept < 2 * r.max_per_sender, kept


def test_a_credentialed_sender_cannot_evict_another_senders_set_while_it_holds_more() -> None:
    """Signed chunks, each sender's own key: c0-d0 announces sets it never completes while c0-d1's result is in
    progress. Room is made from the sender holding the most, so c0-d0 evicts its own sets, and c0-d1's result is
    delivered (before: the oldest set went first, c0-d1's, and its result was lost)."""
    from protocols.config import TopologySection
    from protocols.wire.keys import generate_keys

    ring = generate_keys(TopologySection(cells=1, devices_per_cell=2))
    cell, liar, honest = (Trust(n, ring.private[n], ring.public) for n in ("c0", "c0-d0", "c0-d1"))
    r = Reassembler(auth=cell, max_message=5000, max_bytes=12_000)
    result = os.urandom(5000)
    parts = split(result, 1024, topic="t", auth=honest)
    assert feed_all(r, "t", parts[:-1]) == []
    for _ in range(3):
        feed_all(r, "t", split(os.urandom(5000), 1024, topic="t", auth=liar)[:-1])
        assert r.cost <= r.max_bytes
    assert r.dropped >= 1 and r.feed("t", parts[-1]) == result
