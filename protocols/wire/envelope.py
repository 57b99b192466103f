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

from ..jsonl import loads
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


def _sha256(payload: bytes | memoryview | Buffers) -> bytes:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return hashlib.sha256(payload).digest()
    h = hashlib.sha256()
    for part in cast(Buffers, payload):  # its parts (bytes returned above), not a bytes' ints
        h.update(part)
    return h.digest()


def _nbytes(payload: bytes | memoryview | Buffers) -> int:
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).nbytes
    return sum(len(p) if type(p) is bytes else memoryview(p).nbytes for p in cast(Buffers, payload))


def signed_bytes(topic: str, header_wo_sig: bytes, payload: bytes | memoryview | Buffers) -> bytes:
    """What a message signature covers: the topic it is published on, the header (run, session, kind,
    round, edge round, cell, sender, message id, payload length) and the payload's sha256 (``payload``
    as bytes or as its buffers in order: the same digest)."""
    return b"".join((SIGNED_DOMAIN, topic.encode(), b"\0", header_wo_sig, _sha256(payload)))


def encode_sig(sig: bytes) -> str:
    return base64.urlsafe_b64encode(sig).rstrip(b"=").decode()


def decode_sig(text: str) -> bytes:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise WireError(RejectKind.SIGNATURE, "malformed signature") from None


def envelope_head(header: Header, payload: bytes | Buffers, sign: Signer | None = None, topic: str = "") -> bytes:
    """A message's bytes before its payload: ``MAGIC | u32 header length | header JSON``, with ``header``'s
    ``payload_len`` set here; signed for ``topic`` when ``sign`` is given (``payload`` as in :func:`encode_message`).
    The one encoder of the envelope: :func:`encode_message` joins the payload behind it, a lent payload with room
    before it takes it in place (:class:`~protocols.wire.payload.Headroom`)."""
    size = _nbytes(payload)
    if header.payload_len != size or header.sig is not None:  # (a header made for this payload is kept)
        header = header.model_copy(update={"payload_len": size, "sig": None})
    if sign is not None:
        header = header.model_copy(update={"sig": encode_sig(sign(signed_bytes(topic, header.to_json(), payload)))})
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


def decode_message(data: bytes, *, max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[Header, memoryview]:
    """Parse and validate a framed message (not its signature); raise :class:`WireError` on anything
    malformed or larger than ``max_payload``."""
    if len(data) < len(MAGIC) + 4 or data[:4] != MAGIC:
        raise WireError(RejectKind.MALFORMED, "not a fedtier message (bad magic)")
    if len(data) > max_payload + 8 + MAX_HEADER_BYTES:
        raise WireError(RejectKind.OVERSIZED, f"message of {len(data)} bytes exceeds the limit of {max_payload}")
    (head_len,) = struct.unpack_from("<I", data, 4)
    if head_len > MAX_HEADER_BYTES or 8 + head_len > len(data):
        raise WireError(RejectKind.MALFORMED, f"bad header length {head_len}")
    try:
        raw = loads(bytes(data[8 : 8 + head_len]))
        header = Header.model_validate(raw)
    except (ValueError, ValidationError) as exc:
        raise WireError(RejectKind.MALFORMED, f"invalid header: {_short(exc)}") from None
    payload = memoryview(data)[8 + head_len :]
    if len(payload) != header.payload_len:
        raise WireError(RejectKind.MALFORMED, f"payload is {len(payload)} bytes, header says {header.payload_len}")
    if header.payload_len > max_payload:
        raise WireError(
            RejectKind.OVERSIZED, f"payload of {header.payload_len} bytes exceeds the limit of {max_payload}"
        )
    return header, payload


def verify_signature(header: Header, payload: bytes | memoryview, topic: str, verify: Verifier) -> None:
    """Raise :class:`WireError` unless ``header`` carries its sender's valid signature over itself
    (without the signature), ``payload`` and ``topic``."""
    if header.sig is None:
        raise WireError(RejectKind.SIGNATURE, "unsigned message where a signature is required")
    unsigned = header.model_copy(update={"sig": None}).to_json()
    verify(header.sender, signed_bytes(topic, unsigned, payload), decode_sig(header.sig))


def _short(exc: Exception) -> str:
    text = str(exc).replace("\n", "; ")
    return text[:300]
