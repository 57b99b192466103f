"""The cell runtime: membership and liveness, edge rounds with deadlines, the aggregation log.

All algorithm logic lives in the cell role; this class decides *when* (a round closes when every planned device
answered, a quorum did, or the deadline passed) and records *what happened*. What any cell server is (presence,
heartbeat, records, the cloud's session) is :class:`~cell_server.cell_node.CellNode`; this class adds the rounds, their
state in parts (``cell_server.parts``: the open edge round, the cloud round's tally). Recovery, secure aggregation and
the open edge round's liveness (``cell_server.edge_liveness``) drive it through their declared ``Host`` interfaces.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

from protocols.algorithms.base import CellRole
from protocols.algorithms.outcome import Outcome, aggregated
from protocols.answers import Answers, content_refusal
from protocols.divergence import diverged_reason
from protocols.failures import failed_payload, failed_reason
from protocols.params import sums_on
from protocols.rejections import Rejected, RejectKind, kind_of
from protocols.round_text import nth, nth_edge
from protocols.state import MAX_WAITING
from protocols.transport.base import TimerHandle, Transport
from protocols.wire import topics
from protocols.wire.payload import Payload

from . import edge_liveness
from .cell_node import Availability, CellNode, NodeOptions
from .liveness import StatusChange
from .parts import EdgeRound, RoundTally
from .recovery import RoundJournal, already_taken, journaled_job, recover
from .telemetry import edge_record

if TYPE_CHECKING:
    from protocols.privacy.secagg import SecAggSettings
    from protocols.wire.messenger import Incoming

    from .secagg import CellSecAgg

log = logging.getLogger("fedtier.cell")

TIMING = (RejectKind.STALE, RejectKind.LATE)
"""Refusals of when an answer came, not of what it holds."""

__all__ = ["Availability", "CellServer"]


class CellServer(CellNode):
    """One cell's edge server: synchronous edge rounds (its node, presence and records: :class:`CellNode`,
    whose keyword arguments ``node`` are).

    ``role``: the algorithm's cell role (``algorithm``: its name, in the records); ``availability``: which
    devices may take part in an edge round (participation). ``secagg``: aggregate with secure aggregation
    (``cell_server/secagg.py``; ``secagg_deadline`` per extra phase). ``journal_path``: where the cell keeps
    its current round crash-consistently (``cell_server.recovery``; not with ``secagg``); with ``resume`` it
    continues the round found there when it starts, else it starts afresh.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        role: CellRole,
        algorithm: str,
        availability: Availability | None = None,
        secagg: SecAggSettings | None = None,
        secagg_deadline: float = 30.0,
        journal_path: str | Path | None = None,
        resume: bool = False,
        **node: Unpack[NodeOptions],
    ) -> None:
        super().__init__(transport, **node)
        self.role, self.algorithm, self.availability = role, algorithm, availability
        self._waiting: set[str] = set()  # participating devices this edge round waits for
        self._unknown: set[str] = set()  # ... and those whose first status it waits for
        self._gave_up: set[str] = set()  # ... and those it waited for in vain this cloud round
        self._wait_timer: TimerHandle | None = None
        self.edge_round, self.in_round, self.answers = 0, False, Answers("device")
        self._early: dict[str, tuple[tuple[int, int], str, bytes]] = {}  # results before their edge round opened
        self.edge, self.tally = EdgeRound(), RoundTally()  # the open edge round, the open cloud round
        self._timer: TimerHandle | None = None  # the open edge round's deadline
        self.secagg, self._result_kinds = self._secure_aggregation(secagg, secagg_deadline)
        self.sent_report: bytes | None = None  # the report of ``round``, once sent (re-sent on request)
        self.journal = RoundJournal(journal_path) if journal_path is not None else None
        self._recovered = self.journal.load(resume) if self.journal is not None else []
        self.journaled = journaled_job(self._recovered)

    def _secure_aggregation(
        self, settings: SecAggSettings | None, deadline: float
    ) -> tuple[CellSecAgg | None, tuple[str, ...]]:
        """Secure aggregation's runtime part (with ``settings``) and the kinds of message a result topic carries."""
        if settings is None:
            return None, ("device_result",)
        from protocols.privacy.secagg import KINDS

        from .secagg import CellSecAgg

        return CellSecAgg(self, settings, deadline), ("device_result", *KINDS)

    # ----------------------------------------------------------------- views of the open edge round
    @property
    def planned(self) -> list[str]:
        """The devices the open edge round planned."""
        return self.edge.planned

    @property
    def absent(self) -> dict[str, str]:
        """The open edge round's devices without a result, and why."""
        return self.edge.absent

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the node (:meth:`CellNode.start`), then continue the round its journal holds, if any."""
        super().start()
        if self._recovered:
            recover(self, self._recovered)
            self._recovered = []

    def _taking_part(self) -> Iterable[str] | None:
        return self.availability(self._participation_round(), self.edge_round) if self.availability else None

    def _on_failure(self) -> None:
        """A failed cell answers its current round with its failure (and every later task, as it comes)."""
        if self.in_round:
            self._end_round()
            self._send_failure(self.round)

    def waiting_state(self) -> None:
        """Publish the open edge round's state: waiting, for whom, since when."""
        self._state(
            "waiting",
            self.answers.pending,
            since=self.edge.since,
            edge_round=self.edge_round,
            deadline_s=self.limits.device_deadline,
        )

    def _send_failure(self, rnd: int) -> None:
        assert self.failure is not None
        self._state("failed", reason=self.failure)
        topic = topics.cell_report(self.run, self.cell)
        self.sent_report = self.messenger.frame(
            "cell_report", failed_payload(self.failure), round=rnd, cell=self.cell, topic=topic
        )
        self.transport.publish(topic, self.sent_report, qos=1)

    def stop(self, idle_heartbeat: float | None = None) -> None:
        """Cancel the round's timers, stop the node (:meth:`CellNode.stop`), close the journal."""
        self.loop.cancel(self._timer)
        self.loop.cancel(self._wait_timer)
        super().stop(idle_heartbeat)
        if self.journal is not None:
            self.journal.close()

    def _device_status(self, device: str, change: StatusChange) -> None:
        """A device's status: the edge round's liveness (:mod:`cell_server.edge_liveness`), which may let it plan."""
        edge_liveness.on_status(self, device, change)
        awaited = device in self._unknown or (change.online and device in self._waiting)
        self._unknown.discard(device)
        if change.online:
            self._waiting.discard(device)
        if awaited and not self._waiting and not self._unknown:
            self._plan_edge(self.round, self.edge_round)

    def _device_revoked(self, device: str) -> None:
        edge_liveness.revoked(self, device)

    def _device_stale(self, device: str) -> None:
        edge_liveness.gone(self, device, 0.0)  # silent for heartbeat_timeout already: out of the round now

    # ----------------------------------------------------------------- rounds
    def _on_cell_task(self, topic: str, data: bytes) -> None:
        msg = self._cloud_task(topic, data)
        if msg is None:
            return
        if self._new_cloud_session(msg):  # its rounds count from the start
            if self.in_round:
                self._end_round()
            self.round, self.sent_report = -1, None
        if msg.header.round == self.round:  # a resumed cloud re-sends the round: answer it again, once
            self._again(topic, msg.header.round)
            return
        if self._stale_task(topic, msg):
            return
        if self.in_round:
            moved = f"round {nth(self.round)} abandoned, the cloud moved on to {nth(msg.header.round)}"
            log.warning("cell %s: %s", self.cell, moved)
            self._end_round()
        if self.failure is not None:  # a failed cell does no work: it answers the round with its failure
            self.round, self.messenger.session = msg.header.round, msg.header.session
            self._send_failure(msg.header.round)
            return
        try:
            self.role.begin(msg.header.round, msg.payload)
        except Exception as exc:  # a task the role cannot use must not take the cell down
            self.messenger.reject(topic, kind_of(exc), f"cell task refused: {exc}", msg.header.sender)
            return
        if self.journal is not None:
            try:  # a full disk, an unwritable folder: no round it could not resume; its failure answers this one
                seed = getattr(self.role, "noise_seed", None)
                self.journal.task(msg.header.round, msg.header.session, msg.payload, seed, self.cloud.pinned)
            except OSError as exc:  # (before: only the next round's task, the cloud waiting a cell deadline)
                self.fail(f"cell {self.cell}: cannot journal round {nth(msg.header.round)}'s task: {exc}")
                self.round, self.messenger.session = msg.header.round, msg.header.session
                self._send_failure(msg.header.round)
                return
        self.enter_round(msg.header.round, msg.header.session)
        self.start_edge()

    def enter_round(self, rnd: int, session: str | None) -> None:
        """Take up cloud round ``rnd`` of cloud session ``session`` (the role has begun it)."""
        self.edge_round, self.in_round, self.sent_report = 0, True, None
        self._take_round(rnd)
        self.messenger.session = session  # device tasks and the report belong to it
        self.tally = RoundTally()
        self._gave_up = set()

    def _again(self, topic: str, rnd: int) -> None:
        """The task of the round this cell has or is working on: re-send the report if it was sent (the
        same message: the cloud counts it once), else carry on (the report leaves when the round closes)."""
        if self.in_round:
            log.info("cell %s: task for round %s again, still working on it", self.cell, nth(rnd))
        elif self.sent_report is not None:
            log.warning("cell %s: round %s's task again (its report lost?): re-sending its report", self.cell, nth(rnd))
            self.transport.publish(topics.cell_report(self.run, self.cell), self.sent_report, qos=1)

    def _end_round(self) -> None:
        self.loop.cancel(self._timer)
        self.loop.cancel(self._wait_timer)
        self._waiting, self._unknown = set(), set()
        self.in_round = False
        self.answers.close()
        if self.secagg is not None:
            self.secagg.cancel()

    def start_edge(self) -> None:
        """Open an edge round: first wait (up to ``rejoin_wait``) for offline devices that take part, and
        (within ``status_wait`` of the start) for the first status of those not heard of yet."""
        self.edge = EdgeRound(t0=self.loop.now(), wall0=time.perf_counter())
        self.edge.allowed = set(self.availability(self.round, self.edge_round)) if self.availability else None
        allowed = self.edge.allowed
        self._waiting = self.liveness.offline(allowed or ()) - self._gave_up if self.timing.rejoin_wait > 0 else set()
        left = self._started + self.timing.status_wait - self.loop.now()
        self._unknown = self.liveness.unheard(self.devices if allowed is None else allowed) if left > 0 else set()
        wait = max(self.timing.rejoin_wait if self._waiting else 0.0, left if self._unknown else 0.0)
        if wait > 0:
            if self._unknown:
                log.info(
                    "cell %s: edge round %s waits up to %.1f s for the first status of %d devices",
                    self.cell,
                    nth_edge(self.round, self.edge_round),
                    wait,
                    len(self._unknown),
                )
            self._wait_timer = self.loop.call_later(
                wait, self._guard(lambda r=self.round, e=self.edge_round: self._plan_edge(r, e), "edge round start")
            )
        else:
            self._plan_edge(self.round, self.edge_round)

    def _plan_edge(self, rnd: int, edge_round: int) -> None:
        if not self.in_round or (rnd, edge_round) != (self.round, self.edge_round) or self.edge.opened:
            return  # a wait of a round that is over, or already planned
        self.edge.opened = True
        self.loop.cancel(self._wait_timer)
        self._gave_up |= self._waiting
        self._waiting, self._unknown = set(), set()
        allowed = self.edge.allowed
        taking_part = self.devices if allowed is None else self.devices.among(allowed)
        self.edge.sit_out(self.devices, taking_part, self.limits.absent_ids)
        available = []
        for d in taking_part:
            why = self.liveness.unavailable(d)
            if why is None:
                available.append(d)
            else:
                self.edge.absent[d] = why
                if d in self.liveness.unmet or d in self.liveness.unfit:  # the report says why none could serve
                    self.tally.unmet[d] = why
                elif why == "offline":
                    self.tally.offline.add(d)
        if self.journal is not None:
            self.journal.plan(self.edge_round, available, self.edge.absent, self.edge.not_participating)
        self.open_edge(self.role.plan(self.edge_round, available), available)

    def open_edge(
        self,
        plan: Mapping[str, Payload],
        available: list[str],
        taken: Mapping[str, Payload] | None = None,
        settled: Iterable[str] = (),
    ) -> None:
        """Send the edge round's tasks (not to devices whose result is ``taken`` already, or that answered
        with nothing to aggregate, ``settled``: a resumed cell) and wait for the answers until the quorum
        or the deadline."""
        taken, settled = taken or {}, set(settled)
        self.edge.planned = sorted(plan)
        self.edge.tasks = plan
        for d in available:
            if d not in plan:
                self.edge.absent[d] = "not selected"
        for d in self.edge.planned:
            if d not in taken and d not in settled:
                self.send_task(d)
        self.answers.open((self.round, self.edge_round), self.edge.planned)
        if self._early:
            self.loop.post(self._guard(self._take_early, "early results"))
        for d, result in taken.items():
            self.answers.received[d] = result
            self.answers.pending.discard(d)
        for d in settled & self.answers.pending:
            self.answers.settled.add(d)
            self.answers.pending.discard(d)
        if self.secagg is not None:
            self.secagg.begin(self.edge.planned)
        self.edge.needed = math.ceil(self.limits.quorum * len(self.edge.planned))
        self.edge.since = time.time()
        if self.answers.pending:
            self.waiting_state()
        r, e = self.round, self.edge_round
        guard = self._guard
        if not self.edge.planned:
            self.loop.post(guard(lambda: self.close_edge(r, e, "no devices"), "edge round close"))
        elif (taken or settled) and (why := self.closing()) is not None:
            self.loop.post(guard(lambda: self.close_edge(r, e, why), "edge round close"))
        else:
            self._timer = self.loop.call_later(
                self.limits.device_deadline, guard(lambda: self.close_edge(r, e, "deadline"), "edge round deadline")
            )

    def send_task(self, device: str, again: bool = False) -> None:
        """Send ``device`` its task of the open edge round (``again``: a resend, its bytes counted apart)."""
        nbytes = self.messenger.send(
            topics.device_task(self.run, self.cell, device),
            "device_task",
            self.edge.tasks[device],
            round=self.round,
            edge_round=self.edge_round,
            cell=self.cell,
            shared=self.edge.shared(self.edge.tasks[device]),
        )
        if again:
            self.edge.bytes_resent += nbytes
        else:
            self.edge.bytes_out += nbytes

    def _on_result(self, topic: str, data: bytes) -> None:
        msg = self.messenger.receive(topic, data, kinds=self._result_kinds)
        if msg is None:
            return
        h, device = msg.header, topic.split("/")[-2]
        if self.secagg is not None and h.kind != "device_result":
            refused = self._bad_result(device, msg)  # the session of signed runs, the weight bound
            if refused is not None:
                self.messenger.reject(topic, refused.kind, str(refused), device)
            else:
                self.secagg.on_message(topic, device, msg)
            return
        taken = len(self.answers.received) + len(self.answers.settled)
        diverged = diverged_reason(msg.payload)
        failed = failed_reason(msg.payload)
        refused = self._bad_result(device, msg)
        settle = diverged is not None or failed is not None  # answered, with nothing to aggregate
        if refused is None:
            check = self.secagg.check if self.secagg is not None else self.role.check
            refused = self.answers.offer(
                device, h.sender, (h.round, h.edge_round), None if settle else msg.payload, check
            )
        if refused is not None:
            early = refused.kind is RejectKind.STALE
            if early and (refused := self._keep_early(device, msg, (topic, data), refused, settle)) is None:
                return
            self.messenger.reject(topic, refused.kind, str(refused), device)
            if self.answers.is_open and device in self.answers.pending and refused.kind not in TIMING:
                # (its reason without its id: counted with the others')
                self.tally.rejected[device] = f"{refused.kind.value}: {str(refused).replace(device, 'DEVICE')}"
            return
        if len(self.answers.received) + len(self.answers.settled) == taken:
            return  # a repeat of an answer already taken counts once
        if self.journal is not None:
            self.journal.result(self.edge_round, device, msg)
        if diverged is not None or failed is not None:  # recorded, never aggregated (its task raised: with why)
            what = "diverged in round" if diverged is not None else "failed its task"
            log.warning(
                "cell %s: %s %s %s: %s", self.cell, device, what, nth_edge(h.round, h.edge_round), diverged or failed
            )
        self.edge.take(device, msg.payload, msg.nbytes, diverged, failed)
        why = self.closing()
        if why is not None:
            self.close_edge(self.round, self.edge_round, why)
        elif len(self.answers.pending) <= MAX_WAITING:  # the tail of a round: name whom it still waits for
            edge_liveness.waiting_soon(self)  # (once for results that come together)

    def _keep_early(
        self, device: str, msg: Incoming, message: tuple[str, bytes], stale: Rejected, settle: bool
    ) -> Rejected | None:
        """Keep a result of this cell's device for the next edge round or the first of the next round, to take
        when that round opens (:meth:`_take_early`): a restarted cell between rounds whose devices kept the task
        of the cell before it (their persistent sessions) and answered it. Refused, it was lost: the device
        answers the task again only with the same message, which the transport drops as a repeat, and the round
        waited for its deadline without it. The latest per device, its content checked now once this cell opened
        a round (model-sized: not held until its round for what would be refused then) and again when taken.
        ``None`` when kept, or taken before a restart (``recovery.already_taken``), else why it is refused:
        ``stale`` (another round, or not this cell's device), or what its content fails (``settle``)."""
        if already_taken(self.journal, self.cell, device, msg):  # delivered again: said, not refused
            return None
        h = msg.header
        key = (h.round, h.edge_round)
        if key <= (self.round, self.edge_round) or h.round > self.round + 1 or self.devices.position(device) is None:
            return stale
        if self.answers.is_open or self.answers.closed is not None:  # else no round's model yet to check against
            check = self.secagg.check if self.secagg is not None else self.role.check
            refused = content_refusal(device, None if settle else msg.payload, check)
            if refused is not None:
                return refused
        self.messenger.forget(h)  # read again when taken
        self._early[device] = (key, *message)
        log.info("cell %s: %s answered round %s before it opened: kept for it", self.cell, device, nth_edge(*key))
        return None

    def _take_early(self) -> None:
        """Take the kept results of the edge round that just opened (those of a later one stay kept)."""
        now, early, self._early = (self.round, self.edge_round), self._early, {}
        for device, (key, topic, data) in sorted(early.items()):
            if key == now and self.in_round:
                self._on_result(topic, data)
            elif key > now:
                self._early[device] = (key, topic, data)

    def closing(self) -> str | None:
        """Why the open edge round closes now (every planned device answered, or a quorum did); None: it waits."""
        if not self.answers.pending:
            return "all answered"
        return "quorum" if len(self.answers.received) >= self.edge.needed else None

    def close_edge(self, rnd: int, edge_round: int, why: str) -> None:
        if not self.in_round or (rnd, edge_round) != (self.round, self.edge_round):
            return  # a timer of a round that already closed
        self.loop.cancel(self._timer)
        results = dict(sorted(self.answers.received.items()))
        for d in self.answers.pending:  # cut off by the quorum, or late for the deadline
            self.edge.absent[d] = "quorum" if why == "quorum" else "deadline"
            self.tally.late.add(d)
        self.answers.close()
        if self.secagg is not None:  # masked results: unmask the sum first (it calls _aggregate)
            self.secagg.unmask(results, why)
            return
        self._aggregate(why, results)

    def _aggregate(self, why: str, results: dict[str, Payload], extra: dict[str, Any] | None = None) -> None:
        """Fold the edge round's results into the cell role, record it, and go on to the next one."""
        with sums_on(self.sums):
            outcome = aggregated(self.role, self.edge_round, results).with_metrics(**(extra or {}))
        for device, result in results.items() if self.secagg is None else ():  # (masked: the cell sees no update)
            self.tally.weigh(device, result)
        self.tally.add(self.edge.bytes_out, self.edge.bytes_in, results, self.edge.diverged, self.edge.failed)
        self._record(why, outcome, list(results))
        self.edge_round += 1
        if self.edge_round < self.role.edge_rounds:
            self.start_edge()
        else:
            self.send_report()

    def _record(self, why: str, outcome: Outcome, answered: list[str]) -> None:
        """Record the closed edge round (journaled first)."""
        record = edge_record(
            self.edge,
            outcome,
            self.loop.now(),
            self.limits.absent_ids,
            run=self.run,
            round=self.round,
            edge_round=self.edge_round,
            cell=self.cell,
            algorithm=self.algorithm,
            answered=answered,
            rejected=self.telemetry.rejected,
            closed_by=why,
            deadline_s=self.limits.device_deadline,
        )
        if self.journal is not None:
            self.journal.closed(self.edge_round, record)
        self.telemetry.emit(record)

    def send_report(self) -> None:
        """The cloud round is over: send its report (the role's, with the tally's figures), journaled first."""
        self._end_round()
        report = self.role.report()
        self.tally.annotate(report.meta, self.liveness.online.count())
        topic = topics.cell_report(self.run, self.cell)
        self.sent_report = self.messenger.frame("cell_report", report, round=self.round, cell=self.cell, topic=topic)
        if self.journal is not None:
            self.journal.report(self.sent_report)
        self.transport.publish(topic, self.sent_report, qos=1)
        self._state("idle")
