"""The cloud's run session: which retained cloud records belong to the run in progress.

A cloud draws a fresh session id when it starts and stamps it on its retained status (``online``),
its retained round manifest (``fedtier/{run}/cloud/round``) and its ``finished`` record. A node acts
on a manifest or on ``finished`` only when its session is the one of the cloud's latest ``online``
status, so the retained records that an earlier run with the same name (or an earlier cloud process)
left on the broker never steer it, whatever order the broker delivers them in.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

from .wire.envelope import WireError
from .wire.ratelog import RateLimitedLog
from .wire.signed import open_record, seal_record

if TYPE_CHECKING:
    from .wire.keys import Trust

log = logging.getLogger("fedtier.session")
_rejections = RateLimitedLog(log)


def new_session() -> str:
    """A fresh session id (not model randomness: it only tells runs apart on the broker)."""
    return secrets.token_hex(8)


def encode_manifest(session: str, round: int, *, topic: str = "", trust: Trust | None = None) -> bytes:
    """The retained round manifest: ``{"session": ..., "round": r}`` (the cloud round in progress),
    signed by the cloud for ``topic`` with ``trust``."""
    return seal_record({"session": session, "round": round}, topic, trust.sign if trust is not None else None)


def decode_manifest(data: bytes, topic: str = "", trust: Trust | None = None) -> dict[str, Any] | None:
    """Parse a manifest; ``None`` if it is not one (a cleared record, garbage) or, with ``trust``, if
    the cloud did not sign it (logged)."""
    try:
        record = open_record(data, topic, "cloud", trust.verify if trust is not None else None)
    except WireError as exc:
        if trust is not None:
            _rejections.warning("rejected a round manifest on %s: %s", topic, exc)
        return None
    if not _session_ok(record.get("session")):
        return None
    r = record.get("round")
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        return None
    return record


def _session_ok(session: Any) -> bool:
    return isinstance(session, str) and 0 < len(session) <= 64


class EndedJobs:
    """The cloud sessions of the jobs a long-lived node served (or could not serve), all ended: its service's own
    set, shared with each job's nodes. A signed cloud message of one of them is an old copy the broker delivers again
    (one restored from an older save hands back what it held then), which the node can explain: dropped as before,
    said once a session at info, not as a rejection of a replayed or forged message."""

    def __init__(self, sessions: set[str] | None = None) -> None:
        self.sessions = sessions if sessions is not None else set()
        self._said: set[str] = set()

    def old_copy(self, session: str | None, who: str, what: str) -> bool:
        """Whether ``session`` is one of :attr:`sessions` (``what`` of it, received by ``who``, is then dropped)."""
        if session is None or session not in self.sessions:
            return False
        if session not in self._said:
            self._said.add(session)
            log.info(
                "%s: ignored an old copy of %s of cloud session %s, a job this node is done with "
                "(delivered again by the broker, restored from an older save or holding it queued)",
                who,
                what,
                session,
            )
        return True


class CloudSession:
    """What a node knows of the cloud: the current session, and the manifest and ``finished`` of it.

    Feed it every cloud status record, manifest and ``finished`` session (any order); ``round`` and
    ``finished`` only ever reflect records of the session of the latest ``online`` cloud status.
    """

    def __init__(self, pinned: str | None = None, past_jobs: EndedJobs | None = None) -> None:
        self.pinned: str | None = None
        self.past_jobs = past_jobs if past_jobs is not None else EndedJobs()  # a long-lived node's jobs done with
        self.session: str | None = None
        self.started: float | None = None  # the current session's start time (its status says)
        self.manifest: dict[str, Any] | None = None
        self.finished_sessions: set[str] = set()  # sessions whose ``finished`` was seen
        self.last_finished: str | None = None  # the session of the latest ``finished`` seen
        self.offline = False  # the cloud's latest status says offline
        if pinned is not None:
            self.pin(pinned)

    def pin(self, session: str, past_jobs: EndedJobs | None = None) -> None:
        """Serve only the cloud session ``session`` (a job's, ``protocols.jobs``: the cloud signed it in the
        job record), from now on: it is current at once (a resumed node's held task needs no status first),
        and no other session's status replaces it. ``past_jobs``: its long-lived node's jobs done with."""
        self.pinned = self.session = session
        if past_jobs is not None:
            self.past_jobs = past_jobs

    def on_status(self, record: dict[str, Any] | None) -> None:
        """A cloud status record (``protocols.status``); an ``offline`` one keeps the session. A record
        whose ``started`` time is older than the current session's (a replayed record of an earlier
        cloud) does not replace it. A cloud online again (after an offline status) in a session whose ``finished``
        was seen resumed that job for more rounds: the session is no longer finished."""
        was_offline = self.offline
        if record is not None and record.get("state") in ("online", "offline"):
            self.offline = record["state"] == "offline"
        if record is None or record.get("state") != "online" or not _session_ok(record.get("session")):
            return
        if was_offline and record["session"] in self.finished_sessions:  # back for a session that had finished:
            self.finished_sessions.discard(record["session"])  # resumed (``--resume``, more rounds); it runs again
            if self.last_finished == record["session"]:
                self.last_finished = None
        if self.pinned is not None and record["session"] != self.pinned:
            return
        started = record.get("started")
        started = float(started) if isinstance(started, (int, float)) and not isinstance(started, bool) else None
        if (
            record["session"] != self.session
            and self.started is not None
            and (started is None or started < self.started)
        ):
            log.warning(
                "ignored cloud session %s: it started before the current one (%s)", record["session"], self.session
            )
            return
        self.session, self.started = record["session"], started

    def on_manifest(self, record: dict[str, Any] | None) -> None:
        """A manifest; within one session the round never goes back (a replayed older manifest is ignored)."""
        m = self.manifest
        if record is not None and not (
            m is not None and m["session"] == record["session"] and record["round"] < m["round"]
        ):
            self.manifest = record

    def on_finished(self, session: Any) -> None:
        if _session_ok(session):
            self.finished_sessions.add(session)
            self.last_finished = session

    @property
    def ended(self) -> str | None:
        """The session of a ``finished`` record while no cloud has been seen online and the cloud's status says
        offline: the job this node was started for ended before it started, or a new run's cloud has yet to
        start (the cloud clears ``finished`` when it starts a run); ``None`` otherwise. A one-shot node waits a
        while for a cloud before it believes the first (``fedtier.cmd_deploy``)."""
        return self.last_finished if self.session is None and self.offline else None

    @property
    def round(self) -> int | None:
        """The cloud round in progress in the current session (``None``: not known yet)."""
        m = self.manifest
        return m["round"] if m is not None and self.session is not None and m["session"] == self.session else None

    @property
    def finished(self) -> bool:
        """The current session published ``finished``."""
        return self.session is not None and self.session in self.finished_sessions
