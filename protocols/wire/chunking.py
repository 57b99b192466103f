"""Chunking: split a large message into small framed pieces and reassemble them safely.

A chunk is ``MAGIC | content id (16) | u32 index | u32 count | u32 chunk size | u64 total |
u8 sender length | u8 signature length | sender | signature | data`` (little-endian; 42 bytes plus the
sender id and, on a run with signing keys, a 64-byte Ed25519 signature). The content id is the first
16 bytes of the sha256 of the whole message, so reassembly is content-addressed: a duplicate chunk,
or the same chunked message delivered twice, is harmless.

Memory comes before trust: a receiver with a :class:`ChunkAuth` checks each chunk's signature (over
the topic, the chunk header, the sender and the data) before it keeps a byte of it, so injected bogus
chunks are dropped one by one and the genuine set still completes; a set announcing more than
``max_message`` bytes is refused at its first chunk; nothing is reserved ahead (a set holds only the
chunks that arrived, each counted with what keeping it costs: :data:`SET_COST`, :data:`CHUNK_COST`), per sender at
most ``max_per_sender`` bytes, in all at most ``max_bytes``, room made (with ``auth``) by dropping the sets of the
sender that holds the most (one sender cannot push another's sets out while it holds more). An unchunked payload
larger than ``max_message`` is refused by size before anything parses it.
Pure code: no sockets, no threads; time comes from a clock function.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from ..limits import MAX_MESSAGE_BYTES
from .ratelog import RateLimitedLog

MAGIC = b"FTC2"
_HEAD = struct.Struct("<4s16sIIIQBB")
HEADER_BYTES = _HEAD.size  # 42, plus the sender id and the signature
DEFAULT_MAX_CHUNK = 256 * 1024
DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_BYTES = MAX_MESSAGE_BYTES  # what all incomplete sets hold at most: a message bound above it is cut to it
DEFAULT_MAX_MESSAGE = 256 * 1024 * 1024
CHUNK_DOMAIN = b"fedtier/chunk/1\0"
SET_COST = 768
"""Bytes an incomplete set costs its receiver beyond its chunks' data (its record, key and index entries: ~670 on
CPython 3.11, measured): counted against the bounds, so a sender announcing many sets of a byte each cannot hold
670 times the bytes the bounds allow."""
CHUNK_COST = 128
"""Bytes a chunk held costs beyond its data (its bytes object and index entry: ~115, measured), likewise."""

log = logging.getLogger(__name__)


class ChunkAuth(Protocol):
    """Signs this node's chunks and verifies its peers' (``protocols.wire.keys.Trust``)."""

    node: str

    def sign(self, data: bytes) -> bytes: ...

    def verify(self, signer: str, data: bytes, sig: bytes) -> None: ...


def _signed(topic: str, head: bytes, sender: bytes, body: bytes | memoryview) -> bytes:
    return b"".join((CHUNK_DOMAIN, topic.encode(), b"\0", head, sender, hashlib.sha256(body).digest()))


def content_id(data: bytes | memoryview) -> bytes:
    """The 16-byte content id of a whole message."""
    return hashlib.sha256(data).digest()[:16]


def is_chunk(data: bytes | memoryview) -> bool:
    return len(data) >= HEADER_BYTES and bytes(data[:4]) == MAGIC


class ChunkSet(NamedTuple):
    """Which set a chunk belongs to: ``ident`` (topic, sender, content id) as :class:`Reassembler` keys it, its
    number of ``chunks`` and the whole message's ``total`` bytes (as the chunk's header claims them)."""

    ident: tuple[str, str, bytes]
    chunks: int
    total: int


def chunk_set(key: str, data: bytes | memoryview) -> ChunkSet | None:
    """The set of the chunk ``data`` received on ``key``; None for a message that is not a chunk or whose
    header does not parse (nothing checked: :meth:`Reassembler.feed` does)."""
    if not is_chunk(data):
        return None
    _, cid, _, count, _, total, slen, _ = _HEAD.unpack_from(data)
    try:
        sender = bytes(data[HEADER_BYTES : HEADER_BYTES + slen]).decode()
    except UnicodeDecodeError:
        return None
    return ChunkSet((key, sender, cid), count, total)


def split(
    data: bytes, max_chunk: int = DEFAULT_MAX_CHUNK, *, topic: str = "", auth: ChunkAuth | None = None
) -> list[bytes]:
    """Return ``[data]`` when it fits in ``max_chunk`` bytes, else framed chunks of at most that size,
    each carrying the sender (``auth.node``) and, with ``auth``, its signature for ``topic``.

    A small message that happens to start with the chunk magic is framed as a one-chunk set, so a
    receiver can never mistake it for a chunk.
    """
    sender = auth.node.encode() if auth is not None else b""
    if len(sender) > 255:
        raise ValueError("sender id too long for a chunk header")
    overhead = HEADER_BYTES + len(sender) + (64 if auth is not None else 0)
    if max_chunk <= overhead:
        raise ValueError(f"max_chunk must exceed the {overhead}-byte chunk header")
    if len(data) <= max_chunk and not data[:4] == MAGIC:
        return [data]
    size = max_chunk - overhead
    count = max(1, -(-len(data) // size))
    if count > 0xFFFFFFFF:
        raise ValueError("message too large to chunk")
    cid = content_id(data)
    view = memoryview(data)
    parts = []
    for i in range(count):
        body = view[i * size : (i + 1) * size]
        sig = b""
        if auth is not None:
            unsigned = _HEAD.pack(MAGIC, cid, i, count, size, len(data), len(sender), 0)
            sig = auth.sign(_signed(topic, unsigned, sender, body))
        parts.append(
            b"".join((_HEAD.pack(MAGIC, cid, i, count, size, len(data), len(sender), len(sig)), sender, sig, body))
        )
    return parts


@dataclass
class _Pending:
    total: int
    count: int
    size: int
    sender: str
    parts: dict[int, bytes] = field(default_factory=dict)
    held: int = 0  # bytes of data
    cost: int = 0  # what holding them costs (data and bookkeeping): what the bounds count
    started: float = 0.0
    last: float = 0.0


class Reassembler:
    """Collects chunks per ``(key, sender, content id)`` and returns whole messages.

    ``feed(key, data)`` (``key``: the topic) returns ``data`` itself for an unchunked message, the
    whole message when the last missing chunk arrives (after verifying its sha256), and ``None``
    otherwise. With ``auth``, every chunk must carry a valid signature of its sender for ``key``;
    a chunk that does not is dropped alone. Incomplete sets are dropped ``timeout`` seconds after
    their last chunk; what they hold (``cost``: their data, ``reserved``, and bookkeeping) never exceeds
    ``max_per_sender`` per sender nor ``max_bytes`` in all (room is made by evicting sets,
    :meth:`_make_room`; a message larger than ``max_message`` is refused at once). A completed content
    id is remembered for ``timeout`` seconds, so its late duplicate chunks are ignored instead of
    starting a new set. Not thread-safe: guard it with a lock.
    """

    def __init__(
        self,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_message: int | None = None,
        max_per_sender: int | None = None,
        auth: ChunkAuth | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_recent: int = 4096,
    ) -> None:
        self.timeout, self.max_bytes, self.clock, self.max_recent = timeout, max_bytes, clock, max_recent
        self.max_message = min(max_message or DEFAULT_MAX_MESSAGE, max_bytes)
        self.max_per_sender = max_per_sender or 2 * self.max_message
        self.auth = auth
        self._pending: OrderedDict[tuple[str, str, bytes], _Pending] = OrderedDict()  # oldest activity first
        self._recent: OrderedDict[tuple[str, str, bytes], float] = OrderedDict()  # completed -> when
        self._per_sender: dict[str, int] = {}  # sender -> the cost of its incomplete sets
        self._refused: OrderedDict[bytes, None] = OrderedDict()  # content ids refused by size: quiet after once
        self.reserved = 0  # bytes of data held by incomplete sets
        self.cost = 0  # what the incomplete sets cost, bookkeeping included (the bounds count it)
        self._log = RateLimitedLog(log)
        self.dropped = 0  # sets dropped (timeout, eviction, bad hash, rejected) and chunks refused
        self.on_drop: Callable[[tuple[str, str, bytes]], None] | None = None  # called with each set dropped

    def limit(self, max_message: int | None = None, auth: ChunkAuth | None = None) -> None:
        """Tighten the message bound and set the authenticator (a node's messenger calls this)."""
        if max_message is not None:
            self.max_message = min(max_message, self.max_bytes)
            self.max_per_sender = 2 * self.max_message
        if auth is not None:
            self.auth = auth

    @property
    def pending(self) -> int:
        """Number of incomplete sets."""
        return len(self._pending)

    def holds(self, ident: tuple[str, str, bytes]) -> bool:
        """The set ``ident`` (see :class:`ChunkSet`) is incomplete here."""
        return ident in self._pending

    def feed(self, key: str, data: bytes) -> bytes | None:
        """The whole message once ``data`` completes one, else ``None`` (see the class doc)."""
        if not is_chunk(data):
            if len(data) > self.max_message:
                self._reject(
                    key,
                    f"single message of {len(data)} bytes exceeds the bound of "
                    f"{self.max_message} (runtime.max_message_bytes)",
                )
                return None
            return data
        now = self.clock()
        self.expire(now)
        fields = _HEAD.unpack_from(data)
        _, cid, index, count, size, total, slen, glen = fields
        if total > self.max_message:
            self._refuse_size(key, cid, total)
            return None
        if HEADER_BYTES + slen + glen > len(data):
            self._reject(key, "truncated chunk header")
            return None
        try:
            sender = bytes(data[HEADER_BYTES : HEADER_BYTES + slen]).decode()
        except UnicodeDecodeError:
            self._reject(key, "chunk sender is not UTF-8")
            return None
        body = memoryview(data)[HEADER_BYTES + slen + glen :]
        if self.auth is not None and not self._signed_by_sender(self.auth, key, data, fields, sender, body):
            return None
        ident = (key, sender, cid)
        if ident in self._recent:
            return None  # a late duplicate of a message already delivered
        if size == 0 or count != max(1, -(-total // size)) or index >= count:
            self._reject(key, f"inconsistent chunk header (index {index}, count {count}, size {size}, total {total})")
            return None
        want = min(size, total - index * size)
        if len(body) != want:
            self._reject(key, f"chunk {index}/{count} has {len(body)} bytes, expected {want}")
            return None
        p = self._pending.get(ident)
        cost = want + CHUNK_COST + (SET_COST if p is None else 0)
        if p is None:
            p = _Pending(total, count, size, sender, started=now)
            self._pending[ident] = p
        elif (p.total, p.count, p.size) != (total, count, size):
            self._reject(key, "chunk header disagrees with earlier chunks of the same content")
            return None
        p.last = now
        self._pending.move_to_end(ident)
        if index in p.parts:
            return None  # duplicate chunk
        if self._per_sender.get(sender, 0) + cost > self.max_per_sender:
            self._drop(ident, f"sender {sender!r} holds more than {self.max_per_sender} bytes of incomplete messages")
            return None
        self._make_room(cost, keep=ident)
        p.parts[index] = bytes(body)
        self._hold(p, want, cost)
        if len(p.parts) < p.count:
            return None
        return self._assemble(ident, p, now)

    def _refuse_size(self, key: str, cid: bytes, total: int) -> None:
        """Refuse a chunked message larger than ``max_message`` (logged once per content id)."""
        if cid in self._refused:
            self.dropped += 1
            return
        self._refused[cid] = None
        while len(self._refused) > self.max_recent:
            self._refused.popitem(last=False)
        self._reject(
            key,
            f"chunked message of {total} bytes exceeds the bound of {self.max_message} (runtime.max_message_bytes)",
        )

    def _signed_by_sender(
        self, auth: ChunkAuth, key: str, data: bytes, fields: tuple[Any, ...], sender: str, body: memoryview
    ) -> bool:
        """The chunk ``data`` (its header ``fields``) carries ``sender``'s valid signature for ``key``; else
        it is rejected (logged, counted)."""
        magic, cid, index, count, size, total, slen, glen = fields
        if glen == 0:
            self._reject(key, f"unsigned chunk (claims sender {sender!r}) where signatures are required")
            return False
        head = _HEAD.pack(magic, cid, index, count, size, total, slen, 0)
        try:
            auth.verify(
                sender,
                _signed(key, head, data[HEADER_BYTES : HEADER_BYTES + slen], body),
                bytes(data[HEADER_BYTES + slen : HEADER_BYTES + slen + glen]),
            )
        except ValueError as exc:  # WireError
            self._reject(key, f"chunk {index}/{count} from {sender!r}: {exc}")
            return False
        return True

    def _assemble(self, ident: tuple[str, str, bytes], p: _Pending, now: float) -> bytes | None:
        """The message of the complete set ``ident``, checked against its content id (``None`` if it differs)."""
        del self._pending[ident]
        self._hold(p, -p.held, -p.cost)
        whole = b"".join(p.parts[i] for i in range(p.count))
        if content_id(whole) != ident[2]:
            self.dropped += 1
            if self.on_drop is not None:
                self.on_drop(ident)
            self._log.warning("dropping reassembled message on %s: sha256 does not match its content id", ident[0])
            return None
        self._recent[ident] = now
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)
        return whole

    def _hold(self, p: _Pending, n: int, cost: int) -> None:
        p.held, p.cost = p.held + n, p.cost + cost
        self.reserved += n
        self.cost += cost
        left = self._per_sender.get(p.sender, 0) + cost
        if left:
            self._per_sender[p.sender] = left
        else:
            self._per_sender.pop(p.sender, None)

    def expire(self, now: float | None = None) -> int:
        """Drop incomplete sets idle for ``timeout`` seconds; return how many were dropped."""
        now = self.clock() if now is None else now
        dropped = 0
        while self._pending:
            ident, p = next(iter(self._pending.items()))
            if now - p.last < self.timeout:
                break
            self._drop(ident, f"incomplete after {self.timeout:g} s ({len(p.parts)}/{p.count} chunks)")
            dropped += 1
        while self._recent:
            ident, when = next(iter(self._recent.items()))
            if now - when < self.timeout:
                break
            del self._recent[ident]
        return dropped

    def _make_room(self, n: int, keep: tuple[str, str, bytes]) -> None:
        """Drop sets until ``n`` more fit within ``max_bytes`` (never ``keep``, the set taking them): with ``auth``, the
        oldest of the sender holding the most (``keep``'s sender counting ``n``; at a tie, it), so a sender holding
        more than another never pushes that one's sets out (a node with valid credentials announcing sets it never
        completes evicts its own first, not an honest node's large result in progress); without, where a sender is
        anyone's claim, the oldest set."""
        while self.cost + n > self.max_bytes:
            ident = self._victim(n, keep) if self.auth is not None else next(iter(self._others(keep)), None)
            if ident is None:
                break
            self._drop(ident, f"evicted to stay within the reassembly bound of {self.max_bytes} bytes")

    def _victim(self, n: int, keep: tuple[str, str, bytes]) -> tuple[str, str, bytes] | None:
        """:meth:`_make_room`'s choice with ``auth`` (its senders are verified: as many as the nodes sending chunks)."""
        newcomer = keep[1]

        def holds(sender: str) -> tuple[int, bool]:
            return self._per_sender.get(sender, 0) + (n if sender == newcomer else 0), sender == newcomer

        for sender in sorted({*self._per_sender, newcomer}, key=holds, reverse=True):
            ident = next((i for i in self._others(keep) if i[1] == sender), None)  # its oldest (activity order)
            if ident is not None:
                return ident
        return None

    def _others(self, keep: tuple[str, str, bytes]) -> Iterator[tuple[str, str, bytes]]:
        """The incomplete sets but ``keep``, oldest activity first."""
        return (i for i in self._pending if i != keep)

    def _drop(self, ident: tuple[str, str, bytes], reason: str) -> None:
        p = self._pending.pop(ident)
        self._hold(p, -p.held, -p.cost)
        self.dropped += 1
        if self.on_drop is not None:
            self.on_drop(ident)
        self._log.warning("dropping chunked message %s from %r on %s: %s", ident[2].hex(), ident[1], ident[0], reason)

    def _reject(self, key: str, reason: str) -> None:
        self.dropped += 1
        self._log.warning("rejecting message on %s: %s", key, reason)
        return None
