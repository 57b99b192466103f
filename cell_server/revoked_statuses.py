"""The statuses of devices the federation revoked, kept off the broker by their cell for as long as it runs.

A revoked device's retained status is cleared by its cell (an empty retained message) when the signed roster
revokes it. A device still connected with valid broker credentials may publish it again: a provisioned Mosquitto
refuses it (its ACL, reloaded at revocation, no longer grants the device anything: the live connection stays but
can neither read nor write, and its will is not published either; ``tests/test_membership.py``), a broker without
per-node ACLs (amqtt, a plain Mosquitto with a password file or none) passes it on, and it would stay retained
until the broker restarts. The cell therefore listens on the status topic of each revoked device (its own topics
only, where revocation recorded the cell or did not say) and clears whatever comes there again, saying so once
per device; the job's cell server ignores those statuses (``liveness.revoked``) and refuses what the device
signs, so none of it reaches a round, an aggregate or the devices a record counts."""

from __future__ import annotations

import logging
from functools import partial

from protocols.roster import Roster
from protocols.transport.base import Transport
from protocols.wire import topics

log = logging.getLogger("fedtier.cell.service")


class RevokedStatuses:
    """The revoked devices of cell ``cell`` of run ``run`` whose status topics it keeps clear."""

    def __init__(self, run: str, cell: str) -> None:
        self.run, self.cell = run, cell
        self.devices: set[str] = set()  # revoked ids whose status under this cell it clears
        self.said: set[str] = set()  # those it logged as still publishing (once each)
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
        if device not in self.said:
            self.said.add(device)
            log.warning(
                "cell %s: revoked device %s still publishes its status (a broker without per-node ACLs passes it on): "
                "cleared again, each time (logged once)",
                self.cell,
                device,
            )
        transport.publish(topic, b"", retain=True)
