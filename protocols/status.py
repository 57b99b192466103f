"""Liveness records published (retained) on ``fedtier/{run}/status/{node}``.

On a run with signing keys, a record carries its node's signature (``protocols.wire.signed``) and a
reader with ``trust`` drops, with a logged reason, any record that is not signed by the node its
topic names.

A long-lived node (``fedtier cloud|cell|agent --serve``) says :data:`IDLE` between jobs: its process is up
(with its capabilities) but it serves no job, so the record names no job session. Everything that plans a
job counts only ``online`` records of its own session, so an idle node is never planned: it is, for a job,
as good as offline (the fleet view shows it up and idle). Its will still says ``offline`` if it dies; and
since a will can be lost (a broker restarted without its sessions), an idle node re-publishes its record
every ``heartbeat`` seconds it declares in it (:class:`IdleBeat`): readers deem an idle record offline once
:data:`IDLE_MISSED` periods pass without one (:func:`idle_deadline`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from .numbers import finite_number
from .wire.envelope import WireError
from .wire.ratelog import RateLimitedLog
from .wire.signed import open_record, seal_record, signer_of

if TYPE_CHECKING:
    from .transport.base import EventLoop, TimerHandle, Transport
    from .wire.keys import PublicKeys, Trust

log = logging.getLogger("fedtier.status")
IDLE = "idle"
"""The state of a long-lived node between jobs: up, serving no job (never counted online by a job)."""
STATES = ("online", "offline", IDLE)
IDLE_MISSED = 3
"""Heartbeats an idle node may miss before readers deem it offline (its will lost, e.g. with the broker)."""
_rejections = RateLimitedLog(log)
T = TypeVar("T")


def encode_status(state: str, *, topic: str = "", trust: Trust | None = None, **extra: Any) -> bytes:
    """A small JSON record: ``{"state": "online"|"offline"|"idle", ...}``, signed for ``topic`` with ``trust``."""
    return seal_record({"state": state, **extra}, topic, trust.sign if trust is not None else None)


def decode_status(data: bytes, topic: str = "", trust: PublicKeys | None = None) -> dict[str, Any] | None:
    """Parse a status record; ``None`` if it is not one (it is then ignored) or, with ``trust``, if it
    is not signed by the node of ``topic`` (logged). An empty payload is a retained record cleared (a cell
    clears its revoked device's): no record, and nothing to log."""
    if not data:
        return None
    try:
        record = open_record(data, topic, signer_of(topic), trust.verify if trust is not None else None)
    except WireError as exc:
        if trust is not None:
            _rejections.warning("rejected a status record on %s: %s", topic, exc)
        return None
    if record.get("state") not in STATES:
        return None
    return record


def idle_deadline(received: float | None, heartbeat: Any) -> float | None:
    """When an idle record received at ``received`` goes stale: :data:`IDLE_MISSED` of its declared
    ``heartbeat`` periods later (``None``: it declares none, an older node: never)."""
    period = finite_number(heartbeat)  # the node's word: a bool, NaN or 10**400 is no period
    if received is None or period is None or period <= 0:
        return None
    return received + IDLE_MISSED * period


def beat_stamp() -> dict[str, float]:
    """The ``published`` time (Unix seconds) a repeated idle record carries: a reader that gets it retained (a view
    opened after the node's last beat, as ``fedtier fleet``) ages it from then, not from its arrival."""
    return {"published": round(time.time(), 3)}


def order_stamp() -> dict[str, float]:
    """The ``order`` a status record of a process carries: that process's monotonic clock when it said it. A process
    says one node's status over several connections (an agent's watch connection says its devices idle, then each
    device's own connection says it online), and a broker need not deliver records of different connections in the
    order they were published (amqtt does not: each connection's messages reach its broadcast queue from a task of
    their own): a reader takes none older than the newest it took of the same process (``instance``). A will is
    said by the broker, at a time no process chose: only one that a newer record of its process supersedes in any
    case (an agent's watch connection's, a process that lives on in its devices' connections) carries one."""
    return {"order": round(time.monotonic(), 6)}


def order_of(record: dict[str, Any]) -> tuple[str, float] | None:
    """The ``(instance, order)`` of a record said by a process (:func:`order_stamp`), or ``None``: a record with no
    order (a will, said by the broker; an older node's) or of no instance, which no other record can be ordered with."""
    order, instance = finite_number(record.get("order")), record.get("instance")
    return (instance, order) if order is not None and isinstance(instance, str) else None


def outdated(record: dict[str, Any], newest: tuple[str, float] | None) -> bool:
    """Whether ``record`` is older than ``newest``, the ``(instance, order)`` of the newest record taken of its node
    (:func:`order_stamp`); a record of another process, or with no order, never is."""
    order = finite_number(record.get("order"))
    return newest is not None and order is not None and record.get("instance") == newest[0] and order < newest[1]


def published_age(record: dict[str, Any]) -> float:
    """Seconds since ``record`` says it was published (its ``published`` time; 0 without one, or one ahead of this
    clock). Only a record first seen retained is aged so (clocks a few seconds apart do not matter beside three
    heartbeats); one heard live counts from its arrival."""
    at = finite_number(record.get("published"))
    age = time.time() - at if at is not None else 0.0
    return age if math.isfinite(age) and age > 0 else 0.0


def idle_status(topic: str, trust: Trust | None, **extra: Any) -> bytes:
    """A long-lived node's status between jobs: :data:`IDLE`, with this machine's capabilities (versions
    included) and no job session."""
    from .capabilities import machine_caps

    return encode_status(IDLE, topic=topic, trust=trust, caps=dict(machine_caps()), **extra)


def beating_idle_status(topic: str, trust: Trust | None, period: float, **extra: Any) -> bytes:
    """A long-lived node's idle status declaring the ``period`` it re-publishes it at (``heartbeat``) and when it
    was published (:func:`beat_stamp`); a ``period`` of 0 declares neither (published once)."""
    beat = {"heartbeat": period, **beat_stamp()} if period > 0 else {}
    return idle_status(topic, trust, **beat, **order_stamp(), **extra)


def between_jobs_status(topic: str, trust: Trust | None, idle_heartbeat: float | None, **extra: Any) -> bytes:
    """A node's status as a job's connection closes. With ``idle_heartbeat``, a long-lived node that waits for the
    next job: idle, said at once ("offline" until its next connection said idle read as a stopped node), declaring
    the heartbeat its next connection beats at, so that readers deem it offline if no beat follows (it died, or was
    stopped while the broker was unreachable, before that connection: the closed one's will never fires). ``None``:
    offline, as it stops (a clean disconnect does not fire its will)."""
    if idle_heartbeat is None:
        return encode_status("offline", topic=topic, trust=trust, **order_stamp(), **extra)
    return beating_idle_status(topic, trust, idle_heartbeat, **extra)


def between_jobs(
    transport: Transport, topic: str, trust: Trust | None, idle_heartbeat: float | None, **extra: Any
) -> None:
    """Publish (retained) a long-lived node's :func:`between_jobs_status`."""
    transport.publish(topic, between_jobs_status(topic, trust, idle_heartbeat, **extra), retain=True)


def idle_while(
    loop: EventLoop,
    transport: Transport,
    topic: str,
    trust: Trust | None,
    period: float,
    wait: Callable[[], T | None],
    **extra: Any,
) -> T | None:
    """Say idle on ``topic`` (an :class:`IdleBeat` every ``period`` seconds) while ``wait()`` runs ``loop`` until
    a job comes, and return what it returns; ``None`` (the node stops) is said offline before the caller
    disconnects. ``wait`` returns with the loop not running, so no beat follows."""
    return idle_each_while(loop, transport, [(topic, trust, extra)], period, wait)


def idle_each_while(
    loop: EventLoop,
    transport: Transport,
    statuses: list[tuple[str, Trust | None, dict[str, Any]]],
    period: float,
    wait: Callable[[], T | None],
) -> T | None:
    """:func:`idle_while` for several nodes on one connection (one process's devices): each ``(topic, trust,
    extra)`` of ``statuses`` said idle, each signed by its own ``trust``; all said offline if the process stops."""
    beats = [IdleBeat(loop, transport, topic, trust, period, **extra) for topic, trust, extra in statuses]
    for idle in beats:
        loop.post(idle.start)  # before the job's status
    got = wait()
    for idle in beats:
        idle.stop()
    if got is None:
        for topic, trust, extra in statuses:
            between_jobs(transport, topic, trust, None, **extra)
    return got


class IdleBeat:
    """A long-lived node's idle status on ``topic`` (retained), published by :meth:`start` and again every
    ``period`` seconds (declared in the record as ``heartbeat``; 0: once, declaring none) until :meth:`stop`.
    Both run on ``loop``'s thread (or while it is not running), so no beat follows the stop."""

    def __init__(
        self, loop: EventLoop, transport: Transport, topic: str, trust: Trust | None, period: float, **extra: Any
    ) -> None:
        self.loop, self.transport, self.topic, self.period = loop, transport, topic, period
        self.trust, self.extra = trust, extra
        self._timer: TimerHandle | None = None
        self._stopped = False

    def start(self) -> None:
        """Publish the record now (each beat signed with its ``published`` time), and schedule the next beat."""
        if self._stopped:
            return
        record = beating_idle_status(self.topic, self.trust, self.period, **self.extra)
        self.transport.publish(self.topic, record, retain=True)
        if self.period > 0:
            self._timer = self.loop.call_later(self.period, self.start)

    def stop(self) -> None:
        """No more beats (the node serves a job, or says offline next)."""
        self._stopped = True
        self.loop.cancel(self._timer)
