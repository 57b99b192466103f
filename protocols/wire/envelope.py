"""Message envelope: ``MAGIC | u32 header length | header JSON | payload``.

The header is small and validated with pydantic before anything reads the payload; the payload is
opaque bytes here (see ``payload.py`` for the tensor codec). Nothing is ever pickled.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..rejections import Refusal, RejectKind

MAGIC = b"FTW1"
MAX_HEADER_BYTES = 16 * 1024
DEFAULT_MAX_PAYLOAD = 256 * 1024 * 1024

MessageKind = Literal[
    "cell_task",  # cloud -> cell: what to do this cloud round
    "device_task",  # cell -> device: what to do this edge round
    "device_result",  # device -> cell
    "cell_report",  # cell -> cloud
    "status",  # liveness (birth / will / heartbeat)
    "telemetry",  # aggregation records
    "control",  # run-level control (e.g. run finished)
    "chunk",  # a piece of a larger message
    "secagg_keys",  # device -> cell: secure aggregation (protocols/privacy/secagg/), on the result topic
    "secagg_roster",  # cell -> device, on its task topic
    "secagg_shares",  # device -> cell
    "secagg_routed",  # cell -> device
    "secagg_unmask",  # cell -> device
    "secagg_consent",  # device -> cell: the consistency round (its signed view)
    "secagg_views",  # cell -> device: its neighbours' signed views
    "secagg_reveal",  # device -> cell
]


class WireError(Refusal):
    """A message that cannot be accepted: ``kind`` says what was wrong, the text says why. Receivers log it
    and drop the message."""


class Header(BaseModel):
    """Validated envelope header; ``cell`` names the cell the message is about.

    On the wire the header is compact JSON: one-letter keys (the field aliases) and fields at their
    default left out, e.g. ``{"r":"quickstart","k":"device_result","n":3,"e":1,"c":"c0","s":"c0-d1",
    "i":"9f2c51d07a3e4b18","l":51054}`` (about 100 bytes). Code uses the descriptive names.
    """

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    v: Literal[1] = 1
    run: str = Field(min_length=1, max_length=128, alias="r")
    kind: MessageKind = Field(alias="k")
    round: int = Field(ge=0, alias="n")
    edge_round: int = Field(default=0, ge=0, alias="e")
    cell: str | None = Field(default=None, max_length=128, alias="c")
    sender: str = Field(min_length=1, max_length=128, alias="s")
    msg_id: str = Field(min_length=1, max_length=64, alias="i")
    codec: str = Field(default="tensors/v1", max_length=32, alias="x")
    payload_len: int = Field(ge=0, alias="l")
    session: str | None = Field(default=None, max_length=64, alias="z")
    sig: str | None = Field(default=None, max_length=128, alias="g")

    def to_json(self) -> bytes:
        """The wire form (aliases, defaults omitted)."""
        return self.model_dump_json(exclude_defaults=True).encode()


def new_msg_id() -> str:
    """A fresh message id: 64 random bits as 16 hex digits (fixed length, so byte counts do not
    depend on it)."""
    return os.urandom(8).hex()  # (uuid4 reads the same source, with 5x the Python around it)


Signer = Callable[[bytes], bytes]
"""``data -> signature`` (a node's :class:`protocols.wire.keys.Trust`.sign)."""
Verifier = Callable[[str, bytes, bytes], None]
"""``(signer, data, signature)``; raises :class:`WireError` on a bad one (``Trust.verify``)."""
SIGNED_DOMAIN = b"fedtier/msg/1\0"


Buffers = Sequence[Any]
"""A payload as buffers in order (``bytes`` or byte arrays, e.g. :func:`~protocols.wire.payload.payload_parts`)."""


class SharedPayload:
    """A payload's encoded bytes made once for every message that carries them (a cell's task to each device of an
    edge round, ``Messenger.send``): ``data[start:]``, in immutable ``bytes`` (the first such message's, or the
    payload's own), their sha256 computed at most once (for all the messages signed over them, and all the
    signatures checked over them) and, once a receiver of this process checked their floats finite, not read for it
    again (``finite``: set by ``Messenger.receive`` only)."""

    __slots__ = ("data", "start", "_digest", "finite", "decoded")

    def __init__(self, data: bytes, start: int = 0, digest: bytes | None = None) -> None:
        """``digest``: the sha256 of ``data[start:]`` where the framing that made ``data`` computed it already."""
        if type(data) is not bytes:  # the one guarantee receivers rely on: nobody can change them
            raise TypeError(f"a shared payload is immutable bytes, not {type(data).__name__}")
        if not 0 <= start <= len(data):
            raise ValueError(f"a shared payload starts within its {len(data)} bytes, not at {start}")
        self.data, self.start = data, start
        self._digest = digest
        self.finite = False
        self.decoded: Any = None  # its first receiver's decoding (a Payload), as decoded: Messenger.receive's

    def __len__(self) -> int:
        return len(self.data) - self.start

    def view(self) -> memoryview:
        """The payload's bytes, read-only."""
        return memoryview(self.data)[self.start :]

    def digest(self) -> bytes:
        """sha256 of the bytes (computed at the first call: the bytes never change)."""
        if self._digest is None:
            self._digest = hashlib.sha256(self.view()).digest()
        return self._digest


class Segments:
    """A message as its two segments: its own envelope ``head`` (:func:`envelope_head`) and a :class:`SharedPayload`
    that other messages carry too. Its bytes are ``head + payload``, the message :func:`encode_message` makes, never
    joined where the in-memory transport carries it (its receivers decode the segments: :func:`decode_message`); a
    socket that needs one buffer joins them (``bytes(message)``)."""

    __slots__ = ("head", "body")

    def __init__(self, head: bytes, body: SharedPayload) -> None:
        if type(head) is not bytes or type(body) is not SharedPayload:  # both immutable: receivers share them
            raise TypeError("a message's segments are its envelope's bytes and a SharedPayload")
        self.head, self.body = head, body

    def __len__(self) -> int:
        return len(self.head) + len(self.body)

    def __bytes__(self) -> bytes:
        return b"".join((self.head, self.body.view()))


def payload_digest(payload: bytes | memoryview | Buffers | SharedPayload) -> bytes:
    """The sha256 of a payload (its bytes, its buffers in order, or shared) that a signature covers."""
    if isinstance(payload, SharedPayload):
        return payload.digest()
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return hashlib.sha256(payload).digest()
    h = hashlib.sha256()
    for part in cast(Buffers, payload):  # its parts (bytes returned above), not a bytes' ints
        h.update(part)
    return h.digest()


def _nbytes(payload: bytes | memoryview | Buffers | SharedPayload) -> int:
    if isinstance(payload, SharedPayload):
        return len(payload)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).nbytes
    return sum(len(p) if type(p) is bytes else memoryview(p).nbytes for p in cast(Buffers, payload))


def signed_bytes(
    topic: str, header_wo_sig: bytes, payload: bytes | memoryview | Buffers | SharedPayload, digest: bytes | None = None
) -> bytes:
    """What a message signature covers: the topic it is published on, the header (run, session, kind,
    round, edge round, cell, sender, message id, payload length) and the payload's sha256 (``payload``
    as bytes, as its buffers in order, or shared: the same digest; ``digest``: it, computed already)."""
    return b"".join((SIGNED_DOMAIN, topic.encode(), b"\0", header_wo_sig, digest or payload_digest(payload)))


def encode_sig(sig: bytes) -> str:
    return base64.urlsafe_b64encode(sig).rstrip(b"=").decode()


def decode_sig(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise WireError(RejectKind.SIGNATURE, "malformed signature") from None


def envelope_head(
    header: Header,
    payload: bytes | Buffers | SharedPayload,
    sign: Signer | None = None,
    topic: str = "",
    digest: bytes | None = None,
) -> bytes:
    """A message's bytes before its payload: ``MAGIC | u32 header length | header JSON``, with ``header``'s
    ``payload_len`` set here; signed for ``topic`` when ``sign`` is given (``payload`` as in :func:`encode_message`).
    The one encoder of the envelope: :func:`encode_message` joins the payload behind it, a lent payload with room
    before it takes it in place (:class:`~protocols.wire.payload.Headroom`). ``digest``: :func:`payload_digest` of
    ``payload`` where the caller computed it already."""
    size = _nbytes(payload)
    if header.payload_len != size or header.sig is not None:  # (a header made for this payload is kept)
        header = header.model_copy(update={"payload_len": size, "sig": None})
    if sign is not None:
        header = header.model_copy(
            update={"sig": encode_sig(sign(signed_bytes(topic, header.to_json(), payload, digest)))}
        )
    head = header.to_json()
    return b"".join((MAGIC, struct.pack("<I", len(head)), head))


ENVELOPE_ROOM = 1024
"""Bytes that fit any envelope of ASCII names (:func:`envelope_head`; 823 at most, every field at its longest):
the room a sim worker leaves before a result for its message (``sim/result_ring.py``)."""


def join_message(head: bytes, payload: bytes | Buffers) -> bytes:
    """``head`` (:func:`envelope_head`) and ``payload`` (its bytes or its buffers in order) as one message: one copy
    of the payload's bytes."""
    body = (payload,) if isinstance(payload, (bytes, bytearray, memoryview)) else tuple(payload)
    return b"".join((head, *body))


def encode_message(header: Header, payload: bytes | Buffers, sign: Signer | None = None, topic: str = "") -> bytes:
    """Frame ``payload`` behind ``header`` (its ``payload_len`` is set here); signed for ``topic``
    when ``sign`` is given. ``payload``: its bytes, or its buffers in order
    (:func:`~protocols.wire.payload.payload_parts`), joined here with the header: the message then
    costs one copy of the tensors' data."""
    return join_message(envelope_head(header, payload, sign, topic), payload)


def decode_message(data: bytes | Segments, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[Header, memoryview]:
    """Parse and validate a framed message (not its signature); raise :class:`WireError` on anything
    malformed or larger than ``max_payload``. A message as :class:`Segments` is read where its segments are (the
    payload a read-only view of the shared bytes), as its joined bytes would be: its head is exactly the envelope."""
    if isinstance(data, Segments):
        header, payload = _decode_segments(data, max_payload)
    else:
        header, payload = _decode_joined(data, max_payload)
    if len(payload) != header.payload_len:
        raise WireError(RejectKind.MALFORMED, f"payload is {len(payload)} bytes, header says {header.payload_len}")
    if header.payload_len > max_payload:
        raise _oversized(f"payload of {header.payload_len}", max_payload)
    return header, payload


def _oversized(what: str, limit: int) -> WireError:
    """A message past the node's bound: its log names the key that sets it (a bound set below the model's size
    made every round fail, the job with "no cell answered", and only this said why)."""
    return WireError(RejectKind.OVERSIZED, f"{what} bytes exceeds the limit of {limit:,} (runtime.max_message_bytes)")


def _decode_segments(data: Segments, max_payload: int) -> tuple[Header, memoryview]:
    head = data.head
    if len(head) < len(MAGIC) + 4 or head[:4] != MAGIC:
        raise WireError(RejectKind.MALFORMED, "not a fedtier message (bad magic)")
    if len(data) > max_payload + 8 + MAX_HEADER_BYTES:
        raise _oversized(f"message of {len(data)}", max_payload)
    (head_len,) = struct.unpack_from("<I", head, 4)
    if head_len > MAX_HEADER_BYTES or 8 + head_len != len(head):
        raise WireError(RejectKind.MALFORMED, f"bad header length {head_len}")
    return _header(head[8:]), data.body.view()


def _decode_joined(data: bytes, max_payload: int) -> tuple[Header, memoryview]:
    if len(data) < len(MAGIC) + 4 or data[:4] != MAGIC:
        raise WireError(RejectKind.MALFORMED, "not a fedtier message (bad magic)")
    if len(data) > max_payload + 8 + MAX_HEADER_BYTES:
        raise _oversized(f"message of {len(data)}", max_payload)
    (head_len,) = struct.unpack_from("<I", data, 4)
    if head_len > MAX_HEADER_BYTES or 8 + head_len > len(data):
        raise WireError(RejectKind.MALFORMED, f"bad header length {head_len}")
    return _header(bytes(data[8 : 8 + head_len])), memoryview(data)[8 + head_len :]


def _header(raw: bytes) -> Header:
    try:  # (pydantic's JSON parser and validation in one: 7 us against 17 for json.loads and a dict's validation)
        return Header.model_validate_json(raw)
    except (ValueError, ValidationError) as exc:
        raise WireError(RejectKind.MALFORMED, f"invalid header: {_short(exc)}") from None


def verify_signature(
    header: Header,
    payload: bytes | memoryview | SharedPayload,
    topic: str,
    verify: Verifier,
    digest: bytes | None = None,
) -> None:
    """Raise :class:`WireError` unless ``header`` carries its sender's valid signature over itself
    (without the signature), ``payload`` and ``topic`` (``digest``: ``payload``'s, computed already)."""
    if header.sig is None:
        raise WireError(RejectKind.SIGNATURE, "unsigned message where a signature is required")
    unsigned = header.model_copy(update={"sig": None}).to_json()
    verify(header.sender, signed_bytes(topic, unsigned, payload, digest), decode_sig(header.sig))


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", "; ")
    return text[:300]
