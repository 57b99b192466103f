"""The long-lived cell of a federation: serves one job after another, each with the config the cloud
published for it (``protocols.jobs``), on one connection per job, until SIGTERM."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Callable
from functools import partial

from protocols.config import RunConfig
from protocols.job_watch import JobWatch
from protocols.joblog import say_ended, say_taken
from protocols.jobs import CurrentJob, JobError, say_cannot_serve
from protocols.roster import Roster
from protocols.runfiles import write_cell_job
from protocols.session import EndedJobs
from protocols.status import idle_while
from protocols.transport.base import Transport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import NodeTwin
from protocols.wire import topics
from protocols.wire.keys import Trust

from .revoked_statuses import RevokedStatuses
from .server import CellServer

log = logging.getLogger("fedtier.cell.service")


def apply_roster(node: CellServer, cell: str, roster: Roster) -> None:
    """What the cloud's signed roster says of this cell: its members' keys (devices enrolled after the
    cell's keys file was written), their weight bounds, and the revoked ones (out at once)."""
    members = [d for d in roster.members(cell) if node.devices.position(d) is not None]
    if node.trust is not None:
        node.trust.learn({d: key for d in members if (key := roster.device_key(d)) is not None})
    if isinstance(node.max_weights, dict):
        node.max_weights.update({d: b for d in members if (b := roster.device_bound(cell, d)) is not None})
    node.revoke_members(roster.revoked)


class CellService:
    """``connect()`` returns a connected transport on ``loop`` (the caller retries and backs off);
    ``build(cfg, transport)`` builds the cell server of a job's (localized) config on it."""

    def __init__(
        self,
        bundle: RunConfig,
        cell: str,
        loop: ThreadLoop,
        connect: Callable[[], Transport | None],
        build: Callable[[RunConfig, Transport], CellServer],
        trust: Trust | None,
        *,
        marks_job_folder: bool = False,
        twin_window: float | None = None,
    ) -> None:
        """``twin_window``: on its first connection, listen that long and refuse to start if another process of this
        cell is live (``protocols.twin.NodeTwin``; ``fedtier cell --serve``: ``NODE_WINDOW``).
        ``marks_job_folder``: each job's folder is this cell's own (``fedtier cell --serve``: holds its records
        only), and says so: the cell and job, and how the job ended for it (``runfiles.write_cell_job``, which
        ``fedtier monitor`` on that folder reads); not where the cloud and the cells share one (``fedtier run``)."""
        self.bundle, self.cell, self.loop, self.connect, self.build, self.trust = (
            bundle,
            cell,
            loop,
            connect,
            build,
            trust,
        )
        self.marks_job_folder = marks_job_folder
        self.stopping = threading.Event()
        self.served: list[str] = []  # the jobs this process served, in order
        self.stopped_during: str | None = None  # the job it was stopped during (SIGTERM mid-job), if it was
        self.revoked: str | None = None  # why it stopped: a roster revoked this cell (the node exits 2: no restart)
        self.revoked_during: str | None = None  # the job it was serving then, if it was
        self.node: CellServer | None = None
        self.revoked_devices = RevokedStatuses(bundle.run.name, cell)  # revoked devices' statuses, kept clear
        self.twin = NodeTwin(bundle.run.name, topics.cell_node(cell), "cell", twin_window, trust)  # its instance

    def _take_roster(self, node: CellServer | None, transport: Transport, roster: Roster) -> None:
        """A newer signed roster: the job's cell server (``node``, while it serves one) applies it; and the retained
        status of each revoked device under this cell's topics is cleared, and kept clear for as long as this process
        runs (``RevokedStatuses``): a device revoked between jobs is in no job that would take it out, and its last
        idle status stayed on the broker for ever ("revoked" in the fleet view beside a status every view refused:
        its key is gone); one still connected to a broker without per-node ACLs may publish it again."""
        if node is not None:
            apply_roster(node, self.cell, roster)
        self.revoked_devices.take(roster, transport)
        if self.cell in roster.revoked and self.revoked is None:  # this cell: it stops, as a revoked device does
            self.revoked = (
                f"cell {self.cell} revoked from federation {roster.federation!r} (signed roster version "
                f"{roster.version}): it takes part in no job from now on; stopping (a revoked id is never reused: "
                "enroll the cell again under a new id, `fedtier provision add-cell`)"
            )
            self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self.loop.post(lambda: None)

    def serve(self) -> None:
        """Serve jobs until :meth:`stop`. The cell's last status is offline: said by the job's server if it stops
        mid-job, else on a connection of its own (after a job's end, said idle, the next one is opened even if
        the service stopped meanwhile: ``connect`` tries once then), unless the broker is unreachable."""
        done: set[str] = set()
        ended = EndedJobs(done)  # a task of one of them, handed back by a restored broker: an old copy, said so
        fed = self.bundle.run.name
        while True:
            transport = self.connect()
            if transport is None:  # stopped while the broker was unreachable
                break
            self.twin.guard(transport, self.loop)  # TwinError: another process of this cell is live
            self.revoked_devices.watch(transport)
            if done:  # after a job served to its end here, what its session still had for it is a straggler
                for pattern in topics.cell_job_patterns(fed, self.cell):
                    transport.unsubscribe(pattern)
            status = topics.status(fed, topics.cell_node(self.cell))
            watch = JobWatch(transport, fed, self.trust, *done)
            watch.on_roster = partial(self._take_roster, None, transport)  # between jobs
            period = self.bundle.monitoring.idle_heartbeat
            wait = partial(self._next_job, watch, done)
            current = idle_while(self.loop, transport, status, self.trust, period, wait, **self.twin.extra)
            if current is None:  # stopped (at once if it already was): said offline
                transport.close()
                break
            try:
                cfg = current.run_config(self.bundle, self.cell, watch.roster)
                node = self.build(cfg, transport)
            except (JobError, ValueError) as exc:  # cannot serve it: absent from this job, with the reason
                say_cannot_serve(f"cell {self.cell}", current.job, exc)
                done.add(current.session)
                transport.close()
                continue
            node.cloud.pin(current.session, ended)  # tasks of this job's session only, from the start
            node.status_extra = self.twin.extra
            watch.on_roster = partial(self._take_roster, node, transport)
            if watch.roster is not None:
                apply_roster(node, self.cell, watch.roster)
            self.node = node
            say_taken(f"cell {self.cell}", current.job, cfg.run.rounds, "its journal" if node.resumes else None)
            self._mark(cfg, current.job, "running")
            self.loop.post(node.start)
            self._until_job_ends(watch, current)
            stopped = self.stopping.is_set()
            if not stopped:  # the job ended: this cell's session drops its topics (kept for a resume)
                how = _ended_how(watch, current)
                self._mark(cfg, current.job, *how)
                say_ended(f"cell {self.cell}", current.job, *how)
                done.add(current.session)
                self.served.append(current.job)
                for pattern in topics.cell_job_patterns(fed, self.cell):
                    transport.unsubscribe(pattern)
            self.node = None
            node.stop(None if stopped else self.bundle.monitoring.idle_heartbeat)
            del node, watch, transport  # the job's server and its closed connection (whose subscriptions hold the
            # server's handlers) are garbage now, held in reference cycles: collected at once below,
            gc.collect()  # not after ~10 more jobs (its arrays are native memory: few objects, rare collections)
            if stopped:  # its server said offline
                self.revoked_during, self.stopped_during = (current.job, None) if self.revoked else (None, current.job)
                break

    def _mark(self, cfg: RunConfig, job: str, phase: str, reason: str | None = None) -> None:
        """The job's folder says it is this cell's, and the job's ``phase`` (see ``marks_job_folder``)."""
        if self.marks_job_folder:
            try:
                write_cell_job(cfg.output_dir(), self.cell, job, phase, reason)
            except OSError as exc:  # the folder's view only: the job goes on
                log.warning("cell %s: cannot write its job record in %s: %s", self.cell, cfg.output_dir(), exc)

    def _next_job(self, watch: JobWatch, done: set[str]) -> CurrentJob | None:
        """Wait for a job this cell has yet to serve (``None``: stopped)."""
        self.loop.run(until=lambda: self.stopping.is_set() or watch.pending(done) is not None)
        return None if self.stopping.is_set() else watch.pending(done)

    def _until_job_ends(self, watch: JobWatch, current: CurrentJob) -> None:
        """Serve until the cloud finished the job, moved to another one, or :meth:`stop`."""
        self.loop.run(until=lambda: self.stopping.is_set() or watch.left(current))


def _ended_how(watch: JobWatch, current: CurrentJob) -> tuple[str, str | None]:
    """How ``current`` ended for this cell: as the cloud's ``finished`` record says (``failed``, ``stopped`` with
    why, or ``finished``), or ``stopped`` when the cloud moved on to another job before this cell heard its end."""
    if current.session not in watch.finished:
        moved = watch.current.job if watch.current is not None else "?"
        return "stopped", f"the cloud moved on to job {moved} before this cell heard the end of this one"
    outcome = watch.outcomes.get(current.session, {})
    for phase in ("failed", "stopped"):
        if phase in outcome:
            return phase, outcome[phase]
    return "finished", None
