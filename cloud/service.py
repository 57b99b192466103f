"""The long-lived cloud of a federation: takes signed jobs from the operator, queues them durably and runs
them one after another, each as a :class:`CloudServer` with its own run folder and its job's session.

On the loop thread: submissions and cancellations (``protocols.jobs``) are verified against the operator's
public key, validated against the federation, written to the queue (:mod:`cloud.jobs`) and answered with a
signed reply (:mod:`cloud.job_requests`). :meth:`CloudService.serve` (the caller's thread) runs the queue: it
publishes the job in progress (retained, signed: cells and agents take its config from there), runs its rounds,
records how it ended, and starts the next. Killed while a job runs, the restarted service resumes it from its
checkpoint (same session, so cells and agents carry on) and then runs the queued ones.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from protocols import runfiles
from protocols.algorithms.base import Algorithm, TrainParams
from protocols.bounds import roster_cell_bounds
from protocols.checkpoint import write_durably
from protocols.config import RunConfig, TopologySection
from protocols.joblog import say_ended, say_taken
from protocols.jobs import MAX_JOB_RECORD_BYTES, CurrentJob, JobError, ended_outcome
from protocols.jsonl import StorageError, writing
from protocols.privacy.ledger import LEDGER_FILE, LedgerError, PrivacyLedger
from protocols.roster import Roster, RosterError, roster_topic, sign_roster, verify_roster
from protocols.session import EndedJobs
from protocols.status import IdleBeat, between_jobs
from protocols.transport.base import Transport
from protocols.transport.mqtt import MqttTransport
from protocols.transport.threadloop import ThreadLoop
from protocols.twin import NodeTwin
from protocols.wire import topics
from protocols.wire.keys import Trust
from protocols.wire.signed import seal_record

from .job_requests import on_request
from .jobs import ENDED, Job, JobFolderFull, JobQueue, JobQueueError, final_figures
from .kept_records import KeptRecords
from .node import build_cloud
from .requests import REQUESTS_FILE, OperatorRequests
from .server import CellAvailability, CloudServer, Evaluator

log = logging.getLogger("fedtier.cloud.service")
LIST_ENVELOPE_BYTES = 1024
"""What the job list's record adds to its jobs' summaries: its keys, its time and its signature (~150 bytes)."""


@dataclass(frozen=True)
class JobParts:
    """What the caller builds for a job's config (they need the data set: not the cloud's business), and
    how a launcher that also runs the cells and devices (``fedtier run``) wants the job's server built."""

    algorithm: Algorithm
    evaluator: Evaluator | None = None
    availability: CellAvailability | None = None  # the cells' participation (``fedtier run``: the config's)
    cell_bounds: Mapping[str, float] | None = None  # each cell's weight bound (else the roster's, the config's)
    devices_recreated: bool = False  # see ``build_cloud``
    resume: bool = False  # continue from the job folder's checkpoint, even as a new job (``fedtier run --resume``)
    collect_cell_records: bool = True  # into ``cells.jsonl`` (not where the cells write to the same folder)
    on_build: Callable[[CloudServer], None] | None = None  # called with the job's server before it starts


class CloudService:
    """``connect()`` returns a connected transport on ``loop`` (the caller retries and backs off);
    ``parts(cfg)`` builds a job's algorithm and evaluator; ``on_end(job, cfg, node, out)`` writes an
    ended job's (finished, failed or cancelled) final model and summary (one that could not be built: its summary
    alone, here); ``roster``: the signed roster it publishes (retained) on every
    connection. ``operator``: the operator's public key (``None``: unsigned
    federation, any submitter accepted; for tests and ``fedtier run`` only). ``job_folder(job)``: a job's run
    folder (default ``{output}/jobs/{job}``; ``fedtier run``: its own run folder)."""

    _idle: IdleBeat | None = None  # the idle status's heartbeat, between jobs
    _bounded: tuple[TrainParams, Callable[[str], str | None]] | None = None
    """The running job's training parameters and topology's ``cell_of``, when the roster bounds its cells' weights."""
    _said_idle = False  # the last job's server said idle as it closed its connection, and none was opened since
    _current: CurrentJob | None = None  # the job in progress, as its retained record says

    def __init__(
        self,
        bundle: RunConfig,
        loop: ThreadLoop,
        connect: Callable[[], Transport | None],
        queue: JobQueue,
        parts: Callable[[RunConfig], JobParts],
        *,
        trust: Trust | None,
        operator: bytes | None,
        on_end: Callable[[Job, RunConfig, CloudServer, Path], None] | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        roster: bytes | None = None,
        roster_path: Path | None = None,
        job_folder: Callable[[str], Path] | None = None,
        twin_window: float | None = None,
        claim: Callable[[], None] | None = None,
    ) -> None:
        """``twin_window``: on its first connection, listen that long and refuse to start if another cloud process
        of the federation is live (``protocols.twin.NodeTwin``; ``fedtier cloud --serve``: ``NODE_WINDOW``).
        ``claim``: called once that check passed, to write what the cloud keeps in its folder (a refused process
        leaves nothing there that a later start would take for its state)."""
        self.job_folder, self.claim = job_folder, claim
        self.bundle, self.loop, self.connect, self.queue, self.parts = bundle, loop, connect, queue, parts
        self.fed = bundle.run.name
        self.trust, self.on_end, self.on_round = trust, on_end, on_round
        self.requests = OperatorRequests(queue.path.parent / REQUESTS_FILE, operator)  # signed, dated, taken once
        self.node: CloudServer | None = None
        self.transport: Transport | None = None
        self.stopping = threading.Event()
        self.error: BaseException | None = None  # a queue that could not be written: the service stops
        self.wake = threading.Event()
        self.ledger = PrivacyLedger(queue.path.parent / LEDGER_FILE)  # epsilon per device across jobs
        self.roster_path = roster_path  # where an adopted (newer) roster is kept across restarts
        self.roster: Roster | None = None  # the federation's membership; jobs are planned on it
        self.twin = NodeTwin(self.fed, "cloud", "cloud", twin_window, trust)  # its instance: in its statuses, its will
        self.kept = KeptRecords()  # its roster, job list and job in progress, as it last published them
        self.served: list[str] = []  # the jobs this process ran to their end (finished, failed, cancelled), in order
        self.stopped_during: str | None = None  # the job it was stopped during (SIGTERM mid-job), if it was
        self.failed_at_start: list[str] = []  # the jobs that failed before they started (e.g. a model it cannot build)
        self.cancelled_queued: list[str] = []  # the jobs cancelled while queued (cloud.job_requests.cancel)
        if roster is not None and trust is not None:
            self._adopt(verify_roster(roster, trust.verify, federation=self.fed), write=False)

    def _cell_bounds(self, cfg: RunConfig) -> Mapping[str, float] | None:
        """Each cell's weight bound from the federation's signed roster (the sum of its devices' bounds there, the
        job's devices only), or ``None`` (the job config's ``security.max_device_weight`` then, see ``cloud.node``).
        A newer roster adopted while the job runs bounds it from then on (:meth:`_apply_roster`)."""
        if self.roster is None or self.trust is None:
            return None
        self._bounded = (cfg.train, cfg.topology.cell_of)
        return roster_cell_bounds(self.roster, cfg.train, cfg.topology.cell_of)

    # ------------------------------------------------------------------ the queue runner (caller's thread)
    def serve(self) -> None:
        """Run jobs until :meth:`stop` (SIGTERM) or a queue error (re-raised). The cloud's last status is offline:
        said by the job's server if it stops mid-job, else on a connection (a stop just after a job's end, said idle,
        opens one: ``connect`` tries once then), unless the broker is unreachable."""
        while not self.stopping.is_set():
            if self.transport is None:
                self.transport = self._connect()
                if self.transport is None:
                    break
            job = self.queue.next()
            if job is None:
                self.wake.clear()
                self.loop.run(until=lambda: self.stopping.is_set() or self.wake.is_set(), timeout=1.0)
                self._raise()
                continue
            if self._run(job, self.transport):
                self.transport = None  # the job's server closed it
            gc.collect()  # the job's server is garbage now, in reference cycles: freed at once, not at the next
            # full collection (what a job promoted to the oldest generation waits for one; cell_server.service)
            self._raise()
        if self.transport is None and self._said_idle:  # stopped as a job's server closed its connection, saying idle
            self.transport = self.connect()
        if self.transport is not None:
            self._idle_beat(None)
            between_jobs(self.transport, topics.status(self.fed, "cloud"), self.trust, None, **self.twin.extra)
            self.transport.close()

    def stop(self) -> None:
        """Stop after the running round's messages are handled (a running job resumes at the next start)."""
        self.stopping.set()
        self.loop.post(lambda: None)

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _connect(self) -> Transport | None:
        self._said_idle = False  # this connection says offline as the service stops
        transport = self.connect()
        if transport is None:  # stopped while the broker was unreachable
            return None
        self.kept.forget_coming()  # what the last connection published may never come back on this one
        self.twin.guard(transport, self.loop)  # TwinError: another cloud process of the federation is live
        claim, self.claim = self.claim, None
        if claim is not None:
            claim()
        self.requests.create()  # (once no other cloud is live, as claim: a restart takes what came meanwhile)
        if (job := self.queue.next()) is None or job.state != "running":  # not resuming: a past job's stragglers
            for pattern in topics.cloud_job_patterns(self.fed):  # (redelivered to this session) are not held, and
                transport.unsubscribe(pattern)  # a job record the broker holds (an ended job's) is cleared
            self.kept.last.setdefault(topics.current_job(self.fed), b"")
        transport.subscribe(topics.job_submit(self.fed), partial(on_request, self))
        transport.subscribe(roster_topic(self.fed), self._on_roster)
        for topic in (topics.job_list(self.fed), topics.current_job(self.fed)):  # (a broker restored from an
            transport.subscribe(topic, lambda t, d: self.kept.on_record(self._live(), t, d))  # older database)
        self._idle_beat(transport)
        self.loop.post(lambda: self._reannounce(transport))
        if isinstance(transport, MqttTransport):  # a broker restarted without its state lost every retained record
            transport.on_session_lost = lambda: self.loop.post(lambda: self._reannounce(transport))
            transport.on_reconnected = lambda: self.loop.post(self._tasks_again)
        return transport

    def _tasks_again(self) -> None:
        """The cloud's connection came back: the broker may have lost what it held (restarted from its last autosave,
        or without its state), a cell's task or its report among it. The open round's cells that have not reported
        get their task again (a cell that reported sends its report again): before, the round waited up to its
        ``runtime.cell_deadline`` for them. The job's online status is said again: a broker restored from an older
        save held another job's (`fedtier fleet` named that job) until this one ended."""
        if self.node is not None and not self.node.finished:
            self.node.transport.publish(topics.status(self.fed, "cloud"), self.node.online, retain=True)
            self.node.tasks_again()

    def _reannounce(self, transport: Transport) -> None:
        """Publish (retained) what the broker must hold for others: the roster, the job list and the job in
        progress. On connecting, and again on a reconnect that found no session at the broker (restarted without
        persistence, or its state lost): before, `fedtier submit` then refused ("no cloud has served federation
        ... yet"), `fedtier jobs` found no list and a node restarted mid-job no job, until the cloud restarted."""
        self.kept.forget_coming()  # (a broker that lost its session: what was on its way is lost)
        self._publish_roster(transport)
        self._publish_list(transport)
        if self._current is not None:
            topic = topics.current_job(self.fed)
            self.kept.publish(transport, topic, self._seal(self._current.record(), topic))

    def _idle_beat(self, transport: Transport | None) -> None:
        """Stop the idle status's heartbeat (the loop is not running: no beat follows), and with ``transport``
        start another on it (``protocols.status.IdleBeat``)."""
        if self._idle is not None:
            self._idle.stop()
            self._idle = None  # it holds its connection: the job's (closed at its end), whose handlers hold its server
        if transport is not None:
            topic, period = topics.status(self.fed, "cloud"), self.bundle.monitoring.idle_heartbeat
            self._idle = IdleBeat(self.loop, transport, topic, self.trust, period, **self.twin.extra)
            self.loop.post(self._idle.start)

    def _run(self, job: Job, transport: Transport) -> bool:
        """Run ``job`` on ``transport`` until it ends or the service stops; ``False`` if it failed before
        it started (the transport is still open): a job that cannot be built fails with the reason, and
        the queue goes on (a restarted cloud would meet the same error: no crash loop). A full disk is the cloud's
        fault, not the job's: :class:`JobFolderFull` stops the cloud, the job left as the queue says (before, each
        restart said "job J failed: [Errno 28] No space left on device" of a job the queue could not fail either)."""
        resumed = job.state == "running"
        current = CurrentJob(job.job, job.config, job.digest, self._previous(job.job), job.nonce)
        try:
            cfg, out, node = self._build(job, current, transport, resumed)
        except (ValueError, OSError) as exc:  # ConfigError, JobError: the job's, not the cloud's fault
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk: the cloud's
                verb, then = ("resume", "resumes from its checkpoint") if resumed else ("start", "starts")
                unwritten = (
                    exc.strerror if isinstance(exc, StorageError) else f"cannot write {exc.filename}: {exc.strerror}"
                )
                why = f"{unwritten}; it {then} once the cloud can write there (the cloud stops)"
                raise JobFolderFull(f"job {job.job} cannot {verb}: {why}") from None
            self._fail(job, str(exc))
            return False
        self._idle_beat(None)  # the job's server announces it online
        job = self.queue.start(job.job) if not resumed else job
        say_taken("cloud", job.job, cfg.run.rounds, "its checkpoint" if resumed else None)

        def begin() -> None:
            self.node = node
            if self.queue.jobs[job.job].cancel_requested:  # the queue's: a cancel taken since it started
                node.request_stop("cancelled by the operator")
            self._current = current
            topic = topics.current_job(self.fed)
            self.kept.publish(transport, topic, self._seal(current.record(), topic))
            self._publish_list(transport)
            node.start()
            self._apply_roster(node)  # the roster it holds (e.g. adopted while the job was queued, or resumed)

        self.loop.post(begin)
        self.loop.run(until=lambda: node.finished or self.stopping.is_set() or self.error is not None)
        self.node = None
        if node.finished:
            self._end(job, cfg, node, out, transport)
        elif self.stopping.is_set():  # SIGTERM (`systemctl stop`): the journal said nothing of the job left running
            self.stopped_during = job.job
            log.warning(
                "stopped with job %s running (%d rounds done): it resumes from its checkpoint when the cloud starts "
                "again",
                job.job,
                len(node.history),
            )
        idle = None if self.stopping.is_set() else self.bundle.monitoring.idle_heartbeat
        node.stop(idle)
        self._said_idle = idle is not None
        return True

    def _end(self, job: Job, cfg: RunConfig, node: CloudServer, out: Path, transport: Transport) -> None:
        """Record how ``job`` ended: its final model and summary (``on_end``), its state in the queue, no job in
        progress. Outputs that cannot be written (a full disk, a run folder made unwritable) fail the job with
        that reason: it is no success without its model, and the queue goes on (a crash here left it running,
        resumed and failed again at each restart). Its nodes hear it ended, and the privacy ledger releases what it
        reserved beyond its spending, once the queue holds that: a queue that cannot be written (a full disk) stops the
        cloud with the job still running for them and its reservation whole, resumed at its next start (before, they
        had left it: the resumed job waited for them without end; and its ledger entry, settled at the epsilon of the
        round it stopped in, stayed so: the resumed job's further rounds were never counted)."""
        ended = self.queue.get(job.job) or job
        state, reason = (
            ("cancelled", "cancelled by the operator")
            if ended.cancel_requested
            else ("failed", node.failed)
            if node.failed  # a stall, a failed cell, a handler's exception, a full disk (protocols.failures)
            else ("finished", "")
        )
        reason = reason or (node.stopped or "")
        if self.on_end is not None:  # a cancelled job's too: its summary says it stopped, and why
            try:
                self.on_end(ended, cfg, node, out)
            except OSError as exc:
                unwritten = f"cannot write its final model or summary in {out}: {exc}"
                log.error("job %s: %s", job.job, unwritten)
                state = "failed" if state == "finished" else state
                reason = f"{reason}; {unwritten}" if reason else unwritten
        figures = final_figures(node.history, node.resumed_from)
        try:
            self.queue.end(job.job, state, reason, node.cells_absent_at_start, figures)
        except JobQueueError as exc:  # its nodes were not told: started again, the cloud resumes the job with them
            log.error("job %s %s, which the job queue cannot record: the cloud stops (%s)", job.job, state, exc)
            raise  # (its reservation kept whole: the resumed job spends on)
        spent = [r["epsilon"] for r in node.history if r.get("epsilon") is not None]
        try:
            self.ledger.settle(job.job, spent[-1] if spent else 0.0)  # what it reserved beyond is released
        except LedgerError as exc:  # (a full disk) it keeps counting the whole reservation as spent: no overspending
            log.error("job %s: %s; the ledger keeps its whole reservation", job.job, exc)
        node.announce_end(reason if state == "failed" else None)  # its cells and devices leave the job now
        self.served.append(job.job)
        say_ended("cloud", job.job, state, reason if state != "cancelled" else None, figures)
        # no job in progress: a node (re)started now waits for the next one, not the one just ended
        self._current = None
        self.kept.publish(transport, topics.current_job(self.fed), b"")
        self._publish_list(transport)

    def _folder(self, job: str) -> Path:
        return (
            self.job_folder(job)
            if self.job_folder is not None
            else self.bundle.output_dir() / runfiles.JOB_FOLDERS / job
        )

    def _build(self, job: Job, current: CurrentJob, transport: Transport, resumed: bool) -> tuple[Any, Path, Any]:
        """The job's localized config, its run folder and its cloud server on ``transport``."""
        cfg = current.run_config(self.bundle)
        self._bounded = None  # (set by _cell_bounds when the roster bounds this job's cells)
        out = self._folder(job.job)
        run = {"output": str(out)}
        if job.init_from is not None:
            base = self.queue.get(job.init_from)
            model = self._folder(job.init_from) / runfiles.FINAL_MODEL
            if base is None or base.state != "finished" or not model.exists():
                raise JobError(
                    f"init_from: job {job.init_from!r} has no final model ({base.state if base else 'none'})"
                )
            run["init_model"] = str(model)
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update=run)})
        out.mkdir(parents=True, exist_ok=True)
        with writing(out / runfiles.CONFIG):  # mode 600: it may hold the broker password (a full disk: kept whole)
            write_durably(out / runfiles.CONFIG, cfg.to_toml().encode())
        parts = self.parts(cfg)  # ConfigError: e.g. init_from a model of another architecture
        node = build_cloud(
            cfg,
            transport,
            parts.algorithm,
            evaluator=parts.evaluator,
            output_dir=out,
            resume=(resumed or parts.resume) and (out / runfiles.CHECKPOINT).exists(),
            startup_wait=cfg.runtime.startup_wait,
            on_round=self.on_round,
            session=current.session,
            collect_cell_records=parts.collect_cell_records,  # a deployment's cells write on their own machines
            cell_bounds=parts.cell_bounds if parts.cell_bounds is not None else self._cell_bounds(cfg),
            availability=parts.availability,
            devices_recreated=parts.devices_recreated,
        )
        node.status_extra = self.twin.extra
        node.announce_end_later = True  # (once the queue holds it: _end)
        node.past_jobs = EndedJobs({j.session for j in self.queue.jobs.values() if j.state in ENDED})
        if parts.on_build is not None:
            parts.on_build(node)
        return cfg, out, node

    def _fail(self, job: Job, reason: str) -> None:
        """End ``job`` as failed before it started (nodes never saw it: nothing to tell them). Said once the queue
        holds it: a queue that cannot be written stops the cloud, the job left as the queue holds it (before, the log
        said "job J failed" of a job the queue never recorded, started again at the next start)."""
        try:
            self.queue.end(job.job, "failed", reason)
        except JobQueueError as exc:
            log.error(
                "job %s cannot start (%s), which the job queue cannot record: the cloud stops (%s)",
                job.job,
                reason,
                exc,
            )
            raise
        log.error("job %s failed: %s", job.job, reason)
        self.failed_at_start.append(job.job)
        try:  # its run folder says so too (`fedtier monitor RUN_DIR`, a script reading summary.json)
            out = self._folder(job.job)
            out.mkdir(parents=True, exist_ok=True)
            end = {"run": self.fed, "job": job.job, "config_hash": job.digest, "status": "failed", "failed": reason}
            write_durably(out / runfiles.SUMMARY, (json.dumps(end, indent=2) + "\n").encode(), private=False)
        except OSError as exc:
            log.error("job %s: cannot write its summary: %s", job.job, exc)
        transport = self.transport
        if transport is not None:
            self.loop.post(lambda: self._publish_list(transport))

    # ------------------------------------------------------------------ the roster (loop thread)
    def _adopt(self, roster: Roster, write: bool = True) -> None:
        """Take ``roster`` as the federation's membership: the next jobs are planned on its members."""
        if write and self.roster_path is not None:
            write_durably(self.roster_path, self._roster_bytes(roster), private=False)  # survives a power loss
        self.roster = roster
        if self.node is not None:
            self._apply_roster(self.node)
        members = {c: roster.members(c) for c in roster.cells}
        topo = self.bundle.topology
        if members != {c: list(topo.device_ids(c)) for c in topo.cell_ids()}:  # changed since provisioning
            self.bundle = self.bundle.model_copy(update={"topology": TopologySection(members=members)})
        log.info(
            "roster version %d: %d cells, %d devices", roster.version, len(members), sum(map(len, members.values()))
        )

    def _apply_roster(self, node: CloudServer) -> None:
        """What the roster says of the running job's cells: their keys (a cell's rotated identity, ``fedtier provision
        renew --identity``, replaces the one the cloud's keys file held: its old key, a leaked one say, signs nothing
        from then on), and those it revoked leave the job now (``CloudServer.revoke``)."""
        if self.roster is None:
            return
        if node.trust is not None:
            node.trust.learn({c: key for c, key in self.roster.cell_keys.items() if c in node.cells})
        if self._bounded is not None:  # a device revoked while the job runs no longer counts in its cell's bound
            node.cell_bounds = roster_cell_bounds(self.roster, *self._bounded)
        node.revoke(self.roster.revoked, f"revoked (roster version {self.roster.version})")

    def _roster_bytes(self, roster: Roster) -> bytes:
        assert self.trust is not None
        return sign_roster(roster, self.trust.sign)

    def _publish_roster(self, transport: Transport) -> None:
        if self.roster is not None and self.trust is not None:
            self.kept.publish(transport, roster_topic(self.fed), self._roster_bytes(self.roster))

    def _live(self) -> Transport | None:
        """The connection this cloud publishes on now: the running job's server's, or its own between jobs."""
        return self.node.transport if self.node is not None else self.transport

    def _on_roster(self, topic: str, data: bytes) -> None:
        """A roster on the broker: a newer one (the operator's, signed with this cloud's key by
        `fedtier provision`) is adopted; whatever else is left there (an older roster, one not signed by this cloud,
        junk, the record cleared) is replaced by this cloud's: the retained roster is how a node (re)started later
        learns who was revoked."""
        if self.trust is None:
            return
        roster: Roster | None = None
        try:
            roster = verify_roster(data, self.trust.verify, federation=self.fed) if data else None
        except RosterError as exc:
            log.warning("refused a roster: %s", exc)
        if roster is not None and (self.roster is None or roster.version > self.roster.version):
            self._adopt(roster)
            self.kept.last[topic] = data  # what the broker holds now is this cloud's roster
            return
        self.kept.on_record(self._live(), topic, data)  # (its own comes back equal; published first as it connects)

    def _previous(self, job: str) -> dict[str, str] | None:
        """How the job that ended last before ``job`` ended (said in ``job``'s record: a cell whose connection missed
        that job's ``finished`` record, which the job's server sent on its own connection, said it "stopped: the
        cloud moved on" of a job that finished)."""
        ended = [j for j in self.queue.jobs.values() if j.ended is not None and j.job != job]
        last = max(ended, key=lambda j: j.ended or 0.0, default=None)
        return None if last is None else ended_outcome(last.session, last.state, last.reason)

    def _publish_list(self, transport: Transport) -> None:
        topic = topics.job_list(self.fed)
        listing = self.queue.listing(MAX_JOB_RECORD_BYTES - LIST_ENVELOPE_BYTES)  # one its readers take whole
        self.kept.publish(transport, topic, self._seal({"jobs": listing, "at": time.time()}, topic))

    def _seal(self, record: dict[str, Any], topic: str) -> bytes:
        return seal_record(record, topic, self.trust.sign if self.trust is not None else None)
