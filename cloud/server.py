"""The cloud runtime: round orchestration, deadlines, evaluation, metrics and checkpoints."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from protocols.algorithms.base import CloudRole
from protocols.algorithms.outcome import Outcome
from protocols.answers import Answers
from protocols.bounds import weight_over
from protocols.checkpoint import load_payload, save_payload
from protocols.divergence import STALLED_ROUNDS
from protocols.failures import StallWatch, failed_reason, guarded, merge_counts
from protocols.jsonl import JsonlWriter, read_jsonl
from protocols.records import MAX_LISTED_REJECTIONS, RoundRecord
from protocols.rejections import Rejected, RejectKind
from protocols.session import encode_manifest, new_session
from protocols.state import MAX_WAITING, publish_state
from protocols.status import decode_status, encode_status
from protocols.transport.base import TimerHandle, Transport
from protocols.wire import topics
from protocols.wire.messenger import Incoming, Messenger
from protocols.wire.payload import Payload
from protocols.wire.signed import seal_record

from .cell_records import CellRecordCollector

if TYPE_CHECKING:
    from protocols.wire.keys import Trust

log = logging.getLogger("fedtier.cloud")

Evaluator = Callable[[Mapping[str, np.ndarray]], dict[str, float]]
CellAvailability = Callable[[int], Iterable[str]]
"""``cloud round -> cells that may take part`` (cell-level participation; an unavailable cell is not planned)."""
TIERS = ("cloud_to_cell", "cell_to_cloud", "cell_to_device", "device_to_cell")


def repair_metrics(path: Path, next_round: int, record: dict[str, Any] | None) -> None:
    """Make ``metrics.jsonl`` end with the checkpointed round: drop records of rounds a resumed cloud
    runs again, and add the checkpoint's own record if the crash came before it was written."""
    if not path.exists():
        return
    kept = [r for r in read_jsonl(path) if isinstance(r.get("round"), int) and r["round"] < next_round]
    if record is not None and not any(r["round"] == record.get("round") for r in kept):
        kept.append(record)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)


class CloudServer:
    """Drives ``rounds`` cloud rounds over ``cells``; a round closes when every planned cell reported
    or ``cell_deadline`` passed. Waits, before round 0, until every cell says all its devices are
    online, or ``startup_wait`` seconds passed (0: start at once)."""

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
        """``cell_bounds``: the largest weight each cell's report may claim (the sum of its devices' bounds
        times the results a report adds up, :func:`protocols.bounds.cell_weight_bound`); a report claiming
        more is refused. ``session``: the cloud session (a job's, ``protocols.jobs.job_session``; it wins over
        a checkpoint's); default a fresh one (or, resuming, the checkpoint's). ``max_stalled_rounds``,
        ``min_cells``: when the job fails for lack of progress
        (:class:`protocols.failures.StallWatch`). ``cell_records_path``: write every cell's aggregation records,
        from their telemetry, there (``cloud.cell_records``; a deployed cloud, whose cells write elsewhere).
        ``max_record_bytes``: rotate the records files past this size (``protocols.jsonl.JsonlWriter``).
        ``fail_on_cell_failure``: a cell's "failed" report (its handler raised) fails the job; off, the cell is
        left out of the round with its reason (``cells_failed``) and the stall rule decides."""
        self.transport, self.loop, self.run = transport, transport.loop, run
        self.cell_bounds = cell_bounds
        self.cells, self.role, self.rounds = sorted(cells), role, rounds
        self.cell_deadline, self.evaluator, self.eval_every = cell_deadline, evaluator, max(1, eval_every)
        self.checkpoint_path = Path(checkpoint_path) if checkpoint_path else None
        self.trust = trust
        self.messenger = Messenger(
            transport, run, "cloud", trust=trust, max_payload=max_message_bytes, on_reject=self._on_reject
        )
        self.startup_wait, self.on_round = startup_wait, on_round
        self.availability = availability
        self.session = session or new_session()  # stamps this cloud's retained records (see protocols.session)
        self.messenger.session = self.session  # ... and, signed, every message it sends
        self.round = 0
        self.finished = False
        self.stopped: str | None = None  # why the run ended before ``rounds`` (the role's stop_reason)
        self._stop_request: str | None = None  # request_stop's reason
        self.failed: str | None = None  # why the job failed (it ended early; one-shot commands exit non-zero)
        self._fail_request: str | None = None  # a failure found while recording a round: fail after it
        self.stall = StallWatch(max_stalled_rounds, min_cells)
        self.fail_on_cell_failure = fail_on_cell_failure
        self.started = False
        self.history: list[dict[str, Any]] = []
        self.observers: list[Callable[[dict[str, Any]], None]] = []  # get each round record (monitor.exporter)
        self.failure_observers: list[Callable[[str], None]] = []  # get the reason the job failed
        self.cumulative = {t: 0 for t in TIERS}
        self.cell_ready: dict[str, bool] = {c: False for c in self.cells}
        self.cell_online: dict[str, bool] = {c: False for c in self.cells}
        self._offline_since: dict[str, float] = {}  # cell -> loop time it went offline (after being online)
        self._timer: TimerHandle | None = None
        self._in_round = False
        self.answers = Answers("cell")
        self._early: dict[
            str, tuple[str, Any]
        ] = {}  # cell -> its report of ``round`` that came before the round opened
        self._rejected: list[dict[str, str]] = []
        self._rejected_more = 0
        self.resumed = False
        if resume and self.checkpoint_path and self.checkpoint_path.exists():
            state = load_payload(self.checkpoint_path)
            self.role.load_state(Payload(state.meta.get("role", {}), state.tensors))
            if devices_recreated:  # a launcher that rebuilt its devices (fedtier sim / run --resume)
                self.role.forget_devices()
            self.round = int(state.meta["round"]) + 1
            self.cumulative.update(state.meta.get("cumulative", {}))
            stalled = state.meta.get("stalled", 0)
            if isinstance(stalled, int) and 0 < stalled < self.stall.max_rounds:
                self.stall.stalled, self.stall.first = stalled, self.round - stalled
            if session is None and isinstance(state.meta.get("session"), str):  # cells take the re-sent round
                self.session = self.messenger.session = state.meta["session"]
            self.resumed = True
            if metrics_path is not None:
                repair_metrics(Path(metrics_path), self.round, state.meta.get("record"))
            log.info("resumed from %s at round %d (session %s)", self.checkpoint_path, self.round, self.session)
        self.metrics = JsonlWriter(metrics_path, max_record_bytes)
        self.cell_records = (
            CellRecordCollector(transport, run, self.cells, cell_records_path, trust, max_record_bytes)
            if cell_records_path is not None
            else None
        )

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
        self.transport.publish(
            status, encode_status("online", topic=status, trust=self.trust, session=self.session, **extra), retain=True
        )
        self._started_wall = time.time()
        self._state("starting", waiting=[c for c in self.cells if not self.cell_ready[c]])
        if self.round < self.rounds:  # clear a "finished" record a previous run left on the broker
            self.transport.publish(topics.control(self.run), b"", retain=True)
            self._check_stop()
        if self.round >= self.rounds or self.stopped:
            self.loop.post(self._finish)
            return
        self._start_at = self.loop.now()
        if self.startup_wait > 0:
            self.loop.call_later(self.startup_wait, self._guard(self._begin_once, "round start"))
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

    def stop(self) -> None:
        self.loop.cancel(self._timer)
        if self.transport.connected:
            status = topics.status(self.run, "cloud")
            self.transport.publish(status, encode_status("offline", topic=status, trust=self.trust), retain=True)
            self.transport.close()
        self.metrics.close()
        if self.cell_records is not None:
            self.cell_records.close()

    def _on_status(self, topic: str, data: bytes) -> None:
        node = topic.rsplit("/", 1)[-1]
        if not node.startswith("cell."):
            return
        cell, record = node[len("cell.") :], decode_status(data, topic, self.trust)
        if cell not in self.cell_ready or record is None:
            return
        online = record["state"] == "online"
        if self.cell_online[cell] and not online:
            self._offline_since[cell] = self.loop.now()
        elif online:
            self._offline_since.pop(cell, None)
        self.cell_online[cell] = online
        self.cell_ready[cell] = self.cell_online[cell] and record.get("devices_online") == record.get("devices_total")
        self._maybe_begin()

    def _maybe_begin(self) -> None:
        if not self.started and (self.startup_wait <= 0 or all(self.cell_ready.values())):
            self._begin_once()

    def _begin_once(self) -> None:
        if not self.started:
            self.started = True
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
        if not self.planned:
            self.loop.post(self._guard(lambda: self._close(r, "no cells"), "round close"))
        else:
            self._timer = self.loop.call_later(
                self.cell_deadline, self._guard(lambda: self._close(r, "deadline"), "round deadline")
            )

    def _plannable(self, cell: str) -> bool:
        """Online (or no startup wait), or offline for less than ``cell_deadline``: a cell that just died
        is likely restarting, and its persistent session keeps the task for it (a cell gone for good
        delays one round, to the deadline)."""
        if self.cell_online[cell] or self.startup_wait <= 0:
            return True
        gone = self._offline_since.get(cell)
        if gone is None or self.loop.now() - gone >= self.cell_deadline:
            return False
        log.info(
            "cloud: round %d plans %s, offline for %.1f s: its session keeps the task",
            self.round,
            cell,
            self.loop.now() - gone,
        )
        return True

    def _send_tasks(self, candidates: list[str]) -> None:
        """Start counting the next round record; plan the ``candidates`` that may take part; send their tasks."""
        self._t0, self._wall0 = self.loop.now(), time.perf_counter()
        self._bytes = {t: 0 for t in TIERS}
        self._cell_devices: dict[str, int] = {}
        self._cell_diverged: dict[str, int] = {}
        self._cell_failed: dict[str, int] = {}
        self._failures: dict[str, int] = {}  # reason -> devices whose task failed, over the cells
        self._unmet: dict[str, int] = {}  # reason -> devices left out for the job's requirements
        self._cells_failed: dict[str, str] = {}  # cell -> why it failed (fail_on_cell_failure off)
        allowed = set(self.availability(self.round)) if self.availability else set(self.cells)
        self._expected = len(allowed & set(self.cells))  # cells that may answer: a stall is fewer than this
        plan = self.role.plan(self.round, [c for c in candidates if c in allowed])
        self.planned = sorted(plan)
        manifest = topics.round_manifest(self.run)
        self.transport.publish(
            manifest, encode_manifest(self.session, self.round, topic=manifest, trust=self.trust), retain=True
        )
        for cell in self.planned:
            self._bytes["cloud_to_cell"] += self.messenger.send(
                topics.cell_task(self.run, cell), "cell_task", plan[cell], round=self.round, cell=cell
            )
        self._round_since = time.time()
        self._state("waiting", self.planned, since=self._round_since, deadline_s=self.cell_deadline)

    def _on_report(self, topic: str, data: bytes) -> None:
        msg = self.messenger.receive(topic, data, kinds=("cell_report",))
        if msg is None:
            return
        cell = topic.split("/")[-2]
        if not self._in_round and not self.finished and msg.header.round == self.round and cell in self.cells:
            # a resumed cloud: what cells reported while it was down (their sessions kept it) comes before
            # it re-opens the round; the same message again would be a duplicate, so it is kept (one per cell)
            log.info("cloud: report of %s for round %d before the round opened: kept for it", cell, self.round)
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
                self.fail(f"cell {cell} failed in round {h.round}: {failure}")
                return
            log.error("cloud: cell %s failed in round %d: %s (left out of the round)", cell, h.round, failure)
            self._cells_failed[cell] = failure  # settled: answered, nothing to aggregate
            if not self.answers.pending:
                self._close(self.round, "all reported")
            return
        if len(self.answers.received) == taken:
            return  # a repeat counts once
        self._cell_devices[cell] = self._count(cell, msg)
        if not self.answers.pending:
            self._close(self.round, "all reported")
        elif len(self.answers.pending) <= MAX_WAITING:  # the tail of a round: name whom it still waits for
            self._state("waiting", self.answers.pending, since=self._round_since, deadline_s=self.cell_deadline)

    def _bad_report(self, cell: str, msg: Incoming) -> Rejected | None:
        """Runtime checks before the role sees a report: it is for the cell of its topic, in signed runs
        signed by that cell in this cloud's session, and its weight within the cell's bound."""
        h = msg.header
        if h.cell != cell:
            return Rejected(RejectKind.WRONG_SENDER, f"report for cell {h.cell!r} on the topic of cell {cell!r}")
        if self.trust is not None and (h.sender != cell or h.session != self.session):
            if h.sender == cell:
                return Rejected(
                    RejectKind.SIGNATURE, f"report of session {h.session!r}, this cloud's is {self.session!r}"
                )
            return Rejected(RejectKind.WRONG_SENDER, f"report signed by {h.sender!r} on the topic of cell {cell!r}")
        bound = self.cell_bounds.get(cell) if self.cell_bounds is not None else None
        if bound is None:
            return None
        over = weight_over(msg.payload.meta.get("weight"), bound, f"the bound of cell {cell} ({bound:g} samples)")
        return Rejected(RejectKind.BOUND, over) if over is not None else None

    def _count(self, cell: str, msg: Incoming) -> int:
        """Add a taken report's bytes (and the device traffic and diverged devices it declares) to the round;
        its device count."""
        self._bytes["cell_to_cloud"] += msg.nbytes
        traffic = msg.payload.meta.get("traffic", {})
        for tier in ("cell_to_device", "device_to_cell"):
            value = traffic.get(tier, 0) if isinstance(traffic, dict) else 0
            self._bytes[tier] += int(value) if isinstance(value, (int, float)) and value >= 0 else 0
        devices, diverged = (msg.payload.meta.get(k, 0) for k in ("devices", "diverged"))
        if isinstance(diverged, int) and not isinstance(diverged, bool) and diverged > 0:
            self._cell_diverged[cell] = diverged
        failed = msg.payload.meta.get("failed_devices", 0)
        if isinstance(failed, int) and not isinstance(failed, bool) and failed > 0:
            self._cell_failed[cell] = failed
        merge_counts(self._failures, msg.payload.meta.get("failures"))
        merge_counts(self._unmet, msg.payload.meta.get("unmet"))
        return int(devices) if isinstance(devices, int) and devices >= 0 else 0

    def _on_reject(self, topic: str, kind: RejectKind, reason: str, sender: str | None) -> None:
        if len(self._rejected) < MAX_LISTED_REJECTIONS:
            self._rejected.append({"from": sender or topic, "kind": kind.value, "reason": reason})
        else:
            self._rejected_more += 1

    def _close(self, rnd: int, why: str) -> None:
        if not self._in_round or rnd != self.round:
            return
        self._in_round = False
        self.loop.cancel(self._timer)
        reports, absent = dict(sorted(self.answers.received.items())), sorted(self.answers.pending)
        self.answers.close()
        self._record_round(why, sorted(reports), absent, self.role.aggregate(self.round, reports))

    def _record_round(self, why: str, reported: list[str], absent: list[str], outcome: Outcome) -> None:
        """Write, publish and checkpoint the record of the model update that just happened, then go on."""
        role_metrics = dict(outcome.metrics)
        excluded = outcome.excluded or None  # robust aggregation: cells left out, why
        epsilon = outcome.epsilon  # differential privacy: spent so far
        by_party, basis = outcome.epsilon_by_party, outcome.epsilon_basis  # ... against each party, and why
        for tier in TIERS:
            self.cumulative[tier] += self._bytes[tier]
        evaluation: dict[str, float] = {}
        if self.evaluator is not None and ((self.round + 1) % self.eval_every == 0 or self.round + 1 == self.rounds):
            evaluation = self.evaluator(self.role.global_params())
        diverged = self._diverged(evaluation)
        self._stalled(reported)
        failed = self._fail_request
        record = RoundRecord(
            run=self.run,
            round=self.round,
            rounds=self.rounds,
            closed_by=why,
            cells_planned=self.planned,
            cells_reported=reported,
            cells_absent=absent,
            cells_failed=self._cells_failed or None,
            devices=self._cell_devices,
            devices_diverged=self._cell_diverged or None,
            devices_failed=self._cell_failed or None,
            failures=self._failures or None,
            rejected=self._rejected,
            rejected_more=self._rejected_more or None,
            bytes=dict(self._bytes),
            cumulative_bytes=dict(self.cumulative),
            clock_start_s=round(self._t0, 6),
            clock_s=round(self.loop.now(), 6),
            **evaluation,
            excluded=excluded,
            epsilon=epsilon if epsilon is not None and np.isfinite(epsilon) else None,
            epsilon_by_party=by_party,
            epsilon_basis=basis,
            diverged=diverged,
            failed=failed,
            metrics=role_metrics,
            duration_s=round(time.perf_counter() - self._wall0, 6),
            time=round(time.time(), 3),
        ).to_dict()
        self._rejected, self._rejected_more = [], 0  # the next record lists what is refused from now on
        self._log_round(record)
        self._state("idle")
        self.history.append(record)
        self.metrics.write(record)
        for observe in self.observers:
            observe(record)
        topic = topics.telemetry_cloud(self.run)  # signed in signed runs: a reader with the keys checks it
        self.transport.publish(topic, seal_record(record, topic, self.trust.sign if self.trust else None), qos=0)
        self._checkpoint(record)
        if self.on_round is not None:
            self.on_round(record)
        self.round += 1
        if failed is not None:
            self.fail(failed)
        elif self.round < self.rounds and not self._check_stop():
            self.loop.post(self._guard(self._begin_round, "round start"))
        else:
            self._finish()

    def _log_round(self, record: dict[str, Any]) -> None:
        """One info line per round: what an operator watching the cloud's log needs."""
        accuracy = record.get("accuracy")
        log.info(
            "cloud: round %d/%d closed (%s): cells %d/%d answered, devices %d%s, accuracy %s, %s bytes, %.2f s",
            record["round"],
            self.rounds,
            record["closed_by"],
            len(record["cells_reported"]),
            len(record["cells_planned"]),
            sum(record["devices"].values()),
            f" (failed {sum(record['devices_failed'].values())})" if record.get("devices_failed") else "",
            f"{accuracy:.4f}" if isinstance(accuracy, float) else "-",
            f"{sum(record['bytes'].values()):,}",
            record["duration_s"],
        )

    def _diverged(self, evaluation: dict[str, float]) -> str | None:
        """Drop the non-finite numbers of the global model's ``evaluation`` (in place) and, if there were any,
        ask the run to stop after this round: no later round can bring a diverged model back. Returns what
        was dropped, for the record."""
        bad = sorted(k for k, v in evaluation.items() if isinstance(v, float) and not np.isfinite(v))
        if not bad:
            return None
        why = ", ".join(f"{k} = {evaluation.pop(k)}" for k in bad)
        log.error(
            "round %d: the global model diverged (%s): the job fails after this round (a learning rate too large?)",
            self.round,
            why,
        )
        self._fail_request = self._fail_request or f"the global model diverged at round {self.round} ({why})"
        return why

    def _stalled(self, reported: list[str]) -> None:
        """Count a round without progress (no cell answered, or every device that answered failed or
        diverged); after ``max_stalled_rounds`` of them in a row the job fails after this round."""
        aggregated = sum(self._cell_devices.get(c, 0) for c in reported)
        why = self.stall.observe(
            self.round,
            len(reported),
            self._expected,  # cell participation may leave a round to fewer cells, or none
            aggregated,
            self._failures,
            sum(self._cell_diverged.values()),
            self._unmet,
        )
        if why is not None:
            self._fail_request = self._fail_request or why

    def _checkpoint(self, record: dict[str, Any] | None) -> None:
        """Atomically save the state after round ``self.round`` (before round 0: -1) and its ``record``,
        before the next round's tasks leave: a cloud killed at any point resumes from the last round it
        closed, in the same session, and re-sends the round the cells may already be working on."""
        if self.checkpoint_path is None:
            return
        state = self.role.state()
        done = self.round if record is not None else self.round - 1
        meta = {
            "round": done,
            "session": self.session,
            "cumulative": self.cumulative,
            "role": state.meta,
            **({"stalled": self.stall.stalled} if self.stall.stalled else {}),
        }
        save_payload(self.checkpoint_path, Payload({**meta, "record": record} if record else meta, state.tensors))

    def request_stop(self, reason: str) -> None:
        """End the run cleanly after the current round (e.g. from ``on_round``: a target accuracy reached);
        ``reason`` becomes the run's ``stopped``."""
        self._stop_request = reason

    def _check_stop(self) -> str | None:
        """Whether the role forbids the next round (e.g. a privacy budget, protocols/privacy/dp.py) or a caller
        asked to stop (:meth:`request_stop`); logged."""
        self.stopped = self._stop_request or self.role.stop_reason(self.round)
        if self.stopped:
            (log.info if self._stop_request else log.warning)(
                "stopping before round %d of %d: %s", self.round, self.rounds, self.stopped
            )
        return self.stopped

    def fail(self, reason: str) -> None:
        """End the job now as failed with ``reason`` (logged; ``failed`` in the ``finished`` record, the summary
        and the metrics): a stalled job, a cell that failed, an exception in one of this cloud's handlers."""
        if self.finished:
            return
        log.error("cloud: the job fails at round %d: %s", self.round, reason)
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
        extra = {"stopped": self.stopped} if self.stopped else {}
        if self.failed:
            extra["failed"] = self.failed
        self._state(self.job_status, reason=self.failed or self.stopped)
        self.messenger.send(
            topics.control(self.run),
            "control",
            Payload({"event": "finished", "round": self.round, "session": self.session, **extra}),
            round=self.round,
            retain=True,
        )
