"""The cloud runtime: round orchestration, deadlines, evaluation, metrics and checkpoints."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols.algorithms.base import CloudRole
from protocols.algorithms.outcome import Outcome, aggregated
from protocols.answers import Answers
from protocols.divergence import STALLED_ROUNDS
from protocols.failures import StallWatch, failed_reason, guarded
from protocols.jsonl import JsonlWriter
from protocols.records import TIERS
from protocols.rejections import Rejected
from protocols.round_text import nth
from protocols.session import EndedJobs, encode_manifest, new_session
from protocols.state import MAX_WAITING, publish_state
from protocols.status import between_jobs, decode_status, encode_status
from protocols.transport.base import TimerHandle, Transport
from protocols.wire import topics
from protocols.wire.messenger import Incoming, Messenger

from .cell_records import collector
from .checkpoint import CloudCheckpoint, Saved, repair_records, restore
from .parts import CellPresence, RoundCounts, old_report, report_refusal, resend_on_repeat, round_deadline
from .revocation import leave_round, refused_revoked, too_few_cells
from .round_record import Updates, divergence, end_figures, round_record, stall
from .telemetry import CloudTelemetry, send_finished

if TYPE_CHECKING:
    from protocols.wire.keys import Trust

log = logging.getLogger("fedtier.cloud")

Evaluator = Callable[[Mapping[str, np.ndarray]], dict[str, float]]
CellAvailability = Callable[[int], Iterable[str]]
"""``cloud round -> cells that may take part`` (cell-level participation; an unavailable cell is not planned)."""


class CloudServer:
    """Drives ``rounds`` cloud rounds over ``cells``; a round closes when every planned cell reported
    or ``cell_deadline`` passed. Waits, before its first round (round 0, or a resumed cloud's), until every cell says
    all its devices are online but those sitting its round out (participation: ``devices_away``), or ``startup_wait``
    seconds passed (0: start at once).

    ``cell_bounds``: the largest weight each cell's report may claim (the sum of its devices' bounds,
    :func:`protocols.bounds.cell_weight_bound`, times what ``CloudRole.weight_keys`` says); a report claiming
    more is refused. ``session``: the cloud session (a job's, ``protocols.jobs.job_session``; it wins over
    a checkpoint's); default a fresh one (or, resuming, the checkpoint's). ``max_stalled_rounds``,
    ``min_cells``: when the job fails for lack of progress
    (:class:`protocols.failures.StallWatch`). ``cell_records_path``: write every cell's aggregation records,
    from their telemetry, there (``cloud.cell_records``; a deployed cloud, whose cells write elsewhere).
    ``max_record_bytes``: rotate the records files past this size (``protocols.jsonl.JsonlWriter``).
    ``fail_on_cell_failure``: a cell's "failed" report (its handler raised) fails the job; off, the cell is
    left out of the round with its reason (``cells_failed``) and the stall rule decides. ``checkpoint_path``
    (``cloud.checkpoint``) with ``resume``: continue after the last round it closed (``devices_recreated``:
    a launcher that rebuilt its devices, whose state the role forgets). :meth:`revoke`: cells revoked mid-job."""

    live = False  # start() ran: a revocation acts on the rounds from then on, a stop request at once
    _awaiting_cells = False  # the open round planned nobody: its cells are away, it waits for one
    resumed_from: dict[str, Any] | None = None  # a resumed cloud: its checkpoint's round record (the last before)
    _stop_request: str | None = None  # request_stop's reason (an instance's own once set)
    _start_timer: TimerHandle | None = None  # the startup wait's end (cancelled once round 0 begins or the job ends)
    status_extra: Mapping[str, Any] = {}  # what its status records add (a service's instance)
    announce_end_later = False  # a federation's cloud: its end (state, record) said once its queue holds it
    past_jobs: EndedJobs | None = None  # a federation's cloud: the jobs that ended (an old report of one is no refusal)

    def __init__(
        self,
        transport: Transport,
        *,
        run: str,
        cells: list[str],
        role: CloudRole,
        rounds: int,
        cell_deadline: float,
        evaluator: Evaluator | None = None,
        eval_every: int = 1,
        metrics_path: str | Path | None = None,
        checkpoint_path: str | Path | None = None,
        resume: bool = False,
        startup_wait: float = 0.0,
        trust: Trust | None = None,
        max_message_bytes: int | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        availability: CellAvailability | None = None,
        devices_recreated: bool = False,
        cell_bounds: Mapping[str, float] | None = None,
        session: str | None = None,
        cell_records_path: str | Path | None = None,
        max_record_bytes: int | None = None,
        max_stalled_rounds: int = STALLED_ROUNDS,
        min_cells: int = 1,
        fail_on_cell_failure: bool = True,
    ) -> None:
        self.transport, self.loop, self.run = transport, transport.loop, run
        self.cells, self.role, self.rounds, self.cell_bounds = sorted(cells), role, rounds, cell_bounds
        self.cell_deadline, self.evaluator, self.eval_every = cell_deadline, evaluator, max(1, eval_every)
        self.startup_wait, self.on_round, self.availability = startup_wait, on_round, availability
        self.trust, self.fail_on_cell_failure = trust, fail_on_cell_failure
        self.checkpoint = CloudCheckpoint(Path(checkpoint_path)) if checkpoint_path else None
        saved = self.checkpoint.load() if resume and self.checkpoint is not None else None
        if saved is not None and metrics_path is not None:  # before the records file opens
            repair_records(Path(metrics_path), saved)
        self.telemetry = CloudTelemetry(transport, run, trust, metrics_path, max_record_bytes)
        self.messenger = Messenger(
            transport, run, "cloud", trust=trust, max_payload=max_message_bytes, on_reject=self.telemetry.on_reject
        )
        self.session = session or new_session()  # stamps this cloud's retained records (see protocols.session)
        self.messenger.session = self.session  # ... and, signed, every message it sends
        self.round, self.started, self.finished = 0, False, False
        self.stopped: str | None = None  # why the run ended before ``rounds`` (the role's stop_reason)
        self.failed: str | None = None  # why the job failed (it ended early; one-shot commands exit non-zero)
        self._fail_request: str | None = None  # a failure found while recording a round: fail after it
        self.stall = StallWatch(max_stalled_rounds, min_cells)
        self.failure_observers: list[Callable[[str], None]] = []  # get the reason the job failed
        self.cumulative, self.presence = {t: 0 for t in TIERS}, CellPresence(self.cells)
        self._timer: TimerHandle | None = None
        self._in_round, self.answers, self.counts = False, Answers("cell"), RoundCounts()
        self.planned: list[str] = []
        self._early: dict[str, tuple[str, Any]] = {}  # cell -> its report of ``round``, come before the round
        self.revoked: dict[str, str] = {}  # cell -> why it is out of the job (the federation revoked it)
        self.cells_absent_at_start: dict[str, str] = {}  # cell -> why the startup wait ended without it
        self.resumed = saved is not None
        if saved is not None:
            self._resume(saved, session is None, devices_recreated)
        self.cell_records = collector(transport, run, self.cells, cell_records_path, trust, max_record_bytes, self)

    def _resume(self, saved: Saved, own_session: bool, devices_recreated: bool) -> None:
        """Continue after the checkpoint's round (``cloud.checkpoint.restore``) and, unless the cloud was given its
        session (``own_session`` False), in the checkpoint's session (cells take the re-sent round in it;
        ``metrics.jsonl`` was repaired to end with that round before it opened)."""
        self.round = self.resumed_at = restore(saved, self.role, self.stall, self.cumulative, devices_recreated)
        self.resumed_from = saved.record if isinstance(saved.record, dict) else None
        if own_session and saved.session is not None:
            self.session = self.messenger.session = saved.session
        log.info("resumed from %s at round %s (session %s)", saved.path, nth(self.round), self.session)

    # ----------------------------------------------------------------- views of the parts
    @property
    def history(self) -> list[dict[str, Any]]:  # the round records so far (telemetry)
        return self.telemetry.history

    @property
    def observers(self) -> list[Callable[[dict[str, Any]], None]]:  # called with each record (monitor.exporter)
        return self.telemetry.observers

    @property
    def metrics(self) -> JsonlWriter:  # the round records' file (telemetry)
        return self.telemetry.metrics

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if not self.resumed:  # crash-consistent from the first round on: a checkpoint precedes any task
            self._checkpoint(None)
        self.transport.subscribe(topics.cell_reports(self.run), self._guard(self._on_report, "report handler"))
        self.transport.subscribe(topics.statuses(self.run), self._guard(self._on_status, "status handler"))
        if self.cell_records is not None:
            self.cell_records.start(lambda h: self._guard(h, "cell record handler"))
        status = topics.status(self.run, "cloud")
        extra = {"started": round(time.time(), 6)} if self.trust is not None else {}
        self.online = encode_status(  # (said again as the service's connection comes back)
            "online", topic=status, trust=self.trust, session=self.session, **extra, **self.status_extra
        )
        self.transport.publish(status, self.online, retain=True)
        self._started_wall, self.live = time.time(), True
        self._state("starting", waiting=[c for c in self.cells if not self.presence.ready[c]])
        if self.round < self.rounds:  # clear a "finished" record a previous run left on the broker
            self.transport.publish(topics.control(self.run), b"", retain=True)
            self._check_stop()
        if self.revoked and not self._enough_cells(sorted(self.revoked)):  # revoked before the job started
            return
        if self.round >= self.rounds or self.stopped:
            self.loop.post(self._finish)
            return
        if self.startup_wait > 0:
            self._start_timer = self.loop.call_later(self.startup_wait, self._guard(self._begin_once, "round start"))
        self.loop.post(self._guard(self._maybe_begin, "round start"))

    def _state(self, phase: str, waiting: Iterable[str] = (), **extra: Any) -> None:
        """Publish this cloud's retained current state (``protocols.state``): a monitor started mid-stall sees it."""
        publish_state(
            self.transport,
            self.run,
            "cloud",
            phase,
            trust=self.trust,
            waiting=waiting,
            round=self.round,
            rounds=self.rounds,
            started=round(self._started_wall, 3),
            **extra,
        )

    def _guard(self, fn: Callable[..., None], what: str) -> Callable[..., None]:
        """``fn`` as a handler or timer of this cloud: an exception in it (a bug) fails the job."""
        return guarded(fn, self.fail, f"cloud: {what}")

    def stop(self, idle_heartbeat: float | None = None) -> None:
        """Say offline (retained), disconnect; with ``idle_heartbeat`` (a long-lived cloud's job ended) idle instead."""
        self.loop.cancel(self._timer)
        self.loop.cancel(self._start_timer)
        if self.transport.connected:
            between_jobs(
                self.transport, topics.status(self.run, "cloud"), self.trust, idle_heartbeat, **self.status_extra
            )
            if self.finished:  # the job is over: its session (the node's next connection) drops the job's topics
                for pattern in topics.cloud_job_patterns(self.run):
                    self.transport.unsubscribe(pattern)
            self.transport.close()
        self.telemetry.close()
        if self.cell_records is not None:
            self.cell_records.close()

    def _on_status(self, topic: str, data: bytes) -> None:
        node = topic.rsplit("/", 1)[-1]
        if not node.startswith("cell."):
            return
        cell, record = node[len("cell.") :], decode_status(data, topic, self.trust)
        if cell not in self.presence.ready or cell in self.revoked or record is None:
            return
        if record["state"] == "online" and record.get("session", self.session) != self.session:
            return  # serving another job (e.g. the retained status of a killed run's cell): not ready for this one
        renewed = self.presence.heard(cell, record, self.loop.now())  # online anew: its task or report may be lost
        if renewed and self.counts.renewal(cell, self.round, self._awaited()):
            self.tasks_again([cell])
        if self._awaiting_cells and self._in_round and self.presence.online[cell]:
            log.info("cloud: %s came online: round %s planned again", cell, nth(self.round))
            self.loop.cancel(self._timer)
            self._begin_round()
        self._maybe_begin()

    def _maybe_begin(self) -> None:
        ready = all(r or c in self.revoked for c, r in self.presence.ready.items())
        if not self.started and (self.startup_wait <= 0 or ready):
            self._begin_once()

    def _begin_once(self) -> None:
        """Begin the first round; the cells that the startup wait ended without are the job's absent at start."""
        if not self.started and not self.finished and self.round < self.rounds:  # (done: its finish is posted)
            self.started = True
            self.loop.cancel(self._start_timer)  # (it holds this server: a --serve cloud's loop outlives the job)
            if self.startup_wait > 0:
                absent = {c: self.presence.absence(c, self.startup_wait) for c in self.cells if c not in self.revoked}
                self.cells_absent_at_start = {c: why for c, why in absent.items() if why is not None}
            self._begin_round()

    # ----------------------------------------------------------------- rounds
    def _begin_round(self) -> None:
        self._send_tasks([c for c in self.cells if self._plannable(c)])
        self.answers.open((self.round,), self.planned)
        self._in_round = True
        r = self.round
        early, self._early = self._early, {}
        for topic, msg in early.values():
            self._take_report(topic, msg)
        if not self._in_round or self.round != r:  # every cell had reported already
            return
        # nobody planned: a round no cell may join closes at once; one whose cells are all away (a cloud
        # up before its cells) waits up to the deadline for one to come online (_on_status plans it)
        self._awaiting_cells = not self.planned and self.counts.expected > 0 and self.startup_wait > 0
        if not self.planned and not self._awaiting_cells:
            self.loop.post(self._guard(lambda: self._close(r, "no cells"), "round close"))
        else:
            round_deadline(self, r, "deadline" if self.planned else "no cells")

    def _plannable(self, cell: str) -> bool:
        """Not revoked, and online (or no startup wait), or offline less than ``cell_deadline`` (CellPresence)."""
        if cell in self.revoked:
            return False
        if self.startup_wait <= 0:
            return True
        return self.presence.plannable(cell, self.loop.now(), self.cell_deadline, self.round)

    def _send_tasks(self, candidates: list[str]) -> None:
        """Start counting the next round record; plan the ``candidates`` that may take part; send their tasks."""
        allowed = self._allowed()
        self.counts = RoundCounts(self.loop.now(), time.perf_counter(), expected=len(allowed))
        self.counts.tasks = plan = self.role.plan(self.round, [c for c in candidates if c in allowed])
        self.planned = sorted(plan)
        manifest = topics.round_manifest(self.run)
        self.transport.publish(
            manifest, encode_manifest(self.session, self.round, topic=manifest, trust=self.trust), retain=True
        )
        for cell in self.planned:
            self._send_task(cell)
        self.counts.since = time.time()
        self._state("waiting", self.planned, since=self.counts.since, deadline_s=self.cell_deadline)

    def _send_task(self, cell: str, again: bool = False) -> None:
        """Send ``cell`` its task of the open round (``again``: one it lost, counted apart: retransmission)."""
        topic, task = topics.cell_task(self.run, cell), self.counts.tasks[cell]
        nbytes = self.messenger.send(topic, "cell_task", task, round=self.round, cell=cell)
        tally = self.counts.resent if again else self.counts.bytes
        tally["cloud_to_cell"] = tally.get("cloud_to_cell", 0) + nbytes

    def _allowed(self) -> set[str]:
        """The cells that may take part in this round: available (cell participation) and not revoked."""
        allowed = set(self.availability(self.round)) if self.availability else set(self.cells)
        return (allowed & set(self.cells)) - self.revoked.keys()

    def _on_report(self, topic: str, data: bytes) -> None:
        if refused_revoked(self.revoked, topic, self.messenger):
            return
        msg, cell = self.messenger.receive(topic, data, kinds=("cell_report",), repeats=True), topic.split("/")[-2]
        if msg is None or old_report(self.past_jobs, cell, msg, self.session if self.trust is not None else None):
            return  # (an old report of an ended job, handed back by the broker: said once, at info)
        if msg.repeat:  # handled before: a restarted cell that may lack its task (or a repeat, refused)
            resumed = self.resumed and self.round == self.resumed_at  # its first round since it resumed
            if resend_on_repeat(self.counts, self.messenger, msg, self.round, self._awaited(), resumed):
                self._send_task(cell, again=True)
            return
        if not self._in_round and not self.finished and msg.header.round == self.round and cell in self.cells:
            # a resumed cloud: what cells reported while it was down (their sessions kept it) comes before
            # it re-opens the round; the same message again would be a duplicate, so it is kept (one per cell)
            log.info("cloud: report of %s for round %s before the round opened: kept for it", cell, nth(self.round))
            self._early[cell] = (topic, msg)
            return
        self._take_report(topic, msg)

    def _take_report(self, topic: str, msg: Incoming) -> None:
        h, cell = msg.header, topic.split("/")[-2]
        taken = len(self.answers.received)
        refused = self._bad_report(cell, msg)
        failure = failed_reason(msg.payload)
        if refused is None:
            payload = None if failure is not None else msg.payload
            refused = self.answers.offer(cell, h.sender, (h.round,), payload, self.role.check)
        if refused is not None:
            self.messenger.reject(topic, refused.kind, str(refused), cell)
            return
        if failure is not None:  # the cell's own handler raised (a bug)
            if self.fail_on_cell_failure:  # the job cannot go on as planned
                self.fail(f"cell {cell} failed in round {nth(h.round)}: {failure}")
                return
            log.error("cloud: cell %s failed in round %s: %s (left out of the round)", cell, nth(h.round), failure)
            self.counts.cells_failed[cell] = failure  # settled: answered, nothing to aggregate
            if not self.answers.pending:
                self._close(self.round, "all reported")
            return
        if len(self.answers.received) == taken:
            return  # a repeat counts once
        self.counts.devices[cell] = self._count(cell, msg)
        if not self.answers.pending:
            self._close(self.round, "all reported")
        elif len(self.answers.pending) <= MAX_WAITING:  # the tail of a round: name whom it still waits for
            self._state("waiting", self.answers.pending, since=self.counts.since, deadline_s=self.cell_deadline)

    def _awaited(self) -> set[str]:  # the cells the open round still waits for (none between rounds)
        return self.answers.pending if self._in_round else set()

    def tasks_again(self, cells: Iterable[str] | None = None) -> None:
        """The awaited cells (of ``cells``) get their tasks again: a connection came back, a task may be lost."""
        awaited = self._awaited()
        for cell in sorted(awaited if cells is None else awaited & set(cells)):
            self._send_task(cell, again=True)

    def _bad_report(self, cell: str, msg: Incoming) -> Rejected | None:
        """Runtime checks before the role sees a report (:func:`cloud.parts.report_refusal`)."""
        return report_refusal(cell, msg, self.session if self.trust is not None else None, self.cell_bounds, self.role)

    def _count(self, cell: str, msg: Incoming) -> int:
        """Add a taken report's figures to the round (:meth:`RoundCounts.count`); its device count."""
        return self.counts.count(cell, msg.nbytes, msg.payload.meta, getattr(self.cell_bounds, "cell_of", None))

    def _close(self, rnd: int, why: str) -> None:
        if not self._in_round or rnd != self.round:
            return
        self._in_round = False
        self.loop.cancel(self._timer)
        reports = dict(sorted(self.answers.received.items()))
        absent = sorted(self.answers.pending | (set(self.planned) & self.revoked.keys()))  # revoked: planned, out
        self.answers.close()
        outcome = aggregated(self.role, self.round, reports)
        self._record_round(why, sorted(reports), absent, outcome, [(c, r.tensors) for c, r in reports.items()])

    def _record_round(
        self, why: str, reported: list[str], absent: list[str], outcome: Outcome, updates: Updates, unit: str = "round"
    ) -> None:
        """Write, publish and checkpoint the record of the model update (``unit``) that just happened (from
        ``updates``: named if it diverged, evaluated or not), then go on."""
        for tier in TIERS:
            self.cumulative[tier] += self.counts.bytes[tier]
        evaluation: dict[str, float] = {}
        if self.evaluator is not None and ((self.round + 1) % self.eval_every == 0 or self.round + 1 == self.rounds):
            evaluation = self.evaluator(self.role.global_params())
        diverged, failure = divergence(self, evaluation, updates, unit)
        stalled = stall(self.stall, self.round, reported, self.counts, self.round + 1 == self.rounds, self.telemetry)
        failed = self._fail_request = self._fail_request or failure or stalled
        record = round_record(self, why, reported, absent, outcome, evaluation, diverged=diverged, failed=failed)
        self.telemetry.log_round(record, self.rounds)
        self._state("idle")
        self.telemetry.emit(record)
        self._checkpoint(record)
        if self.on_round is not None:
            self.on_round(record)
        self.round += 1
        if failed is not None:
            self.fail(failed, self.round - 1)
        elif self.round < self.rounds and not self._check_stop():
            self.loop.post(self._guard(self._begin_round, "round start"))
        else:
            self._finish()

    # ----------------------------------------------------------------- revocation
    def revoke(self, cells: Iterable[str], why: str = "revoked") -> None:
        """The federation revoked these cells (its signed roster; a node that is no cell of the job is ignored):
        their keys are forgotten, so what they send is refused (``RejectKind.REVOKED``, listed in the next
        record), they are never planned again, and the open round neither waits for them nor keeps a report
        they sent before it closed: it closes as for a dead cell (at once if every other planned cell
        answered). With fewer cells left than ``min_cells`` the job fails. Records list them (``cells_revoked``)."""
        new = sorted(c for c in set(cells) if c in self.presence.ready and c not in self.revoked)
        if not new:
            return
        if self.trust is not None:
            self.trust.forget(new)
        for cell in new:
            self.revoked[cell] = why
            self._early.pop(cell, None)
        log.warning("cloud: %s %s: no longer planned, what they send is refused", ", ".join(new), why)
        if self.live and not self.finished and self._enough_cells(new):
            self._leave_round(new)
            self._maybe_begin()  # a startup wait no longer waits for them

    def _enough_cells(self, new: list[str]) -> bool:
        """Whether the cells left once ``new`` are revoked can still meet ``min_cells``; else the job fails."""
        why = too_few_cells(self.cells, self.revoked, self.stall.min_cells, new)
        if why is not None:
            self.fail(why)
        return why is None

    def _leave_round(self, cells: list[str]) -> None:
        """The revoked ``cells`` leave the open round (``revocation.leave_round``): closed if it waits for none."""
        if not self._in_round:
            return
        leave_round(self.answers, self.counts, cells)
        self.counts.expected = len(self._allowed())
        if self.planned and not self.answers.pending:
            self._close(self.round, "all reported" if self.answers.received or self.answers.settled else "revoked")

    def _checkpoint(self, record: dict[str, Any] | None) -> None:
        """Save the state after round ``self.round`` (before round 0: -1) and its ``record``, before the next tasks."""
        if self.checkpoint is not None:
            done = self.round if record is not None else self.round - 1
            self.checkpoint.save_role(done, self.session, self.cumulative, self.stall.stalled, self.role, record)

    def request_stop(self, reason: str) -> None:
        """End the run cleanly after the current round (e.g. from ``on_round``: a target accuracy reached), or
        at once while it still waits for its cells to start; ``reason`` becomes the run's ``stopped``."""
        self._stop_request = reason
        if self.live and not self.started and not self.finished:  # in the startup wait (fedtier cancel): no round
            self.started = True  # no round begins
            self._check_stop()
            self.loop.post(self._finish)

    def _check_stop(self) -> str | None:
        """Whether the role forbids the next round (e.g. a privacy budget) or a caller asked to (logged)."""
        self.stopped = self._stop_request or self.role.stop_reason(self.round)
        if self.stopped:
            say = log.info if self._stop_request else log.warning
            say("stopping before round %s of %d: %s", nth(self.round), self.rounds, self.stopped)
        return self.stopped

    def fail(self, reason: str, rnd: int | None = None) -> None:
        """End the job now as failed with ``reason`` (logged; ``failed`` in the ``finished`` record, the summary
        and the metrics): a stalled job, a failed cell, a handler's error; ``rnd``: its round, found as it closed."""
        if self.finished:
            return
        log.error("cloud: the job fails in round %s: %s", nth(self.round if rnd is None else rnd), reason)
        self.failed = reason
        self._in_round = False
        self.loop.cancel(self._timer)
        self.answers.close()
        for observe in self.failure_observers:
            observe(reason)
        self._finish()

    @property
    def job_status(self) -> str:
        """``finished`` (every round), ``stopped`` (a budget, a target: not an error) or ``failed``."""
        return "failed" if self.failed else "stopped" if self.stopped else "finished"

    def _finish(self) -> None:
        self.finished = True
        self.loop.cancel(self._start_timer)
        if not self.announce_end_later:
            self.announce_end()

    def announce_end(self, failed: str | None = None) -> None:
        """The job's end, retained: its state and ``finished`` record (its nodes leave it); ``failed``: why."""
        failed, figures = self.failed or failed, end_figures(self.history)  # (a monitor opened after the end)
        phase, accuracy, loss = "failed" if failed else self.job_status, figures.get("accuracy"), figures.get("loss")
        self._state(phase, reason=failed or self.stopped, accuracy=accuracy, loss=loss)
        send_finished(self.messenger, self.run, self.round, self.session, self.stopped, failed)
