"""What every cell server is, whatever its rounds: a node of the run with its identity and messenger, its
devices' presence (``cell_server.liveness``) and its own retained status and heartbeat, its records
(``cell_server.telemetry``), the cloud's current session, and a failure that fails the job. The rounds
are a subclass's: it reacts to its devices' presence through the ``_device_*`` hooks and handles the
cloud's tasks and the devices' results (``cell_server.server.CellServer``, synchronous edge rounds;
``cell_server.async_server.AsyncCellServer``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Required, TypedDict

from protocols.bounds import weight_over
from protocols.failures import MAX_REASON, guarded
from protocols.params import Sums
from protocols.rejections import Rejected, RejectKind
from protocols.round_text import nth
from protocols.session import CloudSession, decode_manifest
from protocols.state import publish_state
from protocols.status import between_jobs, decode_status, encode_status, order_stamp
from protocols.transport.base import TimerHandle, Transport
from protocols.transport.mqtt import MqttTransport
from protocols.twin import new_instance
from protocols.wire import topics
from protocols.wire.messenger import Incoming, Messenger

from .liveness import Liveness, StatusChange
from .members import DeviceList, OnlineFlags
from .parts import CellLimits, PresenceTimes
from .telemetry import CellTelemetry

if TYPE_CHECKING:
    from protocols.config import RequirementsSection
    from protocols.wire.keys import Trust

log = logging.getLogger("fedtier.cell")

Availability = Callable[[int, int], Iterable[str]]
"""``(cloud round, edge round) -> devices that may take part`` (participation, in sim/emulation)."""


class NodeOptions(TypedDict, total=False):
    """The keyword arguments of :class:`CellNode` a subclass passes on (``tests/test_cell_parts.py`` keeps
    the two lists equal)."""

    run: Required[str]
    cell: Required[str]
    devices: Required[Iterable[str]]
    device_deadline: Required[float]
    quorum: float
    log_path: str | None
    max_record_bytes: int | None
    trust: Trust | None
    max_message_bytes: int | None
    max_weights: Mapping[str, float] | None
    max_weight: float | None
    assume_online: bool
    heartbeat: float
    heartbeat_timeout: float
    rejoin_wait: float
    absent_ids: int
    status_wait: float
    requirements: RequirementsSection | None


class CellNode:
    """A cell server's node: ``run``, ``cell`` and its ``devices``; ``trust``: its identity (sign; verify the
    cloud, its devices and their status records; accept only tasks of the cloud's current session).

    ``device_deadline``: seconds an edge round waits for its planned devices; ``quorum``: the share of them
    whose results close it early. ``max_weights`` (a device's known sample count) and ``max_weight`` bound
    the ``weight`` a device result may claim. ``heartbeat``: seconds between re-announcements of this
    cell's status (0: none); ``heartbeat_timeout``: a device whose last status is older is deemed offline
    (0: never); ``rejoin_wait``: before planning an edge round, wait up to this long for the devices that
    take part but that are offline (they may be reconnecting; 0: no wait); ``status_wait``: for this long
    after :meth:`start`, a device that has sent no status yet counts as unknown rather than offline, and
    an edge round waits (until the end of that time) for the statuses of the devices it would plan: a
    (restarted) cell hears its devices' retained statuses only once it has subscribed, and its journal or
    the results its session kept may let it plan at once (0: no wait). ``absent_ids``: a record names the
    absent devices of a reason only up to this many (it always counts them), so a cell of a large
    population does not list every device that sits a round out. ``requirements``: what a device's
    announced capabilities must meet to be planned. ``log_path``: the records' JSONL log (rotated past
    ``max_record_bytes``); ``max_message_bytes``: the largest message accepted.
    """

    status_extra: Mapping[str, Any] = {}  # what its status records add (a long-lived cell's instance, protocols.twin)
    journaled: tuple[bool, str | None] = (False, None)  # its journal: a round found to continue, the job it is of

    @property
    def resumes(self) -> bool:
        """Whether it continues, as it starts, what its journal holds (``--resume``, a journal found), unless the
        journal is of another job than the one it is pinned to: a long-lived cell's job folder is named by the job id,
        and an earlier job of the same id (run by a cloud that lost its queue) left its journal there."""
        found, job = self.journaled
        return found and (job is None or self.cloud.pinned in (None, job))

    def __init__(
        self,
        transport: Transport,
        *,
        run: str,
        cell: str,
        devices: Iterable[str],
        device_deadline: float,
        quorum: float = 1.0,
        log_path: str | None = None,
        max_record_bytes: int | None = None,
        trust: Trust | None = None,
        max_message_bytes: int | None = None,
        max_weights: Mapping[str, float] | None = None,
        max_weight: float | None = None,
        assume_online: bool = False,
        heartbeat: float = 0.0,
        heartbeat_timeout: float = 0.0,
        rejoin_wait: float = 0.0,
        absent_ids: int = 100,
        status_wait: float = 0.0,
        requirements: RequirementsSection | None = None,
    ) -> None:
        self.transport, self.loop, self.run, self.cell = transport, transport.loop, run, cell
        self.devices = DeviceList(devices)  # sorted, compact
        self.limits = CellLimits(device_deadline, quorum, absent_ids)
        # the weights device results may claim (the roster teaches bounds of devices enrolled later)
        self.max_weights, self.max_weight = max_weights if max_weights is not None else {}, max_weight
        self.timing = PresenceTimes(heartbeat, heartbeat_timeout, rejoin_wait, status_wait)
        self.trust = trust
        self.telemetry = CellTelemetry(transport, run, cell, trust, log_path, max_record_bytes)
        self.messenger = Messenger(
            transport, run, cell, trust=trust, max_payload=max_message_bytes, on_reject=self.telemetry.on_reject
        )
        self.cloud = CloudSession()  # the cloud's current session, from its (signed) status
        self.liveness = Liveness(cell, self.devices, assume_online, requirements)
        self.round = -1  # the cloud round (or, async, the cloud model version) this cell is at
        self._beat_timer: TimerHandle | None = None
        self._started = 0.0  # loop time of start()
        self._instance = new_instance()  # its process's in its statuses, unless ``status_extra`` names one
        # its status's order (protocols.status.order_stamp): said anew at (re)connect
        self._order: dict[str, float] = {}
        self.failure: str | None = None  # an exception in a handler of this cell (a bug): rounds answer it
        # where the role's weighted sums run (protocols.params.sums_on); None: the host (fedtier sim may put them
        # on its cohort engine's GPU: runtime.cell_sums)
        self.sums: Sums | None = None

    # ----------------------------------------------------------------- views of the parts
    @property
    def online(self) -> OnlineFlags:
        """Each device's online flag (``liveness``)."""
        return self.liveness.online

    @property
    def caps(self) -> dict[str, dict[str, Any]]:
        """The capabilities each device's latest signed status announced (``liveness``)."""
        return self.liveness.caps

    @property
    def records(self) -> list[dict[str, Any]]:
        """The aggregation records so far (``telemetry``)."""
        return self.telemetry.records

    @property
    def observers(self) -> list[Callable[[dict[str, Any]], None]]:
        """Called with each record (``monitor.exporter``; ``telemetry``)."""
        return self.telemetry.observers

    @property
    def device_deadline(self) -> float:
        """Seconds an edge round waits for its planned devices (``limits``)."""
        return self.limits.device_deadline

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Subscribe (cloud tasks, device results and statuses, the cloud's status and, signed, its round
        manifest), announce this cell online and start its heartbeat."""
        self._started = self.loop.now()
        guard = self._guard
        self.transport.subscribe(topics.cell_task(self.run, self.cell), guard(self._on_cell_task, "task handler"))
        self.transport.subscribe(topics.device_results(self.run, self.cell), guard(self._on_result, "result handler"))
        self.transport.subscribe(topics.device_statuses(self.run, self.cell), guard(self._on_status, "status handler"))
        self.transport.subscribe(topics.status(self.run, "cloud"), guard(self._on_status, "status handler"))
        # the cloud's round: signed, to refuse replays of older tasks; with participation, the devices that sit it out
        # (they leave on the manifest, maybe before this cell has the round's task) are away (_participants_moved)
        if self.trust is not None or self._taking_part() is not None:
            self.transport.subscribe(topics.round_manifest(self.run), guard(self._on_manifest, "manifest handler"))
        if isinstance(self.transport, MqttTransport):  # (network thread; after its subscriptions are sent again)
            self.transport.on_reconnected = lambda: self.loop.post(guard(self._announce_anew, "reconnect"))
        self._announce_anew()
        if self.timing.heartbeat > 0 or self.timing.heartbeat_timeout > 0:
            self._beat_timer = self.loop.call_later(self.timing.beat_period, guard(self._beat, "heartbeat"))

    def _guard(self, fn: Callable[..., None], what: str) -> Callable[..., None]:
        """``fn`` as a handler or timer of this cell: an exception in it (a bug) fails the cell (:meth:`fail`)."""
        return guarded(fn, self.fail, f"cell {self.cell}: {what}")

    def fail(self, reason: str) -> None:
        """This cell cannot go on (a handler raised): it answers its current round, and every later task,
        with a "failed" report carrying ``reason``; the cloud fails the job with it."""
        if self.failure is None:
            log.error("cell %s: failed: %s (the job fails with it)", self.cell, reason)
            self.failure = reason
        self._on_failure()

    def _state(self, phase: str, waiting: Iterable[str] = (), **extra: Any) -> None:
        """Publish this cell's retained current state (``protocols.state``): a monitor started mid-stall sees it."""
        publish_state(
            self.transport,
            self.run,
            topics.cell_node(self.cell),
            phase,
            trust=self.trust,
            waiting=waiting,
            round=self.round if self.round >= 0 else None,
            **extra,
        )

    def stop(self, idle_heartbeat: float | None = None) -> None:
        """Say offline (retained), disconnect, close the log; with ``idle_heartbeat``, a long-lived cell whose job
        ended says idle instead (``protocols.status.between_jobs_status``)."""
        self.loop.cancel(self._beat_timer)
        if self.transport.connected:
            between_jobs(
                self.transport,
                topics.status(self.run, topics.cell_node(self.cell)),
                self.trust,
                idle_heartbeat,
                **self._identity,
            )
            self.transport.close()
        self.telemetry.close()

    @property
    def _identity(self) -> dict[str, Any]:
        """What its status records say of its process: its instance (``status_extra``'s, a long-lived cell's)."""
        return {"instance": self._instance, **self.status_extra}

    def _announce_anew(self) -> None:
        """Announce this cell online anew: as it starts, and at each reconnect (the broker may have lost what it held
        for it or took from it: a task, a report; every session, with a broker restarted without its state). Its
        status then carries a newer order (``protocols.status.order_stamp``), which its heartbeats and other
        announcements repeat: the cloud, if its open round waits for this cell, sends it the round's task again
        (``cloud.parts.CellPresence.heard``), which the cell answers as the same task (at work on it: carries on;
        reported: its report again)."""
        self._order = order_stamp()
        self._announce()

    def _announce(self) -> None:
        """Publish this cell online (retained) with its devices online; a cell serving a job (its cloud
        session pinned) names that session, so a cloud of another job does not count it ready. Its instance and
        order (:meth:`_announce_anew`) say which process said it, and when it (re)connected."""
        status = topics.status(self.run, topics.cell_node(self.cell))
        job: dict[str, Any] = {"session": self.cloud.pinned} if self.cloud.pinned is not None else {}
        if unfit := len(self.liveness.unfit):  # offline for this job, said so: the cloud does not wait for them
            job["devices_unfit"] = unfit
        if (part := self._taking_part()) is not None and (away := self.liveness.sitting_out(part)):
            job["devices_away"] = away  # offline as they sit the round out (participation): not waited for either
        job.update(self._status_extra(), **self._identity, **self._order)
        self.transport.publish(
            status,
            encode_status(
                "online",
                topic=status,
                trust=self.trust,
                devices_online=self.online.count(),
                devices_total=len(self.devices) - len(self.liveness.revoked),  # a revoked device is not waited for
                **job,
            ),
            retain=True,
        )

    # ----------------------------------------------------------------- presence
    def _beat(self) -> None:
        """Periodic: mark devices with a stale heartbeat offline, and re-announce this cell."""
        if self.timing.heartbeat_timeout > 0:
            for d in self.liveness.stale(self.loop.now(), self.timing.heartbeat_timeout):
                self._announce()
                self._device_stale(d)
        if self.timing.heartbeat > 0:
            self._announce()
        self._beat_timer = self.loop.call_later(self.timing.beat_period, self._guard(self._beat, "heartbeat"))

    def _on_status(self, topic: str, data: bytes) -> None:
        node = topic.rsplit("/", 1)[-1]
        if node == "cloud":
            before = self.cloud.round
            self.cloud.on_status(decode_status(data, topic, self.trust) if data else None)
            if self.cloud.round != before:  # (another session: its manifest's round, or none)
                self._participants_moved()
            return
        device = self.liveness.device_of(node)
        record = decode_status(data, topic, self.trust) if device is not None else None
        if device is None or record is None:
            return
        if self.liveness.outdated(device, record):
            log.debug("cell %s: %s's status %s is older than one taken: ignored", self.cell, device, record["state"])
            return
        job = self.cloud.pinned
        if job is not None and record["state"] == "online" and record.get("session", job) != job:
            return  # an agent serving another job (e.g. a killed run's retained status): not online for this one
        unfit = record.get("unfit")
        if job is not None and isinstance(unfit, dict) and unfit.get("session") == job:
            if self.liveness.cannot_serve(device, str(unfit.get("reason"))[:MAX_REASON]):
                self._announce()
        change = self.liveness.heard(device, record, self.loop.now())
        if change.changed:
            self._announce()
        self._device_status(device, change)

    def revoke(self, device: str) -> None:
        """Take ``device`` out for good (revoked: e.g. the signed roster no longer lists it): offline from now on
        whatever its statuses say, out of the open edge round at once (which closes if every remaining planned
        device answered), never planned again."""
        if self.liveness.revoke(device):
            self._announce()
            self._device_revoked(device)

    def revoke_members(self, devices: Iterable[str]) -> None:
        """The federation revoked these members (the cloud's signed roster): each is out as :meth:`revoke`
        says, its signatures no longer verify (what it sends is refused and counted) and its retained
        "online" status is cleared."""
        mine = [d for d in devices if self.devices.position(d) is not None and d not in self.liveness.revoked]
        if self.trust is not None:
            self.trust.forget(mine)
        for d in mine:
            self.revoke(d)
            self.transport.publish(topics.device_status(self.run, self.cell, d), b"", retain=True)

    def _on_manifest(self, topic: str, data: bytes) -> None:
        before = self.cloud.round
        self.cloud.on_manifest(decode_manifest(data, topic, self.trust) if data else None)
        if self.cloud.round != before:
            self._participants_moved()

    def _participation_round(self) -> int:
        """The cloud round whose participants take part now: the later of this cell's and the cloud's manifest's. The
        devices go and come on the manifest, which may reach them before this cell has the round's task, or without
        it: a cloud killed between its manifest and its tasks (its resumed self re-opens that round once every cell is
        ready, which a cell counting the round before's participants never was: its whole startup wait, 60 s)."""
        manifest = self.cloud.round
        return max(self.round, 0 if manifest is None else manifest)

    def _take_round(self, rnd: int) -> None:
        """Be at cloud round ``rnd`` (a task's; a journal's, resumed): the devices away may move with it."""
        before = self._participation_round()
        self.round = rnd
        if self._participation_round() != before:  # (a task before its manifest, or none)
            self._participants_moved()

    def _participants_moved(self) -> None:
        """The round whose participants this cell's status counts (``devices_away``) moved: said again, where a device
        is offline (with all online, none is away in any round). An offline device that takes part in one round and
        sits out the next is away from then on, with no status of its own to say so."""
        if self.online.count() < len(self.online) and self._taking_part() is not None:
            self._announce()

    # ----------------------------------------------------------------- checks
    def _cloud_task(self, topic: str, data: bytes) -> Incoming | None:
        """The cell task in ``data``, if it decodes and comes from the cloud of the current session."""
        msg = self.messenger.receive(topic, data, kinds=("cell_task",))
        return msg if msg is not None and self._from_current_cloud(topic, msg) else None

    def _from_current_cloud(self, topic: str, msg: Incoming) -> bool:
        """With trust: a cell task must be signed by the cloud of the current session (else rejected, logged)."""
        if self.trust is None:
            return True
        h = msg.header
        if h.sender != "cloud":
            self.messenger.reject(
                topic, RejectKind.WRONG_SENDER, f"cell task signed by {h.sender!r}, not the cloud", h.sender
            )
            return False
        if h.session != self.cloud.session and self.cloud.past_jobs.old_copy(
            h.session, f"cell {self.cell}", f"round {nth(h.round)}'s task"
        ):
            return False  # a task of a job this cell is done with (a restored broker's): dropped, said once
        if h.session is None or h.session != self.cloud.session:
            self.messenger.reject(
                topic,
                RejectKind.SIGNATURE,
                f"task of cloud session {h.session!r}; the cloud's current session is "
                f"{self.cloud.session!r} (replayed or forged)",
                h.sender,
            )
            return False
        return True

    def _new_cloud_session(self, msg: Incoming) -> bool:
        """With trust: a (verified) cloud task of a session other than this cell's: the cloud, announced by its
        signed status, started afresh (logged)."""
        if self.trust is None or self.round < 0 or msg.header.session == self.messenger.session:
            return False
        log.warning(
            "cell %s: cloud session %s started, round %s of session %s left",
            self.cell,
            msg.header.session,
            nth(self.round),
            self.messenger.session,
        )
        return True

    def _stale_task(self, topic: str, msg: Incoming) -> bool:
        """A cloud task for a round before this cell's, or (signed) before the cloud's manifest (replayed): rejected."""
        h, manifest = msg.header, self.cloud.round if self.trust is not None else None  # (unsigned: anyone's)
        if h.round < self.round:
            why = f"task for round {nth(h.round)}, already at {nth(self.round)}"
        elif manifest is not None and h.round < manifest:
            why = f"task for round {nth(h.round)}, the cloud's manifest says round {nth(manifest)} (replayed)"
        else:
            return False
        self.messenger.reject(topic, RejectKind.STALE, why, h.sender)
        return True

    def weight_bound(self, device: str) -> float | None:
        """The most ``weight`` a result of ``device`` may claim (``None``: unbounded)."""
        return self.max_weights.get(device, self.max_weight)

    def _bad_result(self, device: str, msg: Incoming) -> Rejected | None:
        """Runtime checks before the role sees a result: its session (signed runs) and its weight
        against the device's known sample count or the configured bound."""
        h = msg.header
        if self.trust is not None and h.sender == device and h.session != self.messenger.session:
            return Rejected(
                RejectKind.SIGNATURE, f"result of session {h.session!r}, the current one is {self.messenger.session!r}"
            )
        bound = self.weight_bound(device)
        if bound is None:
            return None
        over = weight_over(msg.payload.meta.get("weight"), bound, f"the {bound:g} samples known for {device}")
        return Rejected(RejectKind.BOUND, over) if over is not None else None

    # ----------------------------------------------------------------- what the rounds add
    def _taking_part(self) -> Iterable[str] | None:
        """The devices that take part in this cell's current round (participation); None: every device."""
        return None

    def _status_extra(self) -> dict[str, Any]:
        """What a subclass adds to this cell's online status (declared state the cloud acts on)."""
        return {}

    def _on_cell_task(self, topic: str, data: bytes) -> None:
        """A message on this cell's task topic."""
        raise NotImplementedError

    def _on_result(self, topic: str, data: bytes) -> None:
        """A message on this cell's devices' result topics."""
        raise NotImplementedError

    def _device_status(self, device: str, change: StatusChange) -> None:
        """``device`` sent a status (``change``: what it told); after the cell re-announced a changed count."""

    def _device_stale(self, device: str) -> None:
        """``device``'s heartbeat went stale: it was just deemed offline."""

    def _device_revoked(self, device: str) -> None:
        """``device`` was just revoked (offline for good)."""

    def _on_failure(self) -> None:
        """The cell just failed (``failure`` says why)."""
