"""Liveness records published (retained) on ``fedtier/{run}/status/{node}``.

On a run with signing keys, a record carries its node's signature (``protocols.wire.signed``) and a
reader with ``trust`` drops, with a logged reason, any record that is not signed by the node its
topic names.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .wire.envelope import WireError
from .wire.ratelog import RateLimitedLog
from .wire.signed import open_record, seal_record, signer_of

if TYPE_CHECKING:
    from .wire.keys import PublicKeys, Trust

log = logging.getLogger("fedtier.status")
_rejections = RateLimitedLog(log)


def encode_status(state: str, *, topic: str = "", trust: Trust | None = None, **extra: Any) -> bytes:
    """A small JSON record: ``{"state": "online"|"offline", ...}``, signed for ``topic`` with ``trust``."""
    return seal_record({"state": state, **extra}, topic, trust.sign if trust is not None else None)


def decode_status(data: bytes, topic: str = "", trust: PublicKeys | None = None) -> dict[str, Any] | None:
    """Parse a status record; ``None`` if it is not one (it is then ignored) or, with ``trust``, if it
    is not signed by the node of ``topic`` (logged)."""
    try:
        record = open_record(data, topic, signer_of(topic), trust.verify if trust is not None else None)
    except WireError as exc:
        if trust is not None:
            _rejections.warning("rejected a status record on %s: %s", topic, exc)
        return None
    if record.get("state") not in ("online", "offline"):
        return None
    return record
