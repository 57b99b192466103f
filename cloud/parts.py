"""The state parts of a cloud server, each a small record with one meaning: what the open round's record
counts beyond the role's outcome, and the tasks it sent (:class:`RoundCounts`, a fresh one per round), and
what the cloud knows of its cells' presence (:class:`CellPresence`); and the checks a cell's report passes
before the role sees it (:func:`report_refusal`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from protocols.algorithms.base import CloudRole
from protocols.bounds import CellBounds, weight_over
from protocols.divergence import declared_norms, largest
from protocols.failures import merge_counts
from protocols.numbers import declared_count
from protocols.records import TIERS
from protocols.rejections import Rejected, RejectKind
from protocols.round_text import nth
from protocols.session import EndedJobs
from protocols.status import order_of
from protocols.wire.envelope import Header
from protocols.wire.messenger import Incoming, Messenger
from protocols.wire.payload import Payload

log = logging.getLogger("fedtier.cloud")

MAX_RENEWALS = 3
"""Times a cell's task is sent again in one round as it says itself online anew, at most (each costs a task: a cell
that lies, minting orders or processes, gets no more), as a cell sends a device's (``cell_server.edge_liveness``)."""
KNOWN_INSTANCES = 4
"""Processes of one cell whose newest order the cloud remembers: a replay of an older record of one is no return."""


@dataclass
class RoundCounts:
    """The open round's figures from its cells' reports (checked and bounded: a cell may lie in them)."""

    t0: float = 0.0  # loop time the round's tasks left
    wall0: float = 0.0  # perf_counter then
    since: float = 0.0  # wall time then
    expected: int = 0  # cells that may answer: a stall is fewer than this
    bytes: dict[str, int] = field(default_factory=lambda: {t: 0 for t in TIERS})
    resent: dict[str, int] = field(default_factory=dict)  # tier -> bytes of tasks sent again (not in ``bytes``)
    devices: dict[str, int] = field(default_factory=dict)  # cell -> devices its report aggregated
    diverged: dict[str, int] = field(default_factory=dict)  # cell -> devices that diverged in every edge round
    failed: dict[str, int] = field(default_factory=dict)  # cell -> devices whose task failed in every one
    failures: dict[str, int] = field(default_factory=dict)  # reason -> devices whose task failed, over the cells
    unmet: dict[str, int] = field(default_factory=dict)  # reason -> devices left out for the job's requirements
    late: int = 0  # devices tasked that answered no edge round in time, over the cells
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> devices late whose every answer was refused
    offline: int = 0  # devices taking part that were offline in every edge round, over the cells
    online: int = 0  # devices online in cells that aggregated none, over the cells (the fleet is alive)
    cells_failed: dict[str, str] = field(default_factory=dict)  # cell -> why it failed (fail_on_cell_failure off)
    tasks: Mapping[str, Payload] = field(default_factory=dict)  # cell -> its task of the round (the role's plan)
    repeated: set[str] = field(default_factory=set)  # cells that sent a report again (:meth:`lost_task`)
    renewals: dict[str, int] = field(default_factory=dict)  # cell -> times it said itself online anew (:meth:`renewal`)
    largest: dict[str, dict[str, int]] = field(default_factory=dict)  # cell -> device -> its largest update's exponent

    def renewal(self, cell: str, rnd: int, awaited: set[str]) -> bool:
        """Whether ``cell``, which said itself online anew (``CellPresence.heard``: its process (re)connected, and the
        broker may have lost its task or report, or every session), is sent its task of round ``rnd`` again: if round
        ``rnd`` waits for it (in ``awaited``), at most :data:`MAX_RENEWALS` times a round (a cell flapping its link,
        or one lying, gets no more); logged."""
        if cell not in awaited:
            return False
        again = self.renewals[cell] = self.renewals.get(cell, 0) + 1
        if again <= MAX_RENEWALS:
            log.warning("cloud: %s is online anew while round %s waits for it: its task again", cell, nth(rnd))
        elif again == MAX_RENEWALS + 1:
            log.warning(
                "cloud: %s is online anew again while round %s waits for it: its task was sent again %d times in this "
                "round, no more",
                cell,
                nth(rnd),
                MAX_RENEWALS,
            )
        return again <= MAX_RENEWALS

    def first_resend(self, cell: str) -> bool:
        """Whether ``cell`` may be sent its task of this round again: once a round (a repeated report, or an async
        cell asking for the model it lost), never more (a cell that repeats itself gets no more tasks)."""
        if cell in self.repeated:
            return False
        self.repeated.add(cell)
        return True

    def lost_task(self, cell: str, repeated: Header, rnd: int, pending: set[str], resumed: bool = False) -> bool:
        """Whether to send ``cell``, still awaited (in ``pending``) since it was sent its task of round ``rnd``,
        that task again: it sent (signed by itself) its report of an earlier round again (``repeated``), as a
        cell restarted from a journal that ends with its report does (``cell_server.recovery``,
        ``cell_server.async_recovery``: a round is a cloud model version there). It may have died after taking
        the task (acknowledged to the broker, which will not hand it again) and before journaling it; if it has
        the task, the copy is answered as a repeat. A cell's first repeat in a round is let be (a restart, a
        redelivery: at most one task again); a later one is refused (:class:`Rejected`, ``REPLAY``): a cell
        that repeats itself gets no more tasks and changes no aggregate, and its repeats are on the record. A
        repeat that ``cell`` did not sign is refused (``WRONG_SENDER``) and is not ``cell``'s repeat: another
        node's copies on its topic use up nothing of ``cell``'s. ``resumed``: ``rnd`` is the first round of a cloud
        resumed from its checkpoint, to which the broker hands again what the stopped cloud took but never
        acknowledged (the cell did not come back: this cloud did; said at info)."""
        h = repeated
        if h.sender != cell:
            raise Rejected(
                RejectKind.WRONG_SENDER, f"report signed by {h.sender!r} on the topic of cell {cell!r}, again"
            )
        if not self.first_resend(cell):
            raise Rejected(
                RejectKind.REPLAY,
                f"report of round {nth(h.round)} from {cell} again, in round {nth(rnd)}: one repeat a round is let be",
            )
        if h.round >= rnd or cell not in pending:
            log.info("cloud: report of round %s from %s again (a restart, a redelivery): dropped", nth(h.round), cell)
            return False
        if resumed:
            log.info(
                "cloud: %s's report of round %s came again (this cloud resumed at round %s: its broker session handed "
                "it again, or the cell restarted too): round %s's task sent again",
                cell,
                nth(h.round),
                nth(rnd),
                nth(rnd),
            )
        else:
            log.warning(
                "cloud: %s came back after round %s (its report again): round %s's task sent again",
                cell,
                nth(h.round),
                nth(rnd),
            )
        return True

    def count(
        self, cell: str, nbytes: int, meta: dict[str, Any], cell_of: Callable[[str], str | None] | None = None
    ) -> int:
        """Add a taken report's bytes (and the device traffic, diverged and failed devices it declares, and the devices
        of its largest updates: only those ``cell_of`` (the topology's or the roster's) puts in ``cell``, none where
        it is unknown, so a lying cell cannot have another cell's device blamed); its device count."""
        self.bytes["cell_to_cloud"] += nbytes
        traffic = meta.get("traffic", {})
        for tier in ("cell_to_device", "device_to_cell"):
            self.bytes[tier] += declared_count(traffic.get(tier, 0) if isinstance(traffic, dict) else 0)
        if diverged := declared_count(meta.get("diverged", 0)):
            self.diverged[cell] = diverged
        if failed := declared_count(meta.get("failed_devices", 0)):
            self.failed[cell] = failed
        merge_counts(self.failures, meta.get("failures"))
        merge_counts(self.unmet, meta.get("unmet"))
        merge_counts(self.rejected, meta.get("rejected"))
        self.late += declared_count(meta.get("late", 0))
        if cell_of is not None and (norms := declared_norms(meta.get("largest_updates"))):  # (a failure names them)
            mine = self.largest.get(cell, {})
            for device, exponent in norms.items():
                if cell_of(device) == cell:
                    mine[device] = max(mine.get(device, exponent), exponent)
            if mine:
                self.largest[cell] = dict(largest(mine))
        self.offline += declared_count(meta.get("offline", 0))
        self.online += declared_count(meta.get("online", 0))
        return declared_count(meta.get("devices", 0))


class CellPresence:
    """Each cell's status as its (verified) status records say: online, and ready (online with every device
    online, or said it cannot serve the job); when an online cell went offline; the newest order heard of each of
    its processes (``protocols.status.order_stamp``: a cell says itself online anew at each (re)connect)."""

    def __init__(self, cells: list[str]) -> None:
        self.ready: dict[str, bool] = {c: False for c in cells}
        self.online: dict[str, bool] = {c: False for c in cells}
        self.offline_since: dict[str, float] = {}  # cell -> loop time it went offline (after being online)
        self.orders: dict[str, dict[str, float]] = {}  # cell -> instance -> the newest order heard of that process

    def heard(self, cell: str, record: dict[str, Any], now: float) -> bool:
        """Take ``cell``'s status ``record`` (heard at loop time ``now``); whether it says the cell online anew."""
        renewed = self._renewed(cell, record)
        online = record["state"] == "online"
        if self.online[cell] and not online:
            self.offline_since[cell] = now
        elif online:
            self.offline_since.pop(cell, None)
        self.online[cell] = online
        # they said they cannot serve this job, or sit the round out (participation): none to wait for
        unfit = declared_count(record.get("devices_unfit", 0)) + declared_count(record.get("devices_away", 0))
        counted = record.get("devices_online")
        if isinstance(counted, int) and not isinstance(counted, bool) and unfit:
            counted += unfit
        self.ready[cell] = online and counted == record.get("devices_total")
        return renewed and online

    def _renewed(self, cell: str, record: dict[str, Any]) -> bool:
        """Whether ``record`` is newer than every record heard of its process (a new process: any order), after a
        record of the cell with an order (the first heard is no return): its (re)connect, not a heartbeat (the same
        order), nor a replay of a record heard before (an order not newer), nor a will (none). A few processes of
        each cell are remembered (:data:`KNOWN_INSTANCES`; a cell minting new ones still gets its task again at most
        :data:`MAX_RENEWALS` times a round: ``RoundCounts.renewal``)."""
        stamp = order_of(record)
        if stamp is None:
            return False
        known = self.orders.setdefault(cell, {})
        instance, order = stamp
        renewed = bool(known) and (instance not in known or order > known[instance])
        if instance not in known and len(known) >= KNOWN_INSTANCES:
            del known[next(iter(known))]  # the longest known
        known[instance] = max(order, known.get(instance, order))
        return renewed

    def offline_for(self, cell: str, now: float) -> float | None:
        """Seconds an offline cell has been offline since it was last online (None: online, or never was)."""
        gone = self.offline_since.get(cell)
        return None if self.online[cell] or gone is None else now - gone

    def absence(self, cell: str, wait: float) -> str | None:
        """Why ``cell`` takes no part in the job's start, the startup wait of ``wait`` seconds over: offline (never
        online yet, or went offline); None when it is online."""
        if self.online[cell]:
            return None
        if cell in self.offline_since:
            return f"offline at start: went offline before the startup wait ({wait:g} s) ended"
        return f"offline at start: not online within the startup wait ({wait:g} s)"

    def plannable(self, cell: str, now: float, deadline: float, rnd: int) -> bool:
        """Online, or offline for less than ``deadline``: a cell that just died is likely restarting, and its
        persistent session keeps the task for it (a cell gone for good delays one round, to the deadline)."""
        if self.online[cell]:
            return True
        away = self.offline_for(cell, now)
        if away is None or away >= deadline:
            return False
        log.info("cloud: round %s plans %s, offline for %.1f s: its session keeps the task", nth(rnd), cell, away)
        return True


def resend_on_repeat(
    counts: RoundCounts, messenger: Messenger, msg: Incoming, rnd: int, pending: set[str], resumed: bool = False
) -> bool:
    """``msg``, a report handled before, came again: whether to send its cell its task again
    (:meth:`RoundCounts.lost_task`, ``resumed`` as there); a refused repeat is logged and recorded with its kind."""
    cell = msg.topic.split("/")[-2]
    try:
        return counts.lost_task(cell, msg.header, rnd, pending, resumed)
    except Rejected as exc:
        messenger.reject(msg.topic, exc.kind, str(exc), cell)
        return False


def round_deadline(node: Any, rnd: int, why: str) -> None:
    """Close round ``rnd`` of ``node`` (a ``CloudServer``) a cell deadline from now, or one more later while the
    cloud has no broker connection: its cells cannot report meanwhile (walked: a broker down for 150 s, 3 cell
    deadlines, failed the job with 'no cell answered in rounds 5-7', of cells that were fine)."""

    def due() -> None:
        if node.transport.connected:
            node._close(rnd, why)
        else:
            round_deadline(node, rnd, why)

    node._timer = node.loop.call_later(node.cell_deadline, node._guard(due, "round deadline"))


def old_report(past: EndedJobs | None, cell: str, msg: Incoming, session: str | None) -> bool:
    """Signed (``session``: the cloud's): a report ``cell`` signed in a job of ``past`` (its service's ended jobs), not
    this one: an old copy the broker delivers again (``protocols.session.EndedJobs``), dropped and said once at info,
    not refused as a report of another session."""
    h = msg.header
    return (
        past is not None
        and session is not None
        and h.sender == cell == h.cell
        and h.session != session
        and past.old_copy(h.session, "cloud", f"cell {cell}'s report of round {nth(h.round)}")
    )


def report_refusal(
    cell: str,
    msg: Incoming,
    session: str | None,
    bounds: Mapping[str, float] | None,
    role: CloudRole | None = None,
) -> Rejected | None:
    """Why a report on ``cell``'s topic is refused before the role sees it, or None: it must be for that
    cell, with ``session`` (signed runs: the cloud's session) signed by that cell in it, claim in each sample
    count of ``role`` (``CloudRole.weight_keys``; default ``weight``) a weight within its multiple of the cell's
    bound in ``bounds`` (where it knows one), name in its device lists (``CloudRole.member_keys``) only devices of
    that cell and give each listed device (``CloudRole.member_weight_keys``) at most its own bound (where ``bounds``
    is a :class:`~protocols.bounds.CellBounds`, which knows them)."""
    h = msg.header
    if h.cell != cell:
        return Rejected(RejectKind.WRONG_SENDER, f"report for cell {h.cell!r} on the topic of cell {cell!r}")
    if session is not None and (h.sender != cell or h.session != session):
        if h.sender == cell:
            return Rejected(RejectKind.SIGNATURE, f"report of session {h.session!r}, this cloud's is {session!r}")
        return Rejected(RejectKind.WRONG_SENDER, f"report signed by {h.sender!r} on the topic of cell {cell!r}")
    bound = bounds.get(cell) if bounds is not None else None  # None: no weight bound known (the lists still count)
    if bound is not None:
        for key, times in (role.weight_keys() if role is not None else {"weight": 1.0}).items():
            limit = bound * times
            over = weight_over(msg.payload.meta.get(key), limit, f"the bound of cell {cell} ({limit:g} samples)")
            if over is not None:
                return Rejected(RejectKind.BOUND, over if key == "weight" else f"{key}: {over}")
    if not isinstance(bounds, CellBounds) or bounds.cell_of is None or role is None:
        return None
    for key in role.member_keys():
        stranger = _stranger(msg.payload.meta.get(key, []), cell, bounds.cell_of)
        if stranger is not None:
            return Rejected(RejectKind.WRONG_SENDER, f"{key} names {stranger[:40]!r}, not a device of cell {cell}")
    for weights_key, devices_key in role.member_weight_keys().items():
        over = _member_over(msg.payload.meta, weights_key, devices_key, cell, bounds)
        if over is not None:
            return Rejected(RejectKind.BOUND, over)
    return None


def _member_over(
    meta: Mapping[str, Any], weights_key: str, devices_key: str, cell: str, bounds: CellBounds
) -> str | None:
    """Why a report's per-device weights (``meta[weights_key]``, for the devices of ``meta[devices_key]``) are
    refused: one above its device's bound (unknown bounds pass; the role checks the lists' form)."""
    devices, weights = meta.get(devices_key), meta.get(weights_key)
    if not isinstance(devices, list) or not isinstance(weights, list):
        return None
    for device, weight in zip(devices, weights):
        bound = bounds.device_bound(cell, device) if isinstance(device, str) else None
        over = weight_over(weight, bound, f"the bound of device {str(device)[:40]}")
        if over is not None:
            return f"{weights_key}: {over}"
    return None


def _stranger(listed: object, cell: str, cell_of: Callable[[str], str | None]) -> str | None:
    """The first entry of a report's device list ``listed`` that is no device of ``cell`` (the role checks the
    list's form)."""
    for d in listed if isinstance(listed, list) else ():
        if not isinstance(d, str) or cell_of(d) != cell:
            return str(d)
    return None


def drop_non_finite(evaluation: dict[str, float]) -> str | None:
    """Drop the non-finite numbers of an ``evaluation`` (in place); what was dropped (``name = value``), or
    None if nothing was."""
    bad = sorted(k for k, v in evaluation.items() if isinstance(v, float) and not math.isfinite(v))
    return ", ".join(f"{k} = {evaluation.pop(k)}" for k in bad) or None
