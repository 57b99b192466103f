"""What a cell knows of its devices' presence: their online flags (compact, ``members.OnlineFlags``), when
each was last heard, the capabilities each announced (and whether they meet the job's requirements), and
the devices revoked for good. The cell server decides what a change means for its rounds."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protocols.capabilities import unmet
from protocols.status import order_of, outdated

from .members import DeviceList, OnlineFlags

if TYPE_CHECKING:
    from protocols.config import RequirementsSection
    from protocols.transport.base import TimerHandle

log = logging.getLogger("fedtier.cell")


@dataclass(frozen=True)
class StatusChange:
    """What a device's status record told: whether it is ``online``, whether the cell had ``heard`` of it
    before (a first status of a started cell is no return), whether its flag ``changed``, and whether it is
    ``renewed``: a record its process said anew (``protocols.status.order_stamp``: another instance, or a newer
    order), not its last one repeated (a heartbeat, a retained copy delivered again)."""

    online: bool
    heard: bool
    changed: bool
    renewed: bool = False


class Liveness:
    """The presence of one cell's ``devices`` (all online at first with ``assume_online``)."""

    def __init__(
        self,
        cell: str,
        devices: DeviceList,
        assume_online: bool = False,
        requirements: RequirementsSection | None = None,
    ) -> None:
        self.cell = cell
        self.online = OnlineFlags(devices, assume_online)
        self.last_seen: dict[str, float] = {}  # device -> loop time of its last status record
        self.requirements = requirements
        self.unmet: dict[str, str] = {}  # device -> why it cannot serve this job (its announced capabilities)
        self.unfit: dict[str, str] = {}  # device -> why it said it cannot serve this job (e.g. its data)
        self.caps: dict[str, dict[str, Any]] = {}  # device -> capabilities its latest signed status announced
        self.revoked: set[str] = set()  # devices taken out for good (revoke): their statuses are ignored
        self.leaving: dict[str, TimerHandle] = {}  # offline devices the open edge round waits for, a while
        self.newest: dict[str, tuple[str, float]] = {}  # device -> (instance, order) of its newest ordered record

    def device_of(self, node: str) -> str | None:
        """The device of a status topic's node (``device.<id>``) if it is one of this cell's, not revoked."""
        if not node.startswith("device.") or node[len("device.") :] not in self.online:
            return None
        device = node[len("device.") :]
        return None if device in self.revoked else device

    def outdated(self, device: str, record: dict[str, Any]) -> bool:
        """Whether ``record`` is older than a status of ``device``'s process taken already (``protocols.status.
        order_stamp``: e.g. its agent's idle, said on its watch connection, delivered after its online): not taken."""
        return outdated(record, self.newest.get(device))

    def heard(self, device: str, record: dict[str, Any], now: float) -> StatusChange:
        """Take ``device``'s (verified, not :meth:`outdated`) status ``record``, heard at loop time ``now``."""
        renewed = False
        if (stamp := order_of(record)) is not None:
            renewed = self.newest.get(device) != stamp
            self.newest[device] = stamp
        online = record["state"] == "online"
        if online:
            self.unfit.pop(device, None)
        caps = record.get("caps")
        if online and isinstance(caps, dict):
            self.caps[device] = caps  # the fleet view on the metrics port (monitor.exporter)
        if online and self.requirements is not None:
            reason = unmet(caps if isinstance(caps, dict) else None, self.requirements)
            if reason is None:
                self.unmet.pop(device, None)
            elif self.unmet.get(device) != reason:
                self.unmet[device] = reason
                log.info("cell %s: %s does not meet the job's requirements: %s", self.cell, device, reason)
        heard = device in self.last_seen
        self.last_seen[device] = now
        changed = self.online[device] != online
        if changed:
            self.online[device] = online
        return StatusChange(online, heard, changed, renewed)

    def offline(self, devices: Iterable[str]) -> set[str]:
        """Those of ``devices`` (of this cell) that are offline."""
        return {d for d in devices if d in self.online and not self.online[d]}

    def sitting_out(self, taking_part: Iterable[str]) -> int:
        """How many of this cell's devices are offline and take no part in the round (not in ``taking_part``:
        participation), neither revoked nor unfit (counted apart): they left by design, nobody waits for them.
        Counted from the flags, with no pass over the devices (said at each status change; a simulated cell may
        hold 10^6): the offline ones, less those that are this cell's among the others (one vectorised search)."""
        kept = self.online.devices.among({*taking_part, *self.revoked, *self.unfit})
        return len(self.online) - self.online.count() - sum(1 for d in kept if not self.online[d])

    def unheard(self, devices: Iterable[str]) -> set[str]:
        """Those of ``devices`` (of this cell) offline and never heard of (no status since the cell started)."""
        return {d for d in self.offline(devices) if d not in self.last_seen}

    def unavailable(self, device: str) -> str | None:
        """Why ``device`` cannot be planned now (revoked, offline, or short of the job's requirements), or None."""
        if device in self.revoked:
            return "revoked"
        if device in self.unfit:
            return f"cannot serve: {self.unfit[device]}"
        if not self.online[device]:
            return "offline"
        if device in self.unmet:
            return f"requirements: {self.unmet[device]}"
        return None

    def cannot_serve(self, device: str, reason: str) -> bool:
        """``device`` said (in its idle status) that it cannot serve this job, and why: it is absent with that
        reason, and counted among the devices that cannot serve the job (a job none can serve fails with it).
        True if the cell did not know it yet."""
        new = device not in self.unfit
        if self.unfit.get(device) != reason:
            log.warning("cell %s: %s cannot serve this job: %s", self.cell, device, reason)
        self.unfit[device] = reason
        return new

    def stale(self, now: float, timeout: float) -> Iterator[str]:
        """Each online device whose last status is older than ``timeout`` seconds, deemed offline as it is
        yielded."""
        for d, online in self.online.items():
            if online and now - self.last_seen.get(d, now) > timeout:
                log.warning(
                    "cell %s: no heartbeat from %s for %.1f s, deemed offline", self.cell, d, now - self.last_seen[d]
                )
                self.online[d] = False
                yield d

    def revoke(self, device: str) -> bool:
        """Take ``device`` out for good (offline whatever its statuses say); False if it is not one of this
        cell's or was revoked already."""
        if device not in self.online or device in self.revoked:
            return False
        log.warning("cell %s: %s revoked", self.cell, device)
        self.revoked.add(device)
        self.unfit.pop(device, None)  # counted as revoked only (out of the total), not also as unfit
        self.online[device] = False
        return True
