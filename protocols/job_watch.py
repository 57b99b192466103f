"""What a long-lived cell or agent knows of the federation's jobs (:class:`JobWatch`): the job in progress, the jobs
that ended and how, and the newest signed roster, from the cloud's retained records (``protocols.jobs``)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .failures import MAX_REASON
from .jobs import CurrentJob, JobError, open_job_record, parse_current
from .roster import Roster, RosterError, newer_roster, roster_topic
from .wire import topics

if TYPE_CHECKING:
    from .transport.base import Transport
    from .wire.keys import Trust

log = logging.getLogger("fedtier.jobs")

CLEARED = "no job in progress at the cloud (its job record cleared): this node missed how it ended"
"""Why a node says a job it served stopped where the cloud cleared its job record before the node heard its end."""
CLEAR_STANDS = 15.0
"""Seconds a clear of the job record must stand, no record of the job held back, to be that job's end: a clear is
an empty retained publish, which no signature covers (on a broker without per-node ACLs any login may make one), and
the serving cloud puts its record back at once (``cloud.kept_records``); only an idle cloud's clear stands. So must
another job's record that does not say the node's job ended, to move it off its job: one of an earlier job, signed
but put back by a login or a broker restored from an older save, is replaced at once too."""


class JobWatch:
    """What a cell or an agent knows of the federation's jobs, from ``transport``: the job in progress (the cloud's
    retained, signed ``cloud/job`` record) and the sessions the cloud declared finished (its ``finished`` control
    record). With ``trust`` (the node's own identity: its transport's chunk signing is configured from it) only the
    cloud's signatures count. Without ``transport`` it subscribes nothing: the owner feeds :meth:`on_job` (long-lived
    agents, on a connection they already hold). ``ended``: sessions the node knows ended (it served them)."""

    def __init__(self, transport: Transport | None, federation: str, trust: Trust | None, *ended: str) -> None:
        from .wire.messenger import Messenger

        self.federation, self.trust = federation, trust
        self.current: CurrentJob | None = None
        self.finished: set[str] = set(ended)
        self.outcomes: dict[str, dict[str, str]] = {}  # finished session -> why it failed or stopped (cut), if so
        self.roster: Roster | None = None  # the newest verified roster (cells refuse revoked devices by it)
        self.on_roster: Callable[[Roster], None] | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._cleared: tuple[str, float] | None = None  # (the session held as current, when its record was cleared)
        self._since = 0.0  # when the current record's session became current
        if transport is not None:
            self._control = Messenger(transport, federation, "watcher", trust=trust)
            # the roster first: retained, it comes before the job, which a node checks its membership against by it
            transport.subscribe(roster_topic(federation), self._on_roster)
            transport.subscribe(topics.current_job(federation), self.on_job)
            transport.subscribe(topics.control(federation), self._on_control)

    def left(self, job: CurrentJob) -> bool:
        """Whether the cloud has left ``job`` (a node's): it ended (its ``finished``, a record's ``previous``, its
        record cleared) or the cloud moved on to another job (its record stood :data:`CLEAR_STANDS` seconds)."""
        if (c := self._cleared) is not None and self.clock() - c[1] >= CLEAR_STANDS:  # (:meth:`on_job`)
            self._cleared = None
            if c[0] not in self.finished:
                self._ended(c[0], {"stopped": CLEARED})
        other = self.current is not None and self.current.session != job.session
        return job.session in self.finished or (other and self.clock() - self._since >= CLEAR_STANDS)

    def pending(self, done: set[str]) -> CurrentJob | None:
        """The job in progress if this node has yet to serve it (not in ``done``, not finished)."""
        c = self.current
        return c if c is not None and c.session not in done and c.session not in self.finished else None

    def on_job(self, topic: str, data: bytes) -> None:
        """A ``cloud/job`` record: the job in progress when the cloud signed it (else logged, ignored). Cleared
        (empty), the cloud says no job is in progress: the one held as current ended, if its end was not heard (a
        node restarted after it ended, before the broker's next save, took its record from the restored broker as
        running; the cloud clears what the broker holds of it, and nothing else would have told the node), once the
        clear stood :data:`CLEAR_STANDS` seconds (:meth:`left`): a serving cloud puts its record back at once."""
        if not data:
            if (c := self.current) is not None and c.session not in self.finished:
                self._cleared = (c.session, self.clock())
            self.current = None
            return
        try:
            record = open_job_record(data, topic, "cloud", self.trust.verify if self.trust is not None else None)
            current = parse_current(record)
        except JobError as exc:
            log.warning("ignored a job record: %s", exc)
            return
        if current.session in self.finished:  # an ended job's (a broker restored from an older save): no moving on
            log.debug("ignored the record of job %s, which has ended (a stale record)", current.job)  # (-vv)
            return
        if self.current is None or current.session != self.current.session:
            self._since = self.clock()
        self.current, self._cleared = current, None
        if (prev := self.current.previous) is not None and prev["session"] not in self.finished:
            self._ended(prev["session"], prev)  # its finished record missed (or still on its way): as the cloud says

    def _on_roster(self, topic: str, data: bytes) -> None:
        if not data or self.trust is None:  # an unsigned federation has no roster to check
            return
        try:
            roster = newer_roster(
                data, self.trust.verify, self.federation, self.roster.version if self.roster is not None else None
            )
        except RosterError as exc:
            log.warning("ignored a roster: %s", exc)
            return
        if roster is None:
            return
        self.roster = roster
        if self.on_roster is not None:
            self.on_roster(roster)

    def _on_control(self, topic: str, data: bytes) -> None:
        msg = self._control.receive(topic, data, kinds=("control",)) if data else None
        if msg is None or (self.trust is not None and msg.header.sender != "cloud"):
            return
        meta = msg.payload.meta
        if meta.get("event") == "finished" and isinstance(meta.get("session"), str):
            self._ended(meta["session"], meta)

    def _ended(self, session: str, said: dict[str, Any]) -> None:
        """``session`` ended as ``said`` (a ``finished`` record's, or a job record's ``previous``)."""
        self.finished.add(session)
        self.outcomes[session] = {k: str(said[k])[:MAX_REASON] for k in ("failed", "stopped") if said.get(k)}
