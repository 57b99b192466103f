"""The statuses of devices the federation revoked, kept off the broker by their cell for as long as it runs.

A revoked device's retained status is cleared by its cell (an empty retained message) when the signed roster
revokes it. A device still connected with valid broker credentials may publish it again: a provisioned Mosquitto
refuses it (its ACL, reloaded at revocation, no longer grants the device anything: the live connection stays but
can neither read nor write, and its will is not published either; ``tests/test_membership.py``), a broker without
per-node ACLs (amqtt, a plain Mosquitto with a password file or none) passes it on, and it would stay retained
until the broker restarts. The cell therefore listens on the status topic of each revoked device (its own topics
only, where revocation recorded the cell or did not say) and clears whatever comes there again, saying so once
per device; the job's cell server ignores those statuses (``liveness.revoked``) and refuses what the device
signs, so none of it reaches a round, an aggregate or the devices a record counts.

A device's first status after the clear that says it is offline is its last word, not a sign of a broker without
ACLs: a serving agent the roster revokes reads it on its live connection, stops and says itself offline, which the
broker still takes before the operator's ``fedtier provision revoke`` reloads its ACLs (published first, so the
revoked node learns it). That one is cleared and said at info; any other status (online, idle, a second record) is
the warning."""

from __future__ import annotations

import logging
from functools import partial

from protocols.roster import Roster
from protocols.status import decode_status
from protocols.transport.base import Transport
from protocols.wire import topics

log = logging.getLogger("fedtier.cell.service")


class RevokedStatuses:
    """The revoked devices of cell ``cell`` of run ``run`` whose status topics it keeps clear."""

    def __init__(self, run: str, cell: str) -> None:
        self.run, self.cell = run, cell
        self.devices: set[str] = set()  # revoked ids whose status under this cell it clears
        self.said: set[str] = set()  # those it logged as still publishing (once each)
        self.heard: set[str] = set()  # those it heard a status of since it cleared them
        self.cleared_again = 0  # statuses cleared after the first clear

    def take(self, roster: Roster, transport: Transport) -> None:
        """The revoked ids of ``roster`` that may be this cell's devices: each one new here is cleared at once and
        watched on ``transport`` from now on (a revoked cell clears nothing: its own cell server is gone)."""
        new = {n for n in roster.revoked - self.devices if roster.revoked_cell(n) in (self.cell, None)}
        for device in sorted(new - {self.cell}):
            transport.publish(self._topic(device), b"", retain=True)
            transport.subscribe(self._topic(device), partial(self._heard, transport, device))
        self.devices |= new

    def watch(self, transport: Transport) -> None:
        """Listen on each revoked device's status topic on ``transport`` (a new connection)."""
        for device in sorted(self.devices - {self.cell}):
            transport.subscribe(self._topic(device), partial(self._heard, transport, device))

    def _topic(self, device: str) -> str:
        return topics.device_status(self.run, self.cell, device)

    def _heard(self, transport: Transport, device: str, topic: str, data: bytes) -> None:
        if not data:  # cleared (our own clear coming back, or nothing retained)
            return
        self.cleared_again += 1
        first, record = device not in self.heard, decode_status(data, topic)  # (unverified: its state is a hint)
        self.heard.add(device)
        if first and record is not None and record["state"] == "offline":
            log.info(
                "cell %s: revoked device %s said itself offline as it stopped (its last status, sent as it learnt "
                "it was revoked): cleared",
                self.cell,
                device,
            )
        elif device not in self.said:
            self.said.add(device)
            log.warning(
                "cell %s: revoked device %s still publishes its status (a broker without per-node ACLs passes it on): "
                "cleared again, each time (logged once)",
                self.cell,
                device,
            )
        transport.publish(topic, b"", retain=True)
