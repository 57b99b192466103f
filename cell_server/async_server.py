"""The cell runtime of ``algorithm.mode = "async"`` (FedBuff; the maths in ``protocols/algorithms/fedbuff.py``).

No edge rounds: every online, participating device always has a task. A device that answers gets the
current cell model at once; every K results the cell updates its model (one aggregation record each);
every M updates, or T seconds with unpushed progress, it pushes its progress to the cloud. Task headers
carry the cell model version (``round``) and the device's task number (``edge_round``, which also keys
its minibatch seeds); a result must answer the device's outstanding task, else it is rejected.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protocols.algorithms.fedbuff import FedBuffCell
from protocols.answers import sender_refusal
from protocols.divergence import STALLED_ROUNDS, diverged_reason
from protocols.failures import count_reasons, failed_payload, failed_reason
from protocols.params import sums_on
from protocols.records import BUFFER_FULL, MAX_LISTED_REJECTIONS, CellRecord
from protocols.rejections import Rejected, RejectKind, kind_of
from protocols.transport.base import TimerHandle, Transport
from protocols.wire import topics
from protocols.wire.messenger import Incoming

from .async_recovery import AsyncJournal, Resumed
from .edge_liveness import MAX_RESENDS
from .parts import EdgeRound, RoundTally
from .recovery import say_another_job
from .server import CellServer

log = logging.getLogger("fedtier.cell")


class AsyncCellServer(CellServer):
    """One cell's edge server in asynchronous mode (membership, liveness and records as :class:`CellServer`).
    ``journal_path``: where it keeps its cloud model and last push crash-consistently
    (``cell_server.async_recovery``); with ``resume`` it continues from there."""

    def __init__(
        self,
        transport: Transport,
        *,
        role: FedBuffCell,
        push_every: int = 1,
        push_seconds: float = 0.0,
        journal_path: str | Path | None = None,
        resume: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(transport, role=role, **kwargs)  # type: ignore[arg-type]
        self.fb = role
        self.push_every, self.push_seconds = push_every, push_seconds
        self.outstanding: dict[str, tuple[int, int]] = {}  # device -> (model version, task number) it works on
        self.task_no = {d: 0 for d in self.devices}
        self.lost: set[str] = set()  # devices whose last task went unanswered through a status flip
        self.resends: dict[str, tuple[int, int]] = {}  # device -> (cell version, tasks sent it on returns in it)
        self._failure_sent = False  # its "failed" push went (a failed cell sends it once, then on each version)
        self._unusable = 0  # device answers in a row that diverged or failed on this cloud version (none taken)
        self.held_back: set[str] = set()  # devices back once too often this version: their task comes with the next
        self._idle_timer: TimerHandle | None = None  # held-back devices get a task when it fires, if nothing else works
        self._push_timer: TimerHandle | None = None
        self._last_push: tuple[int, bytes] | None = None  # (cloud version it derives from, the message)
        self.refused: str | None = None  # why it refused to work (a restart without its journal)
        self.push_journal = AsyncJournal(journal_path) if journal_path is not None else None
        self._resumed = self.push_journal.load(resume) if self.push_journal is not None else None
        self.journaled = (self._resumed is not None, self._resumed.job if self._resumed is not None else None)
        self._window()

    def start(self) -> None:
        """Start the node, then continue from the journal, if any (:meth:`_resume`); its journaled cloud model is
        taken before the start announces the cell, so its first status says what it holds (no ``needs_model``: a
        cloud would send it the current version at once, as to a cell restarted afresh). A journal of another job than
        the one it is pinned to (``resumes`` false: its folder's namesake) is removed instead."""
        if self._resumed is not None and not self.resumes and self.push_journal is not None:
            say_another_job(self.cell, self.journaled[1], self.cloud.pinned)
            self._resumed = self.push_journal.load(False)  # (None; its versions still numbered past the journal's)
        if self._resumed is not None:
            self.fb.adopt(self._resumed.global_version, self._resumed.model)
            self.fb.version = self._resumed.version + 1
        super().start()
        if self._resumed is not None:
            self._resume(self._resumed)
            self._resumed = None

    def _window(self) -> None:
        """Start counting what the next aggregation record reports."""
        self.edge = EdgeRound(t0=self.loop.now(), wall0=time.perf_counter())
        self.dispatched: set[str] = set()

    def stop(self, idle_heartbeat: float | None = None) -> None:
        self.loop.cancel(self._push_timer)
        self.loop.cancel(self._idle_timer)
        super().stop(idle_heartbeat)
        if self.push_journal is not None:
            self.push_journal.close()

    def _resume(self, r: Resumed) -> None:
        """With the journaled cloud model adopted (:meth:`start`: the cell's versions numbered past every one a
        device task carried), send the last push again (a cloud that sent this cell a newer model since sends it
        again), and work."""
        log.warning(
            "cell %s: resumed at cloud model %d%s",
            self.cell,
            r.global_version,
            ", sending its last push again" if r.push is not None else "",
        )
        self._adopted(r.global_version, r.session, r.model, first=True)
        if r.push is not None:
            self.transport.publish(topics.cell_report(self.run, self.cell), r.push, qos=1)
            if r.push_base is not None:  # sent again if a resumed cloud sends this version again
                self._last_push = (r.push_base, r.push)

    # ----------------------------------------------------------------- cloud model
    def _on_cell_task(self, topic: str, data: bytes) -> None:
        msg = self._cloud_task(topic, data)
        if msg is None:
            return
        if self.failure is not None:  # a failed cell does no work: it answers the version with its failure
            self.messenger.session = msg.header.session
            self._send_failure(msg.header.round)
            return
        first = not self.fb.ready
        if first and self._refuse_restart(msg):
            return
        if not first and msg.header.round == self.fb.global_version and msg.header.session == self.messenger.session:
            self._held_again()
            return
        try:
            self.fb.adopt(msg.header.round, msg.payload.tensors)
        except (Rejected, ValueError) as exc:
            self.messenger.reject(
                topic, kind_of(exc, RejectKind.SHAPE), f"cloud model refused: {exc}", msg.header.sender
            )
            return
        used = self.push_journal.used if self.push_journal is not None else None
        if first and used is not None:  # started afresh over a journal: past every version a device task carried
            self.fb.version = max(self.fb.version, used + 1)
        self._adopted(msg.header.round, msg.header.session, msg.payload.tensors, first)
        if first:
            self._announce()  # no longer asking for a model (the cloud sends one to a cell that asks again)

    def _refuse_restart(self, msg: Incoming) -> bool:
        """A journaling cell (``fedtier cell``) without a journal whose first cloud model the cloud marked ``held``
        (it heard this cell hold one before: a restart): its devices had tasks of versions it cannot know, and
        refuse its tasks numbered below them as replays. It takes no model and says so: :attr:`refused`, its status
        (``refused``: ``fedtier fleet``), its state (failed, with the reason: the monitor) and a "failed" push, on
        which the cloud leaves it out of the job (``cloud.async_server``; again for each version the cloud sends it:
        a resumed cloud learns it too)."""
        held = msg.payload.meta.get("held") is True
        if not held or self.push_journal is None or self.push_journal.used is not None:
            return False
        if self.refused is None:
            self.refused = (  # what to do first: a failed push's reason is cut at MAX_REASON
                f"cell {self.cell} held a model of this job and restarted without its journal: restart it with its "
                f"journal and --resume (its devices would refuse its tasks as replays; {self.push_journal.file.path})"
            )
            log.error("%s", self.refused)
        self.messenger.session = msg.header.session  # the push belongs to the job's session (signed runs check)
        self._announce()
        self._state("failed", reason=self.refused)
        topic = topics.cell_report(self.run, self.cell)
        report = self.messenger.frame(
            "cell_report",
            failed_payload(self.refused, refused=True),
            round=msg.header.round,
            cell=self.cell,
            topic=topic,
        )
        self.transport.publish(topic, report, qos=1)
        return True

    def _unusable_answer(self, device: str, why: str) -> None:
        """``device`` answered with no usable result; it goes on, unless :data:`STALLED_ROUNDS` answers of each device
        in a row were so on this cloud version (a model that diverges every device, huge but finite: no version can
        come of this cell, and its devices would train on for ever): the cell fails, saying why (a "failed" push:
        the cloud fails the job, or leaves the cell out, ``runtime.fail_on_cell_failure``)."""
        self._unusable += 1
        if self._unusable < STALLED_ROUNDS * max(1, len(self.devices)) or self.failure is not None:
            self._dispatch(device)
            return
        self.failure = (
            f"every device diverged or failed on cloud version {self.fb.global_version}: {self._unusable} answers "
            f"in a row, none usable (the last {device}'s, {why[:100]})"
        )
        log.error("cell %s: %s", self.cell, self.failure)
        self._on_failure()

    def _held_again(self) -> None:
        """The cloud sent the version this cell holds again: a resumed cloud, whose buffer may have lost this cell's
        last push (taken by the broker, not yet journaled): that push goes again if it derives from this version (a
        cloud that has it counts it once)."""
        log.info("cell %s: cloud version %d again (a resumed cloud)", self.cell, self.fb.global_version)
        if self._last_push is not None and self._last_push[0] == self.fb.global_version:
            self.transport.publish(topics.cell_report(self.run, self.cell), self._last_push[1], qos=1)

    def _adopted(self, version: int, session: str | None, model: Mapping[str, np.ndarray], first: bool) -> None:
        """Cloud model ``version`` of ``session`` adopted: journal it; the first one sets the devices working."""
        self.round, self._unusable = version, 0
        self.messenger.session = session  # device tasks and pushes belong to it (signed runs check)
        if self.push_journal is not None:
            self.push_journal.adopted(version, session, model, self.fb.version, self.cloud.pinned)
        if first:
            self.tally = RoundTally()
            if self.push_seconds > 0:
                self._push_timer = self.loop.call_later(self.push_seconds, self._on_push_timer)
            for device in self.devices:
                self._dispatch(device)
        else:
            self._rearm()

    def _on_failure(self) -> None:
        """A handler raised (a bug): the cell does no more work (no task, result or push) and answers with a
        "failed" push, now if it holds a cloud model (once), else on the version that comes; the cloud fails the
        job with it, or leaves the cell out (``runtime.fail_on_cell_failure``: ``cloud.async_server``)."""
        self.loop.cancel(self._push_timer)
        if self.fb.ready and not self._failure_sent:
            self._failure_sent = True
            self._send_failure(self.fb.global_version)

    def _status_extra(self) -> dict[str, Any]:
        """A cell holding no cloud model says so: the cloud sends a cell that asks anew (restarted afresh, or
        started after the job's first version went out) the current version (``cloud.async_server``); one that
        refused to work, or failed, says why instead (it asks for nothing; the cloud takes it back once a restart
        says so no more)."""
        if self.refused is not None or self.failure is not None:
            return {"refused": self.refused or self.failure}
        return {} if self.fb.ready else {"needs_model": True}

    # ----------------------------------------------------------------- devices
    def _may_work(self, device: str) -> bool:
        if (
            self.failure is not None
            or not self.fb.ready
            or not self.online.get(device, False)
            or device in self.outstanding
        ):
            return False
        return self.availability is None or device in set(self.availability(max(self.round, 0), self.fb.version))

    def _dispatch(self, device: str) -> None:
        """Send ``device`` a task of the current cell model if it may work; one replacing a task it lost (back
        online without its result) is a resend: counted apart (``bytes_resent``) and bounded (:meth:`_may_resend`)."""
        if not self._may_work(device):
            return
        again = device in self.lost
        if again and not self._may_resend(device):
            return
        self.lost.discard(device)
        number = self.task_no[device]
        self.task_no[device] = number + 1
        self.outstanding[device] = (self.fb.version, number)
        self.dispatched.add(device)
        nbytes = self.messenger.send(
            topics.device_task(self.run, self.cell, device),
            "device_task",
            self.fb.task(),
            round=self.fb.version,
            edge_round=number,
            cell=self.cell,
        )
        if again:
            self.edge.bytes_resent += nbytes
        else:
            self.edge.bytes_out += nbytes

    def _may_resend(self, device: str) -> bool:
        """Whether ``device``, back online with its task lost, gets a new one now: at most ``MAX_RESENDS`` such
        tasks per cell model version (each costs a whole model: a device flipping its status with valid credentials
        gets no more); past that it is held back until the next version (:meth:`_rearm`), so an honest device
        that restarted still gets work, or, while the cell has no task outstanding at all (nothing would make that
        version: every device held back, offline or unavailable), until ``device_deadline`` passed so
        (:meth:`_on_idle`). So a lying device costs at most ``MAX_RESENDS`` + 1 tasks a cell version, and one more
        each ``device_deadline`` its cell has nothing else outstanding; an honest cell whose devices all flap in one
        version waits ``device_deadline``, then works on."""
        version, sent = self.resends.get(device, (self.fb.version, 0))
        sent = sent if version == self.fb.version else 0
        if sent >= MAX_RESENDS:
            if device not in self.held_back:
                log.warning(
                    "cell %s: %s is back again without its result: sent %d tasks on its returns at version %d, its "
                    "next comes with the next version (or once the cell had no task outstanding for device_deadline)",
                    self.cell,
                    device,
                    sent,
                    self.fb.version,
                )
                self.held_back.add(device)
            return False
        self.resends[device] = (self.fb.version, sent + 1)
        return True

    def _rearm(self) -> None:
        """A new cell model version: the devices held back (:meth:`_may_resend`) get a task of it."""
        held, self.held_back = sorted(self.held_back), set()
        for device in held:
            self._dispatch(device)

    def _watch_idle(self) -> None:
        """With devices held back and no task outstanding, wait ``device_deadline`` (:meth:`_on_idle`)."""
        if self.held_back and not self.outstanding and self._idle_timer is None and self.failure is None:
            self._idle_timer = self.loop.call_later(self.limits.device_deadline, self._guard(self._on_idle, "idle"))

    def _on_idle(self) -> None:
        """``device_deadline`` after the cell was left with no task outstanding but devices held back: if it still
        is, each of them may be sent one more task in this version (:meth:`_may_resend`), and is."""
        self._idle_timer = None
        if self.outstanding or not self.held_back or self.failure is not None:
            return
        log.warning(
            "cell %s: no task outstanding for %.0f s, devices held back after their returns: a task each again (%s)",
            self.cell,
            self.limits.device_deadline,
            ", ".join(sorted(self.held_back)),
        )
        for device in self.held_back:
            version, sent = self.resends.get(device, (self.fb.version, 0))
            if version == self.fb.version:
                self.resends[device] = (version, min(sent, MAX_RESENDS - 1))
        self._rearm()

    def _on_status(self, topic: str, data: bytes) -> None:
        node = topic.rsplit("/", 1)[-1]
        device = node[len("device.") :] if node.startswith("device.") else None
        was_online = self.online.get(device, False) if device else False
        super()._on_status(topic, data)
        if device is None or device not in self.online or self.online[device] == was_online:
            return
        if self.outstanding.pop(device, None) is not None:  # gone, or back (rejoined): its task is lost either way
            self.lost.add(device)
        if self.online[device]:
            self._dispatch(device)
        self._watch_idle()

    def _on_result(self, topic: str, data: bytes) -> None:
        msg = self.messenger.receive(topic, data, kinds=("device_result",))
        if msg is None or self.failure is not None:  # a failed cell takes no more results
            return
        h, device = msg.header, topic.split("/")[-2]
        # the device's own result (its session in signed runs, its weight bound)
        refused = sender_refusal("device", device, h.sender) or self._bad_result(device, msg)
        if refused is not None:
            self.messenger.reject(topic, refused.kind, str(refused), device)
            return
        if self.outstanding.get(device) != (h.round, h.edge_round):
            self.messenger.reject(
                topic,
                RejectKind.STALE,
                f"result for task {h.round}.{h.edge_round}, which is not the task outstanding for {device}",
                device,
            )
            return
        del self.outstanding[device]
        self.edge.bytes_in += msg.nbytes
        diverged = diverged_reason(msg.payload)
        if diverged is not None:  # recorded in the next record, never aggregated; the device goes on
            log.warning("cell %s: %s diverged on task %d.%d: %s", self.cell, device, h.round, h.edge_round, diverged)
            self.edge.diverged[device] = diverged
            self._unusable_answer(device, f"diverged: {diverged}")
            return
        failed = failed_reason(msg.payload)
        if failed is not None:  # its task raised: recorded with the reason in the next record; the device goes on
            log.warning("cell %s: %s failed task %d.%d: %s", self.cell, device, h.round, h.edge_round, failed)
            self.edge.failed[device] = failed
            self._unusable_answer(device, f"failed: {failed}")
            return
        try:
            self.fb.check(device, h.round, msg.payload)
        except Rejected as exc:  # too stale, or a bad result: logged in the next record; the device goes on
            self.messenger.reject(topic, exc.kind, str(exc), device)
        else:
            self.fb.offer(device, h.round, msg.payload)
            self._unusable = 0
            self.edge.note_loss(device, msg.payload)
            self.tally.weigh(device, msg.payload)
            if self.fb.buffer.full:
                self._flush()
        self._dispatch(device)
        self._watch_idle()

    # ----------------------------------------------------------------- aggregation and pushes
    def _flush(self) -> None:
        with sums_on(self.sums):
            out = self.fb.aggregate()
        pushing = self.fb.updates >= self.push_every
        if self.push_journal is not None and not pushing:  # before a task carries the new version (a push journals it)
            self.push_journal.updated(self.fb.version)
        metrics, answered = dict(out.metrics), list(out.senders)
        self.tally.traffic["cell_to_device"] += self.edge.bytes_out
        self.tally.traffic["device_to_cell"] += self.edge.bytes_in
        self._record_async(metrics, answered)
        if pushing:
            self._push()
        self._rearm()

    def _record_async(self, metrics: dict[str, Any], answered: list[str]) -> None:
        losses = list(self.edge.losses.values())
        mean = sum(losses) / len(losses) if losses else None
        now = self.loop.now()
        record = CellRecord(
            run=self.run,
            round=max(self.round, 0),
            edge_round=self.fb.version,
            cell=self.cell,
            algorithm=self.algorithm,
            planned=sorted(self.dispatched),
            answered=sorted(set(answered)),
            rejected=self.telemetry.rejected,
            closed_by=BUFFER_FULL,
            bytes_in=self.edge.bytes_in,
            bytes_out=self.edge.bytes_out,
            bytes_resent=self.edge.bytes_resent or None,
            loss_mean=mean,
            duration_s=round(time.perf_counter() - self.edge.wall0, 6),
            clock_s=round(now - self.edge.t0, 6),
            clock_end_s=round(now, 6),
            time=round(time.time(), 3),
            metrics=metrics,
            diverged=self.edge.diverged or None,
            failed=dict(sorted(self.edge.failed.items())[:MAX_LISTED_REJECTIONS]) or None,
            failed_counts=count_reasons(self.edge.failed) or None,
        ).to_dict()
        self.telemetry.emit(record)
        self._window()

    def _push(self) -> None:
        report = self.fb.report()
        report.meta["traffic"] = dict(self.tally.traffic)
        self.tally.name_largest(report.meta)
        self.tally = RoundTally()
        topic = topics.cell_report(self.run, self.cell)
        message = self.messenger.frame("cell_report", report, round=self.fb.global_version, cell=self.cell, topic=topic)
        if self.push_journal is not None:  # journaled before it leaves: a resumed cell sends it again
            self.push_journal.pushed(message, self.fb.version)
        self._last_push = (self.fb.global_version, message)
        self.transport.publish(topic, message, qos=1)

    def _on_push_timer(self) -> None:
        if self.failure is not None:
            return
        if self.fb.updates > 0:
            self._push()
        self._push_timer = self.loop.call_later(self.push_seconds, self._on_push_timer)
