"""Liveness records published (retained) on ``fedtier/{run}/status/{node}``."""
from __future__ import annotations

import json
from typing import Any


def encode_status(state: str, **extra: Any) -> bytes:
    """A small JSON record: ``{"state": "online"|"offline", ...}``."""
    return json.dumps({"state": state, **extra}, separators=(",", ":")).encode()


def decode_status(data: bytes) -> dict[str, Any] | None:
    """Parse a status record; ``None`` if it is not one (it is then ignored)."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("state") not in ("online", "offline"):
        return None
    return record
