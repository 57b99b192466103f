"""Signed JSON records: the retained control plane (node status, the cloud's round manifest) and the
telemetry (cell aggregation and cloud round records).

A record stays plain JSON, so any MQTT client can read it, with one more key: ``"sig"``, its
producer's Ed25519 signature (base64url) over the topic it is published on and the record's
canonical JSON (sorted keys, no spaces, ``sig`` left out). The signer is not named in the record:
the topic says who must have produced it (:func:`signer_of`), so a record cannot be moved to another
node's topic and keep a valid signature.
"""

from __future__ import annotations

import json
from typing import Any

from ..jsonl import loads
from ..rejections import RejectKind
from .envelope import Signer, Verifier, WireError, decode_sig, encode_sig

RECORD_DOMAIN = b"fedtier/record/1\0"
MAX_RECORD_BYTES = 64 * 1024
_COMPACT = json.JSONEncoder(separators=(",", ":"))  # json.dumps(record, separators=...)'s, made once (not a call)


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def _signed(topic: str, record: dict[str, Any]) -> bytes:
    return b"".join((RECORD_DOMAIN, topic.encode(), b"\0", _canonical(record)))


def seal_record(record: dict[str, Any], topic: str, sign: Signer | None) -> bytes:
    """Serialize ``record`` for ``topic``; signed when ``sign`` is given."""
    if sign is not None:
        record = {**record, "sig": encode_sig(sign(_signed(topic, record)))}
    return _COMPACT.encode(record).encode()


def open_record(
    data: bytes, topic: str, signer: str | None, verify: Verifier | None, max_bytes: int = MAX_RECORD_BYTES
) -> dict[str, Any]:
    """Parse a record of at most ``max_bytes``; with ``verify`` it must carry ``signer``'s valid
    signature for ``topic``. Raises :class:`WireError` saying why not."""
    if len(data) > max_bytes:
        raise WireError(RejectKind.OVERSIZED, f"record of {len(data)} bytes exceeds {max_bytes}")
    try:
        record = loads(data)
    except ValueError:
        raise WireError(RejectKind.MALFORMED, "not a JSON record") from None
    if not isinstance(record, dict):
        raise WireError(RejectKind.MALFORMED, "not a JSON object")
    sig = record.pop("sig", None)
    if verify is not None:
        if signer is None:
            raise WireError(RejectKind.UNKNOWN_SENDER, f"nobody may sign records on {topic}")
        if not isinstance(sig, str):
            raise WireError(RejectKind.SIGNATURE, f"unsigned record (the signature of {signer!r} is required)")
        verify(signer, _signed(topic, record), decode_sig(sig))
    return record


def signer_of(topic: str) -> str | None:
    """Who must sign a record on ``topic``: ``fedtier/{run}/status/{node}`` -> the node's id
    (``cloud``, the cell for ``cell.{cell}``, the device for ``device.{device}``); the round
    manifest, run control and the cloud's telemetry -> ``cloud``; a cell's telemetry
    (``fedtier/{run}/telemetry/cell/{cell}``) -> the cell."""
    parts = topic.split("/")
    if len(parts) >= 4 and parts[2] == "telemetry":
        if len(parts) == 5 and parts[3] == "cell":
            return parts[4]
        return "cloud" if len(parts) == 4 and parts[3] == "cloud" else None
    if len(parts) >= 4 and parts[-2] in ("status", "state"):
        node = parts[-1]
        for prefix in ("cell.", "device."):
            if node.startswith(prefix):
                return node[len(prefix) :]
        return node if node == "cloud" else None
    if len(parts) == 4 and parts[2] == "cloud" and parts[3] in ("round", "control"):
        return "cloud"
    return None
