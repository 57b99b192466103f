"""Sending and receiving fedtier messages over a transport: framing, signatures, validation,
de-duplication.

Every runtime talks through one :class:`Messenger`, so each message is encoded and checked in one
place. A message that fails any check is logged with its kind and reason and reported to ``on_reject``;
it never reaches a role.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..rejections import RejectKind
from ..transport.base import Transport
from .dedup import SeenIds
from .envelope import (
    DEFAULT_MAX_PAYLOAD,
    Header,
    MessageKind,
    Segments,
    SharedPayload,
    WireError,
    decode_message,
    envelope_head,
    join_message,
    new_msg_id,
    payload_digest,
    verify_signature,
)
from .payload import (
    Parts,
    Payload,
    aligned_start,
    checked_in_place,
    decode_payload,
    own_views,
    parts_size,
    payload_parts,
)
from .ratelog import RateLimitedLog

if TYPE_CHECKING:
    from .keys import Trust

log = logging.getLogger("fedtier.wire")


class Received(NamedTuple):
    """A payload's encoded bytes as they arrived: ``message[start:]``, in an immutable message (a process that
    hands the payload on sends these bytes instead of encoding it again)."""

    message: bytes
    start: int

    @property
    def nbytes(self) -> int:
        return len(self.message) - self.start

    def view(self) -> memoryview:
        return memoryview(self.message)[self.start :]

    def same(self, other: Received) -> bool:
        """Whether both hold the same payload bytes (one ``memcmp``; none for the same bytes, e.g. a shared payload
        two messages carry)."""
        if self.message is other.message and self.start == other.start:
            return True
        return self.nbytes == other.nbytes and self.message.startswith(other.view(), self.start)


@dataclass(frozen=True)
class Incoming:
    """A decoded, validated message and its size on the wire; ``received``: its payload's bytes, where the
    message is ``bytes`` (immutable)."""

    topic: str
    header: Header
    payload: Payload
    nbytes: int
    received: Received | None = None
    repeat: bool = False  # handled before (``Messenger.receive`` hands it again only when asked: ``repeats``)
    digest: bytes | None = None  # its payload's sha256, where its signature check computed it (hashed once)


class Messenger:
    """Frames payloads into envelopes for ``transport`` and validates what arrives.

    With ``trust`` (the node's Ed25519 identity and its peers' public keys) every message sent is
    signed for its topic and stamped with :attr:`session` (the cloud session it belongs to), and every
    message received must carry a valid signature of a known peer for the topic it arrived on; its
    chunks are signed and verified too (``Transport.configure_wire``). ``max_payload`` bounds one
    incoming message (``runtime.max_message_bytes``). Message ids are remembered per session, so a
    message is handled once.
    """

    def __init__(
        self,
        transport: Transport,
        run: str,
        sender: str,
        *,
        trust: Trust | None = None,
        max_payload: int | None = None,
        on_reject: Callable[[str, RejectKind, str, str | None], None] | None = None,
    ) -> None:
        self.transport, self.run, self.sender = transport, run, sender
        self.trust, self.max_payload = trust, max_payload or DEFAULT_MAX_PAYLOAD
        self.on_reject = on_reject
        self.session: str | None = None
        self.seen = SeenIds()
        self._log = RateLimitedLog(log)
        self._encoded: dict[int, tuple[Payload, Parts, int]] = {}
        self._shared: tuple[Parts, SharedPayload] | None = None  # the last payload's bytes, made for Segments
        self._bound = max_payload
        self.attach(transport)

    def attach(self, transport: Transport) -> None:
        """Send and receive on ``transport`` from now on (a node's new connection), with this
        messenger's chunk signing and message bound configured on it."""
        self.transport = transport
        if self.trust is not None or self._bound is not None:
            transport.configure_wire(auth=self.trust, max_message_bytes=self._bound)

    @property
    def signed(self) -> bool:
        return self.trust is not None

    def frame(
        self,
        kind: MessageKind,
        payload: Payload,
        *,
        round: int,
        edge_round: int = 0,
        cell: str | None = None,
        topic: str = "",
    ) -> bytes:
        """Encode a payload into a complete message for ``topic`` (not sent). Its payload's bytes in it are then
        shared by the next messages of the same payload object that :meth:`send` frames as segments."""
        parts, size = self._payload_bytes(payload)
        header = self._header(kind, size, round, edge_round, cell)
        sign = self.trust.sign if self.trust is not None else None
        digest = payload_digest(parts) if sign is not None else None  # (kept with the bytes: hashed once)
        message = join_message(envelope_head(header, parts, sign, topic, digest), parts)
        if self._encoded.get(id(payload), (None,))[0] is payload:
            self._shared = (parts, SharedPayload(message, len(message) - size, digest))
        return message

    def frame_once(
        self,
        kind: MessageKind,
        payload: Payload,
        *,
        round: int,
        edge_round: int = 0,
        cell: str | None = None,
        topic: str = "",
    ) -> bytes | memoryview:
        """:meth:`frame` for a payload sent once (a device's result): its encoding is not kept for a next message
        (nor its arrays alive with it). A payload decoded from lent bytes with room before them (a sim worker's
        result: ``Payload.headroom``), or whose tensors were made where its message will be (a device's delta,
        :class:`~protocols.wire.wire_record.WireRecord`), is framed there, in place: the same bytes as :meth:`frame`'s,
        without a copy of the payload (a read-only view of the record, kept as long as the message is)."""
        room = payload.headroom
        in_place = room.parts_of(payload) if room is not None else None  # its bytes where they are: no copy
        parts: Parts
        if in_place is not None:
            parts, size = in_place, parts_size(in_place)
            self._encoded, self._shared = {}, None  # (as _payload_bytes without keep)
        else:
            parts, size = self._payload_bytes(payload, keep=False)
        header = self._header(kind, size, round, edge_round, cell)
        head = envelope_head(header, parts, self.trust.sign if self.trust is not None else None, topic)
        lent = room.frame(head, parts) if room is not None else None
        return lent if lent is not None else join_message(head, parts)

    def frame_shared(
        self,
        kind: MessageKind,
        payload: Payload,
        *,
        round: int,
        edge_round: int = 0,
        cell: str | None = None,
        topic: str = "",
    ) -> Segments:
        """:meth:`frame` as :class:`~protocols.wire.envelope.Segments`: the message's own envelope and the payload's
        bytes, made once for all the messages of the same payload object (a cell's task to each of its devices: the
        bytes of the first message :meth:`frame` made of it) and shared by them, read-only, their sha256 computed
        once for all the signatures over them. Joined, the same bytes as :meth:`frame`'s (for a transport that
        carries segments: ``Transport.takes_segments``)."""
        parts, size = self._payload_bytes(payload)
        shared = self._shared[1] if self._shared is not None and self._shared[0] is parts else None
        if shared is None:
            pad = aligned_start(parts)  # (its largest tensor's values aligned where its receivers view them)
            shared = SharedPayload(b"".join([bytes(pad), *parts]), pad)  # type: ignore[list-item]  # arrays: buffers
            self._shared = (parts, shared)
        header = self._header(kind, size, round, edge_round, cell)
        head = envelope_head(header, shared, self.trust.sign if self.trust is not None else None, topic)
        return Segments(head, shared)

    def _framed_before(self, payload: Payload) -> bool:
        """Whether ``payload``'s bytes are at hand from its last message (:meth:`frame`, :meth:`frame_shared`)."""
        cached = self._encoded.get(id(payload))
        return cached is not None and cached[0] is payload and self._shared is not None and self._shared[0] is cached[1]

    def _header(self, kind: MessageKind, size: int, round: int, edge_round: int, cell: str | None) -> Header:
        """A message's header from this node (a fresh message id; the session where messages are signed)."""
        return Header(
            run=self.run,
            kind=kind,
            round=round,
            edge_round=edge_round,
            cell=cell,
            sender=self.sender,
            msg_id=new_msg_id(),
            payload_len=size,
            session=self.session if self.trust is not None else None,
        )

    def _payload_bytes(self, payload: Payload, keep: bool = True) -> tuple[Parts, int]:
        # a role often sends one payload object to many receivers: encode it once. The parts are views
        # of the payload's arrays (a message is one copy of them); a role never changes a sent payload
        cached = self._encoded.get(id(payload))
        if cached is not None and cached[0] is payload:
            return cached[1], cached[2]
        parts = payload_parts(payload)
        size = parts_size(parts)
        self._encoded = {id(payload): (payload, parts, size)} if keep else {}
        self._shared = None
        return parts, size

    def send(
        self,
        topic: str,
        kind: MessageKind,
        payload: Payload,
        *,
        round: int,
        edge_round: int = 0,
        cell: str | None = None,
        retain: bool = False,
        shared: bool = False,
    ) -> int:
        """Frame and publish; returns the bytes published. A payload sent again (a cell's task to each of its devices)
        goes as :class:`~protocols.wire.envelope.Segments` where the transport carries them: its bytes are those of
        its first message (:meth:`frame`), shared, not a copy in each message. ``shared`` (a payload for many
        receivers): its first message too (:meth:`frame_shared`), so that all its receivers read one decoding of
        it, of bytes that align its largest tensor's values for their reads."""
        segments = self.transport.takes_segments and (shared or self._framed_before(payload))
        how = self.frame_shared if segments else self.frame
        data = how(kind, payload, round=round, edge_round=edge_round, cell=cell, topic=topic)
        self.transport.publish(topic, data, qos=1, retain=retain)
        return len(data)

    def receive(
        self, topic: str, data: bytes | Segments, *, kinds: tuple[str, ...] | None = None, repeats: bool = False
    ) -> Incoming | None:
        """Decode and validate; ``None`` (after logging) for a rejected message or a duplicate (with ``repeats``:
        the duplicate, valid, marked ``repeat``, for a caller that learns from a peer repeating itself). The
        payload's tensors are read-only views of ``data`` where it is ``bytes`` (copy what you change), or of its
        shared payload where it is :class:`~protocols.wire.envelope.Segments` (the same views every receiver of it
        reads: nobody can change them)."""
        if isinstance(data, Segments):
            return self._receive_segments(topic, data, kinds, repeats)
        try:
            header, raw, digest = self._accepted(topic, data, kinds)
            repeat = not self.seen.first_time(f"{header.session}/{header.msg_id}")
            if repeat and not repeats:
                log.debug("duplicate %s from %s dropped", header.msg_id, header.sender)
                return None
            known = checked_in_place(data)  # (a sim worker's result: its floats were checked as it was decoded)
            payload = decode_payload(raw, require_finite=not known, views=True, checked=known)  # views: no copy
        except WireError as exc:
            self.reject(topic, exc.kind, str(exc), None)
            return None
        received = Received(data, len(data) - raw.nbytes) if type(data) is bytes else None  # raw: data's tail
        return Incoming(topic, header, payload, len(data), received, repeat, digest)

    def _receive_segments(
        self, topic: str, data: Segments, kinds: tuple[str, ...] | None, repeats: bool
    ) -> Incoming | None:
        """:meth:`receive` of a message as segments: the same checks, the payload read where it is shared (its
        digest computed once for every signature over it; its floats checked by its first receiver only: they
        never change)."""
        shared = data.body
        try:
            header, _, digest = self._accepted(topic, data, kinds)
            repeat = not self.seen.first_time(f"{header.session}/{header.msg_id}")
            if repeat and not repeats:
                log.debug("duplicate %s from %s dropped", header.msg_id, header.sender)
                return None
            payload = _decoded(shared)
        except WireError as exc:
            self.reject(topic, exc.kind, str(exc), None)
            return None
        return Incoming(topic, header, payload, len(data), Received(shared.data, shared.start), repeat, digest)

    def authentic(self, topic: str, data: bytes | Segments, kinds: tuple[str, ...] | None = None) -> Header:
        """``data``'s header once :meth:`receive` would accept it (well formed, of this run, of ``kinds``, signed by a
        known peer where messages are signed), its payload not decoded and the message not taken as seen (a caller
        deciding whose it is before it handles it later); :class:`WireError` otherwise."""
        return self._accepted(topic, data, kinds)[0]

    def _accepted(
        self, topic: str, data: bytes | Segments, kinds: tuple[str, ...] | None
    ) -> tuple[Header, memoryview, bytes | None]:
        """``data``'s header and payload once the message is valid for this node: well formed, of this run, of
        ``kinds``, signed by a known peer where messages are signed (:class:`WireError` otherwise); and the payload's
        sha256 where its signature was checked (``None`` unsigned)."""
        header, raw = decode_message(data, max_payload=self.max_payload)
        if header.run != self.run:
            raise WireError(RejectKind.WRONG_SENDER, f"message for run {header.run!r}, this is run {self.run!r}")
        if kinds is not None and header.kind not in kinds:
            raise WireError(RejectKind.MALFORMED, f"unexpected message kind {header.kind!r} on {topic}")
        if self.trust is None:
            return header, raw, None
        self.trust.require(header.sender)  # unknown, or revoked
        signed = data.body if isinstance(data, Segments) else raw
        digest = payload_digest(signed)  # (a shared payload's: computed once)
        verify_signature(header, signed, topic, self.trust.verify, digest)
        return header, raw, digest

    def forget(self, header: Header) -> None:
        """Take ``header``'s message as new when it comes again (:meth:`receive` drops a repeat): one refused for
        its timing alone, which its sender sends again, the same bytes, once the time is right."""
        self.seen.forget(f"{header.session}/{header.msg_id}")

    def reject(self, topic: str, kind: RejectKind, reason: str, sender: str | None) -> None:
        """Log a rejected message and tell the owner (who records it, with its kind, in its aggregation log)."""
        self._log.warning("%s rejected a message on %s (%s): %s", self.sender, topic, kind.value, reason)
        if self.on_reject is not None:
            self.on_reject(topic, kind, reason, sender)


def _decoded(shared: SharedPayload) -> Payload:
    """A receiver's payload of ``shared``: decoded (its floats checked) by its first receiver in this process, kept,
    and for each receiver (a cell's task to each of its devices) read-only views of the shared bytes of its own (the
    decoding's, :func:`~protocols.wire.payload.own_views`: a receiver that reshapes its arrays in place changes no
    other's) and a copy of the metadata as decoded, the same bytes not parsed and checked again (:class:`WireError`
    as the first got)."""
    first = shared.decoded
    if first is None:
        first = decode_payload(shared.view(), require_finite=not shared.finite, views=True, checked=shared.finite)
        shared.finite = True
        shared.decoded = first
    return Payload(copy.deepcopy(first.meta), own_views(first.tensors))
