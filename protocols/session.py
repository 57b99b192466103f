"""The cloud's run session: which retained cloud records belong to the run in progress.

A cloud draws a fresh session id when it starts and stamps it on its retained status (``online``),
its retained round manifest (``fedtier/{run}/cloud/round``) and its ``finished`` record. A node acts
on a manifest or on ``finished`` only when its session is the one of the cloud's latest ``online``
status, so the retained records that an earlier run with the same name (or an earlier cloud process)
left on the broker never steer it, whatever order the broker delivers them in.
"""
from __future__ import annotations

import json
import secrets
from typing import Any


def new_session() -> str:
    """A fresh session id (not model randomness: it only tells runs apart on the broker)."""
    return secrets.token_hex(8)


def encode_manifest(session: str, round: int) -> bytes:
    """The retained round manifest: ``{"session": ..., "round": r}`` (the cloud round in progress)."""
    return json.dumps({"session": session, "round": round}, separators=(",", ":")).encode()


def decode_manifest(data: bytes) -> dict[str, Any] | None:
    """Parse a manifest; ``None`` if it is not one (a cleared record, garbage)."""
    try:
        record = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or not _session_ok(record.get("session")):
        return None
    r = record.get("round")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        return None
    return record


def _session_ok(session: Any) -> bool:
    return isinstance(session, str) and 0 < len(session) <= 64


class CloudSession:
    """What a node knows of the cloud: the current session, and the manifest and ``finished`` of it.

    Feed it every cloud status record, manifest and ``finished`` session (any order); ``round`` and
    ``finished`` only ever reflect records of the session of the latest ``online`` cloud status.
    """

    def __init__(self) -> None:
        self.session: str | None = None
        self.manifest: dict[str, Any] | None = None
        self.finished_sessions: set[str] = set()  # sessions whose ``finished`` was seen

    def on_status(self, record: dict[str, Any] | None) -> None:
        """A cloud status record (``protocols.status``); an ``offline`` one keeps the session."""
        if record is not None and record.get("state") == "online" and _session_ok(record.get("session")):
            self.session = record["session"]

    def on_manifest(self, record: dict[str, Any] | None) -> None:
        if record is not None:
            self.manifest = record

    def on_finished(self, session: Any) -> None:
        if _session_ok(session):
            self.finished_sessions.add(session)

    @property
    def round(self) -> int | None:
        """The cloud round in progress in the current session (``None``: not known yet)."""
        m = self.manifest
        return m["round"] if m is not None and self.session is not None and m["session"] == self.session else None

    @property
    def finished(self) -> bool:
        """The current session published ``finished``."""
        return self.session is not None and self.session in self.finished_sessions
