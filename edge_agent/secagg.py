"""A device's side of secure aggregation at runtime (the protocol: ``protocols.privacy.secagg``).

On a task the device advertises fresh keys; it trains once it has sealed its shares for the roster
its cell sent (so the key and share phases take no training time); its result leaves masked, once
the cell routed the shares. Every ``secagg_*`` message must be for the aggregation in progress
(session, round, edge round) and, in signed runs, signed by the device's cell; anything else is
rejected and logged. In signed runs the device signs its keys and its view of the round with its
identity and checks its neighbours' against theirs: a cell caught lying (a substituted key, views that
disagree) is logged once per round with the reason and counted (``cell_lies``); the device reveals nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from protocols.algorithms.base import DeviceRole
from protocols.privacy.secagg import CellLied, RoundId, SecAggDevice, SecAggSettings
from protocols.rejections import Rejected, RejectKind
from protocols.round_text import nth_edge
from protocols.trainer import LocalData
from protocols.wire import topics
from protocols.wire.messenger import Messenger
from protocols.wire.payload import Payload

if TYPE_CHECKING:
    from protocols.roster import Roster
    from protocols.wire.envelope import Header, MessageKind
    from protocols.wire.keys import Trust
    from protocols.wire.messenger import Incoming

log = logging.getLogger("fedtier.agent")


class Host(Protocol):
    """What secure aggregation needs of its device agent (``edge_agent.agent.DeviceAgent`` is one)."""

    run: str
    cell: str
    device: str
    trust: Trust | None
    messenger: Messenger
    role: DeviceRole
    data: LocalData
    pending: int
    bytes_in: int
    bytes_out: int
    secagg: DeviceSecAgg | None

    def publish_result(self, result: Payload, round: int, edge_round: int) -> None: ...


def learn_roster(agent: Host, roster: Roster) -> None:
    """What the cloud's signed roster tells a device of its cell: its members' identity keys (a device
    enrolled after this one's keys file was written; secure aggregation checks each neighbour's key
    advertisement and view against them), its cell's key (rotated by ``fedtier provision renew --identity``:
    the old one signs it no task from then on) and the revoked nodes, no longer trusted."""
    trust = agent.trust
    if trust is None:
        return
    nodes = [agent.cell, *roster.members(agent.cell)]
    trust.learn({n: key for n in nodes if (key := roster.device_key(n)) is not None})
    trust.forget(n for n in roster.revoked if n != agent.device)


def cell_lies(agent: Host) -> int:
    """How many times ``agent`` caught its cell lying under secure aggregation (0 without it)."""
    return agent.secagg.cell_lies if agent.secagg is not None else 0


class DeviceSecAgg:
    """Secure aggregation of one device agent's tasks."""

    def __init__(self, agent: Host, settings: SecAggSettings) -> None:
        self.agent, self.settings = agent, settings
        self.state: SecAggDevice | None = None
        self.key: tuple[str | None, int, int] | None = None
        self._train: Callable[[], None] | None = None  # starts the task's training (once the shares are out)
        self._result: Payload | None = None
        self.cell_lies = 0  # aggregations in which this device caught its cell lying
        self.last_lie: str | None = None  # the reason, the last time

    def begin(self, h: Header, train: Callable[[], None]) -> None:
        """A task arrived: advertise keys; ``train`` runs once the shares are sealed."""
        if self._train is not None:  # the previous task never got its roster: it will not train
            self.agent.pending -= 1
        a = self.agent
        self.key = (h.session, h.round, h.edge_round)
        self.state = SecAggDevice(
            self.settings,
            RoundId(a.run, a.cell, h.round, h.edge_round),
            a.device,
            float(len(a.data))
            if getattr(a.role, "reveals_data_size", True)
            else 1.0,  # DP: weight 1, the size stays here
            identity=a.trust,
        )
        self._train, self._result = train, None
        self._send("secagg_keys", self.state.advertise())

    def _send(self, kind: MessageKind, payload: Payload) -> None:
        a = self.agent
        assert self.key is not None
        a.bytes_out += a.messenger.send(
            topics.device_result(a.run, a.cell, a.device),
            kind,
            payload,
            round=self.key[1],
            edge_round=self.key[2],
            cell=a.cell,
        )

    def on_message(self, topic: str, msg: Incoming) -> None:
        """A ``secagg_*`` message on this device's task topic."""
        a, h = self.agent, msg.header
        if h.cell != a.cell or (a.trust is not None and h.sender != a.cell):
            a.messenger.reject(
                topic,
                RejectKind.WRONG_SENDER,
                f"{h.kind} from {h.sender!r} of cell {h.cell!r}, not this device's cell",
                h.sender,
            )
            return
        if self.state is None or (h.session, h.round, h.edge_round) != self.key:
            a.messenger.reject(
                topic,
                RejectKind.STALE,
                f"{h.kind} for round {nth_edge(h.round, h.edge_round)}, not the aggregation in progress "
                "(stale or replayed)",
                h.sender,
            )
            return
        a.bytes_in += msg.nbytes
        try:
            if h.kind == "secagg_roster":
                self._send("secagg_shares", self.state.share(msg.payload))
                train, self._train = self._train, None
                if train is not None:
                    train()
            elif h.kind == "secagg_routed":
                self.state.receive(msg.payload)
                if self._result is not None:
                    self._send_masked()
            elif h.kind == "secagg_unmask":
                self._send("secagg_consent", self.state.consent(msg.payload))
            elif h.kind == "secagg_views":
                self._send("secagg_reveal", self.state.reveal(msg.payload))
            else:
                raise Rejected(RejectKind.MALFORMED, f"unexpected message kind {h.kind!r} for a device")
        except CellLied as exc:
            self.cell_lies += 1
            self.last_lie = str(exc)
            a.messenger.reject(topic, exc.kind, f"cell {h.sender} lied: {exc}", h.sender)
            self.state = None  # nothing more for this aggregation: the round is lost, the next one is not
        except Rejected as exc:
            a.messenger.reject(topic, exc.kind, str(exc), h.sender)

    def result_ready(self, result: Payload, round: int, edge_round: int) -> None:
        """The training's result: it leaves masked once the shares are routed."""
        if self.state is None or self.key is None or (round, edge_round) != self.key[1:]:
            who, key = self.agent.device, nth_edge(round, edge_round)
            log.warning("device %s: result of %s dropped, its aggregation is over", who, key)
            return
        self._result = result
        if self.state.shared:
            self._send_masked()

    def _send_masked(self) -> None:
        assert self.state is not None and self._result is not None and self.key is not None
        result, self._result = self._result, None
        try:
            masked = self.state.mask(result)
        except Rejected as exc:
            self.agent.messenger.reject(
                topics.device_task(self.agent.run, self.agent.cell, self.agent.device), exc.kind, str(exc), None
            )
            return
        self.agent.publish_result(masked, self.key[1], self.key[2])
