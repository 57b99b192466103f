"""The open edge round and its devices' liveness: a device back while its result is pending gets its task
again (back: online after offline, or online announced anew, its offline lost on the way: amqtt 0.12.1 drops what
a client sent just before its DISCONNECT when that client's session is busy, ``EmbeddedBroker`` works around it); one
gone offline (its will, a clean leave, a stale heartbeat) or revoked leaves the round, after a grace for a restart,
and the round closes once every remaining planned device answered, instead of waiting out ``device_deadline``.
Liveness needs ``heartbeat_timeout > 0``, and does not count under secure aggregation (its dropout recovery decides).
The cell server drives it through :class:`Host`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from protocols.failures import guarded
from protocols.round_text import nth_edge

from .liveness import Liveness, StatusChange
from .members import OnlineFlags
from .parts import EdgeRound, PresenceTimes

if TYPE_CHECKING:
    from protocols.answers import Answers
    from protocols.transport.base import EventLoop

    from .secagg import CellSecAgg

log = logging.getLogger("fedtier.cell")

MAX_RESENDS = 3
"""Times a device's task is sent again in one edge round, at most: each return (a status back online while its
result is pending) costs the cell a whole task, so a device that lies, flipping its status, gets no more."""


class Host(Protocol):
    """What the edge round's liveness needs of its cell server (``cell_server.server.CellServer`` is one): where
    its round is, its devices' liveness and the open round's answers, and the steps a leave or a return takes."""

    cell: str
    round: int
    edge_round: int
    in_round: bool
    loop: EventLoop
    liveness: Liveness
    timing: PresenceTimes
    answers: Answers
    edge: EdgeRound
    secagg: CellSecAgg | None

    @property
    def online(self) -> OnlineFlags: ...

    def fail(self, reason: str) -> None: ...

    def send_task(self, device: str, again: bool = False) -> None: ...

    def closing(self) -> str | None: ...

    def waiting_state(self) -> None: ...

    def close_edge(self, rnd: int, edge_round: int, why: str) -> None: ...


def pending(cell: Host, device: str) -> bool:
    """The open edge round waits for ``device``'s result (its liveness counts: not under secure aggregation,
    whose dropout recovery decides)."""
    return cell.answers.is_open and device in cell.answers.pending and cell.secagg is None


def on_status(cell: Host, device: str, change: StatusChange) -> None:
    """A device's status: one back while its result is pending gets its task again; one gone leaves the open
    edge round (after a grace: a restart's time back)."""
    back = change.online and change.heard and (change.changed or change.renewed)
    if back and pending(cell, device) and device in cell.edge.tasks:
        # back (an agent restarted, or reconnected with a new session, or a device that sat rounds out rejoined
        # and announced itself online anew while the cell, its offline lost, thought it online and sent the task
        # to no connection) while its result is pending: the task it was given may be lost
        again = cell.edge.resent[device] = cell.edge.resent.get(device, 0) + 1
        if again <= MAX_RESENDS:
            log.warning(
                "cell %s: %s is back while its result of %s is pending: its task again",
                cell.cell,
                device,
                nth_edge(cell.round, cell.edge_round),
            )
            cell.send_task(device, again=True)  # counted apart: a reconnect is no part of the job's traffic
        elif again == MAX_RESENDS + 1:
            log.warning(
                "cell %s: %s is back again while its result of %s is pending: its task was sent again %d times "
                "in this edge round, no more",
                cell.cell,
                device,
                nth_edge(cell.round, cell.edge_round),
                MAX_RESENDS,
            )
    if not change.changed:
        return
    if change.online:
        cell.loop.cancel(cell.liveness.leaving.pop(device, None))
    else:
        gone(cell, device, cell.timing.heartbeat_timeout + cell.timing.heartbeat)


def revoked(cell: Host, device: str) -> None:
    """``device`` was revoked: out of the open edge round at once."""
    cell.loop.cancel(cell.liveness.leaving.pop(device, None))
    if pending(cell, device):
        leave(cell, device, cell.round, cell.edge_round, "revoked")


def gone(cell: Host, device: str, grace: float) -> None:
    """``device`` went offline (its will, a clean leave, or a stale heartbeat): if the open edge round waits
    for its result, it leaves the round after ``grace`` seconds (heartbeat_timeout + one heartbeat after its
    will; at once when its heartbeat went stale) unless it is back by then (an agent that restarts gets its
    task again)."""
    if cell.timing.heartbeat_timeout <= 0 or not pending(cell, device):
        return
    r, e = cell.round, cell.edge_round
    cell.loop.cancel(cell.liveness.leaving.pop(device, None))
    if grace <= 0:
        leave(cell, device, r, e)
    else:
        cell.liveness.leaving[device] = cell.loop.call_later(
            grace, guarded(lambda: leave(cell, device, r, e), cell.fail, f"cell {cell.cell}: liveness timer")
        )


def waiting_soon(cell: Host) -> None:
    """``cell.waiting_state()`` once the results at hand are taken (posted to the loop, once an edge round at a
    time): results that come together (a cohort's, ``edge_agent/cohort.py``) make one record naming whom the edge
    round still waits for then, or none where they closed it, rather than one a result (9 of a standard round's
    11 state records)."""
    edge = cell.edge
    if edge.waiting_posted:
        return
    edge.waiting_posted = True

    def publish() -> None:
        edge.waiting_posted = False
        if cell.in_round and cell.edge is edge and cell.answers.is_open and cell.answers.pending:
            cell.waiting_state()

    cell.loop.post(guarded(publish, cell.fail, f"cell {cell.cell}: waiting state"))


def leave(cell: Host, device: str, rnd: int, edge_round: int, why: str = "offline") -> None:
    """Take ``device`` (offline) out of edge round ``rnd.edge_round`` if it is still open and waits for it."""
    cell.liveness.leaving.pop(device, None)
    if (
        not cell.in_round
        or (rnd, edge_round) != (cell.round, cell.edge_round)
        or not cell.answers.is_open
        or device not in cell.answers.pending
        or cell.online[device]
    ):
        return
    log.warning(
        "cell %s: %s is %s: edge round %s no longer waits for it", cell.cell, device, why, nth_edge(rnd, edge_round)
    )
    cell.answers.pending.discard(device)
    cell.edge.absent[device] = why
    closing = cell.closing()
    if closing is None:
        cell.waiting_state()
    elif closing == "all answered" and not (cell.answers.received or cell.answers.settled):
        cell.close_edge(rnd, edge_round, "all offline")
    else:
        cell.close_edge(rnd, edge_round, closing)
