"""The cell runtime: membership and liveness, edge rounds with deadlines, the aggregation log.

All algorithm logic lives in the cell role; this class decides *when* (a round closes when every
planned device answered, a quorum did, or the deadline passed) and records *what happened*.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from protocols.algorithms.base import CellRole
from protocols.algorithms.outcome import Outcome
from protocols.answers import Answers
from protocols.bounds import weight_over
from protocols.capabilities import unmet
from protocols.divergence import diverged_reason
from protocols.failures import count_reasons, failed_payload, failed_reason, guarded
from protocols.jsonl import JsonlWriter
from protocols.records import MAX_LISTED_REJECTIONS, CellRecord
from protocols.rejections import Rejected, RejectKind, kind_of
from protocols.session import CloudSession, decode_manifest
from protocols.state import MAX_WAITING, publish_state
from protocols.status import decode_status, encode_status
from protocols.transport.base import TimerHandle, Transport
from protocols.wire import topics
from protocols.wire.messenger import Incoming, Messenger
from protocols.wire.payload import Payload
from protocols.wire.signed import seal_record

from .members import DeviceList, OnlineFlags
from .recovery import RoundJournal, recover

if TYPE_CHECKING:
    from protocols.config import RequirementsSection
    from protocols.privacy.secagg import SecAggSettings
    from protocols.wire.keys import Trust

log = logging.getLogger("fedtier.cell")

Availability = Callable[[int, int], Iterable[str]]
"""``(cloud round, edge round) -> devices that may take part`` (participation, in sim/emulation)."""


def absence(absent: dict[str, str], limit: int, not_participating: int = 0) -> dict[str, Any]:
    """The record's ``absent`` (device -> reason, for reasons with at most ``limit`` devices) and
    ``absent_counts`` (reason -> devices), the latter only when some were left out; ``not_participating``
    devices were counted and never named."""
    counts: dict[str, int] = {"not participating": not_participating} if not_participating else {}
    for why in absent.values():
        counts[why] = counts.get(why, 0) + 1
    listed = {d: why for d, why in sorted(absent.items()) if counts[why] <= limit}
    left_out = not_participating or len(listed) < len(absent)
    return {"absent": listed, "absent_counts": dict(sorted(counts.items())) if left_out else None}


class CellServer:
    """One cell's edge server."""

    def __init__(
        self,
        transport: Transport,
        *,
        run: str,
        cell: str,
        devices: Iterable[str],
        role: CellRole,
        algorithm: str,
        device_deadline: float,
        quorum: float = 1.0,
        availability: Availability | None = None,
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
        secagg: SecAggSettings | None = None,
        secagg_deadline: float = 30.0,
        journal_path: str | Path | None = None,
        resume: bool = False,
        status_wait: float = 0.0,
        requirements: RequirementsSection | None = None,
    ) -> None:
        """``heartbeat``: seconds between re-announcements of this cell's status (0: none);
        ``heartbeat_timeout``: a device whose last status is older is deemed offline (0: never);
        ``rejoin_wait``: before planning an edge round, wait up to this long for the devices that
        ``availability`` lets take part but that are offline (they may be reconnecting; 0: no wait);
        ``status_wait``: for this long after :meth:`start`, a device that has sent no status yet counts
        as unknown rather than offline, and an edge round waits (until the end of that time) for the
        statuses of the devices it would plan: a (restarted) cell hears its devices' retained statuses
        only once it has subscribed, and its journal or the results its session kept may let it plan at
        once (0: no wait). ``absent_ids``: a record names the absent devices of a reason only up to this many (it always
        counts them), so a cell of a large population does not list every device that sits a round out.
        ``trust``: this cell's identity (sign; verify the cloud, its devices and their status records;
        accept only tasks of the cloud's current session). ``max_weights`` (a device's known sample
        count) and ``max_weight`` bound the ``weight`` a device result may claim. ``secagg``: aggregate
        with secure aggregation (``cell_server/secagg.py``; ``secagg_deadline`` per extra phase).
        ``journal_path``: where the cell keeps its current round crash-consistently
        (``cell_server.recovery``; not with ``secagg``); with ``resume`` it continues the round found
        there when it starts, else it starts afresh."""
        if not 0 < quorum <= 1:
            raise ValueError("quorum must be in (0, 1]")
        self.transport, self.loop, self.run, self.cell = transport, transport.loop, run, cell
        self.devices, self.role, self.algorithm = DeviceList(devices), role, algorithm  # sorted, compact
        self.device_deadline, self.quorum, self.availability = device_deadline, quorum, availability
        self.trust = trust
        self.messenger = Messenger(
            transport, run, cell, trust=trust, max_payload=max_message_bytes, on_reject=self._on_reject
        )
        self.cloud = CloudSession()  # the cloud's current session, from its (signed) status
        self.max_weights, self.max_weight = max_weights if max_weights is not None else {}, max_weight
        self.log = JsonlWriter(log_path, max_record_bytes)  # rotates past max_record_bytes (long-lived nodes)
        self.online = OnlineFlags(self.devices, assume_online)
        self.heartbeat, self.heartbeat_timeout = heartbeat, heartbeat_timeout
        self.last_seen: dict[str, float] = {}  # device -> loop time of its last status record
        self.requirements = requirements
        self.unmet: dict[str, str] = {}  # device -> why it cannot serve this job (its announced capabilities)
        self.caps: dict[str, dict[str, Any]] = {}  # device -> capabilities its latest signed status announced
        self._beat_timer: TimerHandle | None = None
        self._leaving: dict[str, TimerHandle] = {}  # offline devices the open edge round waits for, a while
        self.revoked: set[str] = set()  # devices taken out for good (revoke): their statuses are ignored
        self.rejoin_wait = rejoin_wait
        self.absent_ids = absent_ids
        self._waiting: set[str] = set()  # participating devices this edge round waits for
        self.status_wait = status_wait
        self._started = 0.0  # loop time of start()
        self._unknown: set[str] = set()  # ... and those whose first status it waits for
        self._gave_up: set[str] = set()  # ... and those it waited for in vain this cloud round
        self._wait_timer: TimerHandle | None = None
        self.round = -1
        self.edge_round = 0
        self.in_round = False
        self.answers = Answers("device")
        self.records: list[dict[str, Any]] = []
        self.observers: list[Callable[[dict[str, Any]], None]] = []  # get each record (monitor.exporter)
        self.rejected: list[dict[str, str]] = []  # refused since the last record (even between rounds)
        self.rejected_more = 0  # refused beyond the listed ones
        self._timer: TimerHandle | None = None
        # the cloud round's (_enter_round) and the edge round's (_reset_edge, _start_edge, _open_edge) state
        self._round_devices: set[str] = set()  # devices whose result some edge round of the round took
        self._round_diverged: set[str] = set()  # devices whose training diverged in some edge round
        self._round_failed: dict[str, str] = {}  # devices whose task failed in some edge round, why
        self._round_unmet: dict[str, str] = {}  # devices left out for the job's requirements, why
        self._t0, self._wall0 = 0.0, 0.0  # loop and wall time the edge round started
        self._allowed: set[str] | None = None  # the devices the availability hook lets in this edge round
        self._needed = 0  # results that close the edge round (the quorum of the planned devices)
        self._edge_since = 0.0  # wall time the edge round's tasks left
        self._reset_edge()
        self._round_bytes = {"cell_to_device": 0, "device_to_cell": 0}
        self.secagg = None
        self._result_kinds: tuple[str, ...] = ("device_result",)
        if secagg is not None:
            from protocols.privacy.secagg import KINDS

            from .secagg import CellSecAgg

            self.secagg = CellSecAgg(self, secagg, secagg_deadline)
            self._result_kinds += KINDS
        self._sent_report: bytes | None = None  # the report of ``round``, once sent (re-sent on request)
        self.journal = RoundJournal(journal_path) if journal_path is not None else None
        self._recovered = self.journal.load(resume) if self.journal is not None else []
        self.failure: str | None = None  # an exception in a handler of this cell (a bug): rounds answer it

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._started = self.loop.now()
        guard = self._guard
        self.transport.subscribe(topics.cell_task(self.run, self.cell), guard(self._on_cell_task, "task handler"))
        self.transport.subscribe(topics.device_results(self.run, self.cell), guard(self._on_result, "result handler"))
        self.transport.subscribe(topics.device_statuses(self.run, self.cell), guard(self._on_status, "status handler"))
        self.transport.subscribe(topics.status(self.run, "cloud"), guard(self._on_status, "status handler"))
        if self.trust is not None:  # signed runs: the cloud's round, to refuse replays of older tasks
            self.transport.subscribe(topics.round_manifest(self.run), guard(self._on_manifest, "manifest handler"))
        self._announce()
        if self.heartbeat > 0 or self.heartbeat_timeout > 0:
            self._beat_timer = self.loop.call_later(self._beat_period(), guard(self._beat, "heartbeat"))
        if self._recovered:
            recover(self, self._recovered)
            self._recovered = []

    def _guard(self, fn: Callable[..., None], what: str) -> Callable[..., None]:
        """``fn`` as a handler or timer of this cell: an exception in it (a bug) fails the cell (:meth:`fail`)."""
        return guarded(fn, self.fail, f"cell {self.cell}: {what}")

    def fail(self, reason: str) -> None:
        """This cell cannot go on (a handler raised): it answers its current round, and every later task,
        with a "failed" report carrying ``reason``; the cloud fails the job with it."""
        if self.failure is None:
            log.error("cell %s: failed: %s (the job fails with it)", self.cell, reason)
            self.failure = reason
        if self.in_round:
            self._end_round()
            self._send_failure(self.round)

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

    def _waiting_state(self) -> None:
        self._state(
            "waiting",
            self.answers.pending,
            since=self._edge_since,
            edge_round=self.edge_round,
            deadline_s=self.device_deadline,
        )

    def _send_failure(self, rnd: int) -> None:
        assert self.failure is not None
        self._state("failed", reason=self.failure)
        topic = topics.cell_report(self.run, self.cell)
        self._sent_report = self.messenger.frame(
            "cell_report", failed_payload(self.failure), round=rnd, cell=self.cell, topic=topic
        )
        self.transport.publish(topic, self._sent_report, qos=1)

    def stop(self) -> None:
        self.loop.cancel(self._timer)
        self.loop.cancel(self._wait_timer)
        self.loop.cancel(self._beat_timer)
        if self.transport.connected:
            status = topics.status(self.run, topics.cell_node(self.cell))
            self.transport.publish(status, encode_status("offline", topic=status, trust=self.trust), retain=True)
            self.transport.close()
        self.log.close()
        if self.journal is not None:
            self.journal.close()

    def _announce(self) -> None:
        status = topics.status(self.run, topics.cell_node(self.cell))
        self.transport.publish(
            status,
            encode_status(
                "online",
                topic=status,
                trust=self.trust,
                devices_online=self.online.count(),
                devices_total=len(self.devices),
            ),
            retain=True,
        )

    # ----------------------------------------------------------------- liveness
    def _beat_period(self) -> float:
        return self.heartbeat if self.heartbeat > 0 else self.heartbeat_timeout / 2

    def _beat(self) -> None:
        """Periodic: mark devices with a stale heartbeat offline, and re-announce this cell."""
        now = self.loop.now()
        if self.heartbeat_timeout > 0:
            for d, online in self.online.items():
                if online and now - self.last_seen.get(d, now) > self.heartbeat_timeout:
                    log.warning(
                        "cell %s: no heartbeat from %s for %.1f s, deemed offline",
                        self.cell,
                        d,
                        now - self.last_seen[d],
                    )
                    self.online[d] = False
                    self._announce()
                    self._gone(d, 0.0)  # silent for heartbeat_timeout already: out of the round now
        if self.heartbeat > 0:
            self._announce()
        self._beat_timer = self.loop.call_later(self._beat_period(), self._guard(self._beat, "heartbeat"))

    def _on_status(self, topic: str, data: bytes) -> None:
        node = topic.rsplit("/", 1)[-1]
        if node == "cloud":
            self.cloud.on_status(decode_status(data, topic, self.trust) if data else None)
            return
        if not node.startswith("device.") or node[len("device.") :] not in self.online:
            return
        device = node[len("device.") :]
        if device in self.revoked:
            return
        record = decode_status(data, topic, self.trust)
        if record is None:
            return
        online = record["state"] == "online"
        if online and isinstance(record.get("caps"), dict):
            self.caps[device] = record["caps"]  # the fleet view on the metrics port (monitor.exporter)
        if online and self.requirements is not None:
            caps = record.get("caps")
            reason = unmet(caps if isinstance(caps, dict) else None, self.requirements)
            if reason is None:
                self.unmet.pop(device, None)
            elif self.unmet.get(device) != reason:
                self.unmet[device] = reason
                log.info("cell %s: %s does not meet the job's requirements: %s", self.cell, device, reason)
        heard = device in self.last_seen  # a first status (a started cell) is no return
        self.last_seen[device] = self.loop.now()
        if self.online[device] != online:
            self.online[device] = online
            self._announce()
            if (
                online
                and heard
                and self.answers.is_open
                and device in self.answers.pending
                and device in self._tasks
                and self.secagg is None
            ):
                # back (an agent restarted, or reconnected with a new session) while its result is
                # pending: the task it was given may be lost with its old process
                log.warning(
                    "cell %s: %s is back while its result of %d.%d is pending: its task again",
                    self.cell,
                    device,
                    self.round,
                    self.edge_round,
                )
                self._send_task(device)
            if online:
                self.loop.cancel(self._leaving.pop(device, None))
            else:
                self._gone(device, self.heartbeat_timeout + self.heartbeat)  # a restart's time to come back
        awaited = device in self._unknown or (online and device in self._waiting)
        self._unknown.discard(device)
        if online:
            self._waiting.discard(device)
        if awaited and not self._waiting and not self._unknown:
            self._plan_edge(self.round, self.edge_round)

    def revoke(self, device: str) -> None:
        """Take ``device`` out for good (revoked: e.g. the signed roster no longer lists it): offline from now on
        whatever its statuses say, out of the open edge round at once (which closes if every remaining planned
        device answered), never planned again."""
        if device not in self.online or device in self.revoked:
            return
        log.warning("cell %s: %s revoked", self.cell, device)
        self.revoked.add(device)
        self.online[device] = False
        self._announce()
        self.loop.cancel(self._leaving.pop(device, None))
        if self.answers.is_open and device in self.answers.pending and self.secagg is None:
            self._leave(device, self.round, self.edge_round, "revoked")

    def _gone(self, device: str, grace: float) -> None:
        """``device`` went offline (its will, a clean leave, or a stale heartbeat): if the open edge round waits
        for its result, it leaves the round after ``grace`` seconds (heartbeat_timeout + one heartbeat after its
        will; at once when its heartbeat went stale) unless it is back by then (an agent that restarts gets its
        task again), and the round closes once every remaining planned device answered,
        instead of waiting out ``device_deadline``. Liveness needs heartbeat_timeout > 0; not under secure
        aggregation (its dropout recovery decides)."""
        if (
            self.heartbeat_timeout <= 0
            or self.secagg is not None
            or not self.answers.is_open
            or device not in self.answers.pending
        ):
            return
        r, e = self.round, self.edge_round
        self.loop.cancel(self._leaving.pop(device, None))
        if grace <= 0:
            self._leave(device, r, e)
        else:
            self._leaving[device] = self.loop.call_later(
                grace, self._guard(lambda: self._leave(device, r, e), "liveness timer")
            )

    def _leave(self, device: str, rnd: int, edge_round: int, why: str = "offline") -> None:
        """Take ``device`` (offline) out of edge round ``rnd.edge_round`` if it is still open and waits for it."""
        self._leaving.pop(device, None)
        if (
            not self.in_round
            or (rnd, edge_round) != (self.round, self.edge_round)
            or not self.answers.is_open
            or device not in self.answers.pending
            or self.online[device]
        ):
            return
        log.warning(
            "cell %s: %s is %s: edge round %d.%d no longer waits for it", self.cell, device, why, rnd, edge_round
        )
        self.answers.pending.discard(device)
        self.absent[device] = why
        if self.answers.pending and len(self.answers.received) < self._needed:
            self._waiting_state()
        if not self.answers.pending:
            answered = self.answers.received or self.answers.settled
            self._close(rnd, edge_round, "all answered" if answered else "all offline")
        elif len(self.answers.received) >= self._needed:
            self._close(rnd, edge_round, "quorum")

    def _on_manifest(self, topic: str, data: bytes) -> None:
        self.cloud.on_manifest(decode_manifest(data, topic, self.trust) if data else None)

    # ----------------------------------------------------------------- rounds
    def _on_cell_task(self, topic: str, data: bytes) -> None:
        msg = self.messenger.receive(topic, data, kinds=("cell_task",))
        if msg is None:
            return
        if not self._from_current_cloud(topic, msg):
            return
        if self.trust is not None and self.round >= 0 and msg.header.session != self.messenger.session:
            # the cloud (announced by its signed status) started afresh: its rounds count from the start
            log.warning(
                "cell %s: cloud session %s started, round %d of session %s left",
                self.cell,
                msg.header.session,
                self.round,
                self.messenger.session,
            )
            if self.in_round:
                self._end_round()
            self.round, self._sent_report = -1, None
        if msg.header.round == self.round:  # a resumed cloud re-sends the round: answer it again, once
            self._again(topic, msg.header.round)
            return
        if msg.header.round < self.round:
            self.messenger.reject(
                topic,
                RejectKind.STALE,
                f"task for round {msg.header.round}, already at {self.round}",
                msg.header.sender,
            )
            return
        manifest = self.cloud.round
        if manifest is not None and msg.header.round < manifest:
            self.messenger.reject(
                topic,
                RejectKind.STALE,
                f"task for round {msg.header.round}, the cloud's manifest says round {manifest} (replayed)",
                msg.header.sender,
            )
            return
        if self.in_round:
            log.warning(
                "cell %s: round %d abandoned, the cloud moved on to %d", self.cell, self.round, msg.header.round
            )
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
            self.journal.task(msg.header.round, msg.header.session, msg.payload, getattr(self.role, "noise_seed", None))
        self._enter_round(msg.header.round, msg.header.session)
        self._start_edge()

    def _enter_round(self, rnd: int, session: str | None) -> None:
        """Take up cloud round ``rnd`` of cloud session ``session`` (the role has begun it)."""
        self.round, self.edge_round, self.in_round = rnd, 0, True
        self._sent_report = None
        self.messenger.session = session  # device tasks and the report belong to it
        self._round_bytes = {"cell_to_device": 0, "device_to_cell": 0}
        self._round_devices = set()
        self._round_diverged = set()
        self._round_failed = {}
        self._round_unmet = {}
        self._gave_up = set()

    def _again(self, topic: str, rnd: int) -> None:
        """The task of the round this cell has or is working on: re-send the report if it was sent (the
        same message: the cloud counts it once), else carry on (the report leaves when the round closes)."""
        if self.in_round:
            log.info("cell %s: task for round %d again, still working on it", self.cell, rnd)
        elif self._sent_report is not None:
            log.warning("cell %s: task for round %d again (a resumed cloud), re-sending its report", self.cell, rnd)
            self.transport.publish(topics.cell_report(self.run, self.cell), self._sent_report, qos=1)

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

    def _end_round(self) -> None:
        self.loop.cancel(self._timer)
        self.loop.cancel(self._wait_timer)
        self._waiting, self._unknown = set(), set()
        self.in_round = False
        self.answers.close()
        if self.secagg is not None:
            self.secagg.cancel()

    def _reset_edge(self) -> None:
        self.losses: dict[str, float] = {}
        self.absent: dict[str, str] = {}
        self.diverged: dict[str, str] = {}  # device -> why its training diverged (not aggregated)
        self.failed: dict[str, str] = {}  # device -> why its task failed (not aggregated)
        self._not_participating = 0  # counted, not named in self.absent (more than absent_ids)
        self.planned: list[str] = []
        self._tasks: Mapping[str, Payload] = {}  # the open edge round's task of each planned device
        self._opened = False  # planned and sent the tasks of the current edge round
        self.bytes_in = self.bytes_out = 0

    def _start_edge(self) -> None:
        """Open an edge round: first wait (up to ``rejoin_wait``) for offline devices that take part, and
        (within ``status_wait`` of the start) for the first status of those not heard of yet."""
        self._reset_edge()
        self._t0, self._wall0 = self.loop.now(), time.perf_counter()
        self._allowed = set(self.availability(self.round, self.edge_round)) if self.availability else None
        self._waiting = (
            {d for d in self._allowed or () if d in self.online and not self.online[d]} - self._gave_up
            if self.rejoin_wait > 0
            else set()
        )
        left = self._started + self.status_wait - self.loop.now()
        self._unknown = (
            {
                d
                for d in (self.devices if self._allowed is None else self._allowed)
                if d in self.online and not self.online[d] and d not in self.last_seen
            }
            if left > 0
            else set()
        )
        wait = max(self.rejoin_wait if self._waiting else 0.0, left if self._unknown else 0.0)
        if wait > 0:
            if self._unknown:
                log.info(
                    "cell %s: edge round %d.%d waits up to %.1f s for the first status of %d devices",
                    self.cell,
                    self.round,
                    self.edge_round,
                    wait,
                    len(self._unknown),
                )
            self._wait_timer = self.loop.call_later(
                wait, self._guard(lambda r=self.round, e=self.edge_round: self._plan_edge(r, e), "edge round start")
            )
        else:
            self._plan_edge(self.round, self.edge_round)

    def _plan_edge(self, rnd: int, edge_round: int) -> None:
        if not self.in_round or (rnd, edge_round) != (self.round, self.edge_round) or self._opened:
            return  # a wait of a round that is over, or already planned
        self._opened = True
        self.loop.cancel(self._wait_timer)
        self._gave_up |= self._waiting
        self._waiting, self._unknown = set(), set()
        allowed = self._allowed
        taking_part = self.devices if allowed is None else self.devices.among(allowed)
        sitting_out = len(self.devices) - len(taking_part)
        if 0 < sitting_out <= self.absent_ids:  # named in the record; beyond, only counted (large cells)
            part = set(taking_part)
            self.absent.update((d, "not participating") for d in self.devices if d not in part)
        elif sitting_out:
            self._not_participating = sitting_out
        available = []
        for d in taking_part:
            if d in self.revoked:
                self.absent[d] = "revoked"
            elif not self.online[d]:
                self.absent[d] = "offline"
            elif d in self.unmet:
                self.absent[d] = self._round_unmet[d] = f"requirements: {self.unmet[d]}"
            else:
                available.append(d)
        if self.journal is not None:
            self.journal.plan(self.edge_round, available, self.absent, self._not_participating)
        self._open_edge(self.role.plan(self.edge_round, available), available)

    def _open_edge(
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
        self.planned = sorted(plan)
        self._tasks = plan
        for d in available:
            if d not in plan:
                self.absent[d] = "not selected"
        for d in self.planned:
            if d not in taken and d not in settled:
                self._send_task(d)
        self.answers.open((self.round, self.edge_round), self.planned)
        for d, result in taken.items():
            self.answers.received[d] = result
            self.answers.pending.discard(d)
        for d in settled & self.answers.pending:
            self.answers.settled.add(d)
            self.answers.pending.discard(d)
        if self.secagg is not None:
            self.secagg.begin(self.planned)
        self._needed = math.ceil(self.quorum * len(self.planned))
        self._edge_since = time.time()
        if self.answers.pending:
            self._waiting_state()
        r, e = self.round, self.edge_round
        guard = self._guard
        if not self.planned:
            self.loop.post(guard(lambda: self._close(r, e, "no devices"), "edge round close"))
        elif (taken or settled) and (not self.answers.pending or len(self.answers.received) >= self._needed):
            why = "all answered" if not self.answers.pending else "quorum"
            self.loop.post(guard(lambda: self._close(r, e, why), "edge round close"))
        else:
            self._timer = self.loop.call_later(
                self.device_deadline, guard(lambda: self._close(r, e, "deadline"), "edge round deadline")
            )

    def _send_task(self, device: str) -> None:
        self.bytes_out += self.messenger.send(
            topics.device_task(self.run, self.cell, device),
            "device_task",
            self._tasks[device],
            round=self.round,
            edge_round=self.edge_round,
            cell=self.cell,
        )

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
        if refused is None:
            check = self.secagg.check if self.secagg is not None else self.role.check
            settle = diverged is not None or failed is not None  # answered, with nothing to aggregate
            refused = self.answers.offer(
                device, h.sender, (h.round, h.edge_round), None if settle else msg.payload, check
            )
        if refused is not None:
            self.messenger.reject(topic, refused.kind, str(refused), device)
            return
        if len(self.answers.received) + len(self.answers.settled) == taken:
            return  # a repeat of an answer already taken counts once
        if self.journal is not None:
            self.journal.result(self.edge_round, device, msg.payload, msg.nbytes)
        self.bytes_in += msg.nbytes
        if diverged is not None:  # recorded, never aggregated
            log.warning("cell %s: %s diverged in round %d.%d: %s", self.cell, device, h.round, h.edge_round, diverged)
            self.diverged[device] = diverged
        elif failed is not None:  # its task raised: recorded with the reason, never aggregated
            log.warning("cell %s: %s failed its task %d.%d: %s", self.cell, device, h.round, h.edge_round, failed)
            self.failed[device] = failed
        elif isinstance(loss := msg.payload.meta.get("loss"), (int, float)) and math.isfinite(loss):
            self.losses[device] = float(loss)
        if not self.answers.pending:
            self._close(self.round, self.edge_round, "all answered")
        elif len(self.answers.received) >= self._needed:
            self._close(self.round, self.edge_round, "quorum")
        elif len(self.answers.pending) <= MAX_WAITING:  # the tail of a round: name whom it still waits for
            self._waiting_state()

    def revoke_members(self, devices: Iterable[str]) -> None:
        """The federation revoked these members (the cloud's signed roster): each is out as :meth:`revoke`
        says, its signatures no longer verify (what it sends is refused and counted) and its retained
        "online" status is cleared."""
        mine = [d for d in devices if self.devices.position(d) is not None and d not in self.revoked]
        if self.trust is not None:
            self.trust.forget(mine)
        for d in mine:
            self.revoke(d)
            self.transport.publish(topics.device_status(self.run, self.cell, d), b"", retain=True)

    def _bad_result(self, device: str, msg: Incoming) -> Rejected | None:
        """Runtime checks before the role sees a result: its session (signed runs) and its weight
        against the device's known sample count or the configured bound."""
        h = msg.header
        if self.trust is not None and h.sender == device and h.session != self.messenger.session:
            return Rejected(
                RejectKind.SIGNATURE, f"result of session {h.session!r}, the current one is {self.messenger.session!r}"
            )
        bound = self.max_weights.get(device, self.max_weight)
        if bound is None:
            return None
        over = weight_over(msg.payload.meta.get("weight"), bound, f"the {bound:g} samples known for {device}")
        return Rejected(RejectKind.BOUND, over) if over is not None else None

    def _on_reject(self, topic: str, kind: RejectKind, reason: str, sender: str | None) -> None:
        parts = topic.split("/")
        who = sender or (parts[-2] if len(parts) >= 2 and parts[-1] == "result" else topic)
        if len(self.rejected) < MAX_LISTED_REJECTIONS:
            self.rejected.append({"device": who, "kind": kind.value, "reason": reason})
        else:
            self.rejected_more += 1

    def _close(self, rnd: int, edge_round: int, why: str) -> None:
        if not self.in_round or (rnd, edge_round) != (self.round, self.edge_round):
            return  # a timer of a round that already closed
        self.loop.cancel(self._timer)
        results = dict(sorted(self.answers.received.items()))
        for d in self.answers.pending:
            self.absent[d] = "deadline"
        self.answers.close()
        if self.secagg is not None:  # masked results: unmask the sum first (it calls _aggregate)
            self.secagg.unmask(results, why)
            return
        self._aggregate(why, results)

    def _aggregate(self, why: str, results: dict[str, Payload], extra: dict[str, Any] | None = None) -> None:
        """Fold the edge round's results into the cell role, record it, and go on to the next one."""
        outcome = self.role.aggregate(self.edge_round, results).with_metrics(**(extra or {}))
        self._round_bytes["cell_to_device"] += self.bytes_out
        self._round_bytes["device_to_cell"] += self.bytes_in
        self._round_devices |= set(results)
        self._round_diverged |= set(self.diverged)
        self._round_failed.update(self.failed)
        self._record(why, outcome, list(results))
        self.edge_round += 1
        if self.edge_round < self.role.edge_rounds:
            self._start_edge()
        else:
            self._report()

    def _record(self, why: str, outcome: Outcome, answered: list[str]) -> None:
        losses = list(self.losses.values())
        mean = sum(losses) / len(losses) if losses else None
        spread = (sum((x - mean) ** 2 for x in losses) / len(losses)) ** 0.5 if mean is not None else None
        now = self.loop.now()
        metrics = dict(outcome.metrics)
        excluded = outcome.excluded or None  # robust aggregation: who was left out, why
        record = CellRecord(
            run=self.run,
            round=self.round,
            edge_round=self.edge_round,
            cell=self.cell,
            algorithm=self.algorithm,
            planned=self.planned,
            answered=answered,
            **absence(self.absent, self.absent_ids, self._not_participating),
            rejected=self.rejected,
            closed_by=why,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            loss_mean=mean,
            loss_std=spread,
            duration_s=round(time.perf_counter() - self._wall0, 6),
            clock_s=round(now - self._t0, 6),
            clock_end_s=round(now, 6),
            deadline_s=self.device_deadline,
            time=round(time.time(), 3),
            metrics=metrics,
            excluded=excluded,
            diverged=self.diverged or None,
            failed=dict(sorted(self.failed.items())[:MAX_LISTED_REJECTIONS]) or None,
            failed_counts=count_reasons(self.failed) or None,
        ).to_dict()
        if self.journal is not None:
            self.journal.closed(self.edge_round, record)
        self._emit(record)

    def _emit(self, record: dict[str, Any]) -> None:
        """Keep, log and publish an aggregation record; the rejections it lists are reset."""
        if self.rejected_more:
            record["rejected_more"] = self.rejected_more
        self.rejected, self.rejected_more = [], 0
        self.records.append(record)
        self.log.write(record)
        for observe in self.observers:
            observe(record)
        topic = topics.telemetry_cell(self.run, self.cell)  # QoS 1: a deployed cloud keeps every record
        self.transport.publish(topic, seal_record(record, topic, self.trust.sign if self.trust else None), qos=1)

    def _report(self) -> None:
        self._end_round()
        report = self.role.report()
        report.meta["traffic"] = dict(self._round_bytes)
        report.meta["devices"] = len(self._round_devices)
        if diverged := len(self._round_diverged - self._round_devices):  # diverged in every edge round they had
            report.meta["diverged"] = diverged
        failed = {d: why for d, why in self._round_failed.items() if d not in self._round_devices}
        if failed:  # failed in every edge round they had, per reason
            report.meta["failed_devices"] = len(failed)
            report.meta["failures"] = count_reasons(failed)
        unmet = {d: why for d, why in self._round_unmet.items() if d not in self._round_devices}
        if unmet:  # left out for the job's requirements: a job no device can serve fails with why
            report.meta["unmet"] = count_reasons(unmet)
        topic = topics.cell_report(self.run, self.cell)
        self._sent_report = self.messenger.frame("cell_report", report, round=self.round, cell=self.cell, topic=topic)
        if self.journal is not None:
            self.journal.report(self._sent_report)
        self.transport.publish(topic, self._sent_report, qos=1)
        self._state("idle")
