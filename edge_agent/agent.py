"""The device runtime: receives tasks from its cell, runs the device role, publishes the result."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from protocols.algorithms.base import DeviceContext, DeviceRole, train_role
from protocols.divergence import diverged_reason, diverged_result, nonfinite
from protocols.failures import failed_payload, failed_reason
from protocols.rejections import Rejected, RejectKind
from protocols.round_text import nth, nth_edge
from protocols.status import IDLE, beat_stamp, encode_status, order_stamp
from protocols.trainer import LocalData, Trainer
from protocols.transport.base import Transport
from protocols.wire import topics
from protocols.wire.envelope import Header, Segments
from protocols.wire.messenger import Messenger, Received
from protocols.wire.payload import Payload

if TYPE_CHECKING:
    from protocols.privacy.secagg import SecAggSettings
    from protocols.session import CloudSession
    from protocols.wire.keys import Trust

    from .secagg import DeviceSecAgg

log = logging.getLogger("fedtier.agent")

REANSWERS = 3
"""How many times a device sends its kept result again for the same task (a cell restarted that often
within one edge round); beyond, the task is refused as a replay (an unsigned run's forgeries cannot make a
device send its result without end)."""


class Executor(Protocol):
    """Runs a device's training elsewhere: ``done(result, None)`` or ``done(None, error)`` later, on
    the device's loop. ``wire``: the task's payload bytes as received, where known (an executor that sends
    the task to another process sends them rather than encoding ``task`` again)."""

    def submit(
        self,
        device: str,
        task: Payload,
        ctx: DeviceContext,
        done: Callable[[Payload | None, str | None], None],
        wire: Received | None = None,
    ) -> None: ...


class Trainee(Protocol):
    """What an executor needs of a device agent to train its task (:class:`DeviceAgent` is one)."""

    device: str
    role: DeviceRole
    data: LocalData
    trainer: Trainer

    def train_here(self, task: Payload, ctx: DeviceContext) -> tuple[Payload | None, str | None]: ...


class DeviceAgent:
    """One device. Announces itself online (retained; its will says offline), then answers tasks."""

    def __init__(
        self,
        transport: Transport,
        *,
        run: str,
        cell: str,
        device: str,
        role: DeviceRole,
        data: LocalData,
        trainer: Trainer,
        seed: int,
        trust: Trust | None = None,
        max_message_bytes: int | None = None,
        on_task: Callable[[int, int], None] | None = None,
        compute_delay: Callable[[str, Payload], float] | None = None,
        cloud: CloudSession | None = None,
        secagg: SecAggSettings | None = None,
        keep_answer: bool = False,
        caps: Mapping[str, Any] | None = None,
        instance: str | None = None,
        versioned: bool = False,
    ) -> None:
        """``compute_delay(device, result)``: seconds of the loop's clock the training takes before
        the result leaves (a compute model for simulation, see ``sim/clock.py``). ``trust`` (the device's
        identity) signs what it sends and admits only tasks signed by its cell; ``cloud`` (what the
        device knows of the cloud's session, from its signed records) then also admits only tasks of
        the current session, for a round no later than the manifest's. In any case a task must be for
        a later (round, edge round) than the last one taken in its session, or that one again: a cell that
        restarted re-sends the tasks whose results it has not journaled. With ``keep_answer`` the device
        keeps the message of its last result and sends it again, the same bytes, for that task (at most
        ``REANSWERS`` times, signed or not; never trained twice); without, a signed task is trained again
        (once its first training is over: the same result) and an unsigned one is refused as a replay.
        ``keep_answer`` costs one result per device: for agents on their own (MQTT), not for simulated
        populations. ``secagg``: take part in secure aggregation (``edge_agent/secagg.py``): results leave
        masked (and are never kept). ``instance``: the agent process's nonce, in every status record
        (``protocols/twin.py``: a second process under this device id is refused). ``versioned``: a task's
        round is its cell's model version (``algorithm.mode = "async"``), not a cloud round: the manifest's round
        does not bound it (the session and the replay window still do)."""
        self.transport, self.run, self.cell, self.device = transport, run, cell, device
        self.compute_delay = compute_delay
        self.role, self.data, self.trainer, self.seed = role, data, trainer, seed
        self.trust, self.cloud, self.versioned = trust, cloud, versioned
        self.messenger = Messenger(transport, run, device, trust=trust, max_payload=max_message_bytes)
        self._last: tuple[str | None, int, int] | None = None  # (session, round, edge round) of the last task
        self.keep_answer = keep_answer and secagg is None
        self.instance = instance
        self.caps = caps  # announced in the status (protocols.capabilities); cells plan by them
        # (task, topic, result message: bytes, or a view of a lent record where it was framed in place)
        self._answer: tuple[tuple[str | None, int, int], str, bytes | memoryview] | None = None
        self._reanswers = 0  # times the kept answer was sent again
        self.on_task = on_task
        self.executor: Executor | None = None  # trains elsewhere (``sim/executors.py``, ``cohort.py``); None: here
        self.tasks_done = 0
        self.pending = 0  # tasks taken whose result has not left yet (training, or a modelled delay)
        self.bytes_in = 0
        self.bytes_out = 0
        self._status: dict[tuple[str, int, float], bytes] = {}  # (state, samples, idle heartbeat) -> its last record
        self.secagg, self._task_kinds = self._secure_aggregation(secagg)

    def _secure_aggregation(self, settings: SecAggSettings | None) -> tuple[DeviceSecAgg | None, tuple[str, ...]]:
        """Secure aggregation's device part (with ``settings``) and the kinds of message the task topic carries."""
        if settings is None:
            return None, ("device_task",)
        from protocols.privacy.secagg import KINDS

        from .secagg import DeviceSecAgg

        return DeviceSecAgg(self, settings), ("device_task", *KINDS)

    def start(self) -> None:
        self.attach(self.transport)
        self.announce("online")

    def attach(self, transport: Transport) -> None:
        """Take tasks on ``transport`` (a new connection of a device that rejoins: same role, same
        de-duplication of messages); does not announce."""
        self.transport = transport
        self.messenger.attach(transport)  # chunk signing and the message bound on the new connection too
        transport.subscribe(topics.device_task(self.run, self.cell, self.device), self._on_task, segments=True)

    def announce(
        self,
        state: str,
        qos: int = 1,
        heartbeat: float = 0.0,
        unfit: Mapping[str, str] | None = None,
        anew: bool = False,
    ) -> None:
        """Publish this device's retained status record (``qos=0`` for a heartbeat: it repeats the record
        the broker already retains, and the next one follows if it is lost; no acknowledgement to handle).
        An idle record declares the ``heartbeat`` period it is repeated at (0: none), and ``unfit``: the job
        (``session``) this device cannot serve and why (``reason``), so that job's cell plans it absent with
        the reason rather than offline. ``anew``: a record of a newer order, never the last one repeated, which its
        cell takes for a return (its task again, if it waits for this device's result)."""
        status = topics.device_status(self.run, self.cell, self.device)
        samples = (
            len(self.data) if getattr(self.role, "reveals_data_size", True) else None
        )  # DP: the data's size stays here
        beat = heartbeat if state == IDLE and heartbeat > 0 else 0.0
        key = (state, samples or 0, beat)
        unfit = unfit if state == IDLE else None
        record = (
            None if beat or unfit or anew else self._status.get(key)
        )  # an idle beat is stamped with its time: signed each
        if record is None:  # a heartbeat repeats the same record: encoded (and signed) once
            extra: dict[str, Any] = {"caps": dict(self.caps)} if self.caps is not None and state != "offline" else {}
            if samples is not None:
                extra["samples"] = samples
            if self.instance is not None:
                extra["instance"] = self.instance
            if beat:
                extra.update(heartbeat=beat, **beat_stamp())
            if unfit:
                extra["unfit"] = dict(unfit)
            if self.cloud is not None and self.cloud.pinned is not None and state != IDLE:
                extra["session"] = self.cloud.pinned  # the job it serves: a cell of another job does not count it
            record = encode_status(state, topic=status, trust=self.trust, cell=self.cell, **order_stamp(), **extra)
            self._status = (
                {} if beat or unfit else {key: record}
            )  # repeated as the last (a heartbeat): others are newer
        self.transport.publish(status, record, qos=qos, retain=True)

    def stop(self) -> None:
        """Leave cleanly: say offline, then disconnect."""
        if self.transport.connected:
            self.announce("offline")
            self.transport.close()

    def receive_task(self, topic: str, data: bytes | Segments) -> None:
        """Handle one message of this device's task topic (as its subscription does)."""
        self._on_task(topic, data)

    def _on_task(self, topic: str, data: bytes | Segments) -> None:
        msg = self.messenger.receive(topic, data, kinds=self._task_kinds)
        if msg is None:
            return
        h = msg.header
        if self.secagg is not None and h.kind != "device_task":
            self.secagg.on_message(topic, msg)
            return
        if h.cell != self.cell:
            self.messenger.reject(
                topic, RejectKind.WRONG_SENDER, f"task for cell {h.cell!r}, this device is in {self.cell!r}", h.sender
            )
            return
        if self._old_copy(h):  # an ended job's task (a restored broker's): dropped, said once
            return
        refused = self._out_of_window(h)
        if refused is not None:
            self.messenger.reject(topic, refused.kind, str(refused), h.sender)
            return
        if self._last == (self._session_of(h), h.round, h.edge_round):  # the last task again: a restarted cell
            if self.pending:
                log.info("device %s: task %s again while training it", self.device, nth_edge(h.round, h.edge_round))
                return
            if self._answer is not None and self._answer[0] == self._last:
                self._answer_again(topic, h)
                return
        self._last = (self._session_of(h), h.round, h.edge_round)
        self._answer = None
        self.messenger.session = h.session  # the result belongs to the task's session
        if self.on_task is not None:
            self.on_task(h.round, h.edge_round)
        self.bytes_in += msg.nbytes
        self.pending += 1
        ctx = DeviceContext(self.seed, h.round, h.edge_round, self.cell, self.device)
        if self.secagg is not None:  # keys first; training once the shares are out
            self.secagg.begin(h, lambda: self._train(topic, h, msg.payload, ctx, msg.received))
            return
        self._train(topic, h, msg.payload, ctx, msg.received)

    def _train(self, topic: str, h: Header, task: Payload, ctx: DeviceContext, wire: Received | None) -> None:
        if self.executor is not None:  # training elsewhere; the result comes back on this loop
            done = lambda result, error: self._trained(topic, h, result, error)  # noqa: E731
            self.executor.submit(self.device, task, ctx, done, wire)
            return
        self._trained(topic, h, *self.train_here(task, ctx))

    def _old_copy(self, h: Header) -> bool:
        """Signed: a task its cell signed in a job this device's service is done with (``protocols.session.EndedJobs``),
        not the one it serves: an old copy the broker delivers again, not a replay it cannot explain."""
        c = self.cloud
        return (
            self.trust is not None
            and c is not None
            and h.sender == self.cell
            and h.session != c.session
            and c.past_jobs.old_copy(h.session, f"device {self.device}", f"task {nth_edge(h.round, h.edge_round)}")
        )

    def _out_of_window(self, h: Header) -> Rejected | None:
        """Why a task is not for now: not from this device's cell, another session than the cloud's
        current one, a round past the cloud's manifest (signed runs), a round before it, or not after
        the last task taken in its session (a replay: never trained twice), except, signed, that last
        task again: only its cell can sign it anew (a restarted cell re-sends it; a replayed copy is
        dropped by its message id), and it is trained again once, the same result, counted once."""
        if self.trust is not None and h.sender != self.cell:
            return Rejected(
                RejectKind.WRONG_SENDER, f"task signed by {h.sender!r}, not by this device's cell {self.cell!r}"
            )
        if self.trust is not None and self.cloud is not None:
            if h.session is None or h.session != self.cloud.session:
                return Rejected(
                    RejectKind.SIGNATURE,
                    f"task of cloud session {h.session!r}; the cloud's current session is "
                    f"{self.cloud.session!r} (replayed or forged)",
                )
            now = self.cloud.round if not self.versioned else None
            if now is not None and h.round > now:
                return Rejected(
                    RejectKind.STALE, f"task for round {nth(h.round)}, the cloud's manifest says round {nth(now)}"
                )
        now = self.cloud.round if self.cloud is not None and not self.versioned else None
        if now is not None and h.round < now:
            return Rejected(
                RejectKind.STALE, f"stale task for round {nth(h.round)}, the cloud's manifest says round {nth(now)}"
            )
        again = (h.round, h.edge_round) == (self._last or (None, -1, -1))[1:]
        if (
            self._last is not None
            and self._last[0] == self._session_of(h)
            and (
                (h.round, h.edge_round) < self._last[1:]
                or again
                and self.trust is None
                and not self.pending
                and self._answer is None
            )
        ):
            return Rejected(
                RejectKind.REPLAY,
                f"task for round {nth_edge(h.round, h.edge_round)}, already past {nth_edge(*self._last[1:])} "
                "(replayed)",
            )
        return None

    def _answer_again(self, topic: str, h: Header) -> None:
        """Send the kept result of the last task again (the same message: a cell that had it counts it once)."""
        assert self._answer is not None
        if self._reanswers >= REANSWERS:
            self.messenger.reject(
                topic,
                RejectKind.REPLAY,
                f"task for round {nth_edge(h.round, h.edge_round)} again, answered {1 + REANSWERS} times already "
                "(replayed)",
                h.sender,
            )
            return
        self._reanswers += 1
        log.warning(
            "device %s: task %s again (re-sent by its cell, restarted or seeing this device back): sending its "
            "result again",
            self.device,
            nth_edge(h.round, h.edge_round),
        )
        _, result_topic, message = self._answer
        self.transport.publish(result_topic, message, qos=1)

    def _session_of(self, h: Header) -> str | None:
        """The cloud session a task belongs to: its header's (signed runs), else the cloud's current one
        (unsigned headers carry none), so a new cloud session starts a new window."""
        if h.session is not None or self.cloud is None:
            return h.session
        return self.cloud.session

    @property
    def last_task(self) -> tuple[int, int]:
        """``(round, edge round)`` of the last task it took (``(-1, -1)``: none yet): how recently it was active."""
        return self._last[1:] if self._last is not None else (-1, -1)

    def train_here(self, task: Payload, ctx: DeviceContext) -> tuple[Payload | None, str | None]:
        """Run the role on this device's data: ``(result, None)``, or ``(None, error)``."""
        try:
            return train_role(self.role, task, self.data, self.trainer, ctx), None
        except Exception as exc:  # a bad task must not kill the device
            log.exception("device %s failed round %s", self.device, nth_edge(ctx.round, ctx.edge_round))
            return None, f"{type(exc).__name__}: {exc}"

    def _trained(self, topic: str, h: Header, result: Payload | None, error: str | None) -> None:
        if result is None:  # the cell hears why at once (recorded per reason), rather than at its deadline
            log.warning("device %s: task %s failed: %s", self.device, nth_edge(h.round, h.edge_round), error)
            result = failed_payload(f"{error}")
        if result.headroom is not None:  # its tensors made where its message will be: sealed and checked once
            result.headroom.seal(result)
        why = nonfinite(result)
        if why is not None:  # the cell records it and leaves it out of the aggregate
            log.warning("device %s diverged in round %s: %s", self.device, nth_edge(h.round, h.edge_round), why)
            result = diverged_result(why)
        delay = self.compute_delay(self.device, result) if self.compute_delay is not None else 0.0
        if delay > 0:
            self.transport.loop.call_later(delay, lambda: self._send_result(result, h.round, h.edge_round))
        else:
            self._send_result(result, h.round, h.edge_round)

    def _send_result(self, result: Payload, round: int, edge_round: int) -> None:
        self.pending -= 1
        if self.transport.closed:
            return  # the device left while it was computing (a broken connection sends it after reconnecting)
        if (
            self.secagg is not None and diverged_reason(result) is None and failed_reason(result) is None
        ):  # masked, once the cell routed
            self.secagg.result_ready(result, round, edge_round)  # the shares (a diverged one leaves as is:
            return  # to the aggregation it is a dropout)
        self.publish_result(result, round, edge_round)

    def publish_result(self, result: Payload, round: int, edge_round: int) -> None:
        """Send a result to the cell (and keep its message, with ``keep_answer``)."""
        topic = topics.device_result(self.run, self.cell, self.device)
        try:
            message = self.messenger.frame_once(
                "device_result", result, round=round, edge_round=edge_round, cell=self.cell, topic=topic
            )
        except (ValueError, TypeError) as exc:  # a result the wire cannot carry: logged, not sent
            log.error("device %s: result of round %s not sent: %s", self.device, nth_edge(round, edge_round), exc)
            return
        self.transport.publish(topic, message, qos=1)
        self.bytes_out += len(message)
        self.tasks_done += 1
        if self.keep_answer and self._last is not None and self._last[1:] == (round, edge_round):
            self._answer, self._reanswers = (self._last, topic, message), 0
