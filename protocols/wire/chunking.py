"""Chunking: split a large message into small framed pieces and reassemble them safely.

A chunk is ``MAGIC | content id (16) | u32 index | u32 count | u32 chunk size | u64 total | data``
(little-endian, 40-byte header). The content id is the first 16 bytes of the sha256 of the whole
message, so reassembly is content-addressed: a duplicate chunk, or the same chunked message
delivered twice, is harmless. Pure code: no sockets, no threads; time comes from a clock function.
"""
from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

MAGIC = b"FTC1"
_HEAD = struct.Struct("<4s16sIIIQ")
HEADER_BYTES = _HEAD.size  # 40
DEFAULT_MAX_CHUNK = 256 * 1024
DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_BYTES = 512 * 1024 * 1024

log = logging.getLogger(__name__)


def content_id(data: bytes | memoryview) -> bytes:
    """The 16-byte content id of a whole message."""
    return hashlib.sha256(data).digest()[:16]


def is_chunk(data: bytes | memoryview) -> bool:
    return len(data) >= HEADER_BYTES and bytes(data[:4]) == MAGIC


def split(data: bytes, max_chunk: int = DEFAULT_MAX_CHUNK) -> list[bytes]:
    """Return ``[data]`` when it fits in ``max_chunk`` bytes, else framed chunks of at most that size.

    A small message that happens to start with the chunk magic is framed as a one-chunk set, so a
    receiver can never mistake it for a chunk.
    """
    if max_chunk <= HEADER_BYTES:
        raise ValueError(f"max_chunk must exceed the {HEADER_BYTES}-byte chunk header")
    if len(data) <= max_chunk and not data[:4] == MAGIC:
        return [data]
    size = max_chunk - HEADER_BYTES
    count = max(1, -(-len(data) // size))
    if count > 0xFFFFFFFF:
        raise ValueError("message too large to chunk")
    cid = content_id(data)
    view = memoryview(data)
    return [
        _HEAD.pack(MAGIC, cid, i, count, size, len(data)) + view[i * size : (i + 1) * size]
        for i in range(count)
    ]


@dataclass
class _Pending:
    total: int
    count: int
    size: int
    buf: bytearray
    have: set[int] = field(default_factory=set)
    started: float = 0.0
    last: float = 0.0


class Reassembler:
    """Collects chunks per ``(key, content id)`` and returns whole messages.

    ``feed(key, data)`` returns ``data`` itself for an unchunked message, the whole message when the
    last missing chunk arrives (after verifying its sha256), and ``None`` otherwise. Incomplete sets
    are dropped ``timeout`` seconds after their last chunk; the bytes reserved by incomplete sets never
    exceed ``max_bytes`` (the oldest sets are evicted to make room; a set larger than the bound is
    rejected). A completed content id is remembered for ``timeout`` seconds, so its late duplicate
    chunks are ignored instead of starting a new set. Not thread-safe: guard it with a lock.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
        max_recent: int = 4096,
    ) -> None:
        self.timeout, self.max_bytes, self.clock, self.max_recent = timeout, max_bytes, clock, max_recent
        self._pending: OrderedDict[tuple[str, bytes], _Pending] = OrderedDict()  # oldest activity first
        self._recent: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # completed -> when
        self.reserved = 0
        self.dropped = 0  # sets dropped (timeout, eviction, bad hash, rejected)

    @property
    def pending(self) -> int:
        """Number of incomplete sets."""
        return len(self._pending)

    def feed(self, key: str, data: bytes) -> bytes | None:
        if not is_chunk(data):
            return data
        now = self.clock()
        self.expire(now)
        magic, cid, index, count, size, total = _HEAD.unpack_from(data)
        body = memoryview(data)[HEADER_BYTES:]
        ident = (key, cid)
        if ident in self._recent:
            return None  # a late duplicate of a message already delivered
        if size == 0 or count != max(1, -(-total // size)) or index >= count:
            return self._reject(key, f"inconsistent chunk header (index {index}, count {count}, size {size}, total {total})")
        want = min(size, total - index * size)
        if len(body) != want:
            return self._reject(key, f"chunk {index}/{count} has {len(body)} bytes, expected {want}")
        p = self._pending.get(ident)
        if p is None:
            if total > self.max_bytes:
                return self._reject(key, f"message of {total} bytes exceeds the reassembly bound of {self.max_bytes}")
            self._make_room(total)
            p = _Pending(total, count, size, bytearray(total), started=now)
            self._pending[ident] = p
            self.reserved += total
        elif (p.total, p.count, p.size) != (total, count, size):
            return self._reject(key, "chunk header disagrees with earlier chunks of the same content")
        p.last = now
        self._pending.move_to_end(ident)
        if index in p.have:
            return None  # duplicate chunk
        p.buf[index * size : index * size + want] = body
        p.have.add(index)
        if len(p.have) < p.count:
            return None
        del self._pending[ident]
        self.reserved -= p.total
        whole = bytes(p.buf)
        if content_id(whole) != cid:
            self.dropped += 1
            log.warning("dropping reassembled message on %s: sha256 does not match its content id", key)
            return None
        self._recent[ident] = now
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)
        return whole

    def expire(self, now: float | None = None) -> int:
        """Drop incomplete sets idle for ``timeout`` seconds; return how many were dropped."""
        now = self.clock() if now is None else now
        dropped = 0
        while self._pending:
            ident, p = next(iter(self._pending.items()))
            if now - p.last < self.timeout:
                break
            self._drop(ident, f"incomplete after {self.timeout:g} s ({len(p.have)}/{p.count} chunks)")
            dropped += 1
        while self._recent:
            ident, when = next(iter(self._recent.items()))
            if now - when < self.timeout:
                break
            del self._recent[ident]
        return dropped

    def _make_room(self, total: int) -> None:
        while self._pending and self.reserved + total > self.max_bytes:
            ident = next(iter(self._pending))
            self._drop(ident, f"evicted to stay within the reassembly bound of {self.max_bytes} bytes")

    def _drop(self, ident: tuple[str, bytes], reason: str) -> None:
        p = self._pending.pop(ident)
        self.reserved -= p.total
        self.dropped += 1
        log.warning("dropping chunked message %s on %s: %s", ident[1].hex(), ident[0], reason)

    def _reject(self, key: str, reason: str) -> None:
        self.dropped += 1
        log.warning("rejecting chunk on %s: %s", key, reason)
        return None
