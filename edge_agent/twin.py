"""One agent per device id: a second agent process started under a live device id is refused loudly.

Two agents with one device id share one broker session (the client id is the node's; provisioned brokers
force it from the login), so each connection takes the session from the other, silently, without end. So
every agent process draws a random *instance* nonce and puts it in its (signed) status records. Before it
announces anything, a starting process listens on its devices' own status topics for ``window`` seconds
(:func:`twin_window`): a record of another instance seen *twice* is live (the broker hands the
retained copy once per subscription; a second copy is a heartbeat, a re-announce, or the retained copy
again after the live agent took the session back and this one reconnected), and the process refuses to
start (:class:`TwinAgentError`, exit 1). A single copy is what a crashed predecessor left retained: it does
not block a restart. Where the broker retains no status record for the ids at all (no agent announced
under them yet), the check ends after a second. The refused process leaves a retained ``duplicate``
status record naming itself (cells ignore that state), so the running agent, which gets its own status
topic's retained record again when it reconnects after the takeover, says loudly that another agent took
its session, and re-announces itself.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any

from protocols.status import encode_status
from protocols.wire.envelope import WireError
from protocols.wire.signed import open_record, signer_of

log = logging.getLogger("fedtier.agent.twin")

GRACE = 1.0
"""Seconds a check waits for the retained record of its devices' status topics (sent right after the
SUBACK) before it concludes there is none."""
DUPLICATE = "duplicate"
"""The status state a refused second agent leaves (not online/offline: ``decode_status`` ignores it)."""


class TwinAgentError(ConnectionError):
    """Another agent process is live under this device id."""

    @classmethod
    def of(cls, device: str, other: str) -> TwinAgentError:
        """The refusal of a second agent for ``device`` (``other``: the live one's instance)."""
        return cls(
            f"device {device}: another agent process (instance {other}) is live under this device id on the "
            f"broker: refusing to start a second one (two agents with one id take the broker session from each "
            f"other); stop the other agent first"
        )


def twin_window(heartbeat: float) -> float:
    """How long a starting agent listens (seconds): one heartbeat and a second, and at least the two
    reconnects a takeover takes to show (the live agent's, then this one's, each within 1.5 x the
    transport's 1 s minimum reconnect delay: the two share one broker session, so the live one's records
    reach this one only as the retained copy re-sent when this one connects again)."""
    return max(heartbeat, 3.0) + 1.0


def new_instance() -> str:
    """A per-process nonce. Deliberately not drawn from the run seed: two processes of one config must
    differ, which is the whole point."""
    return secrets.token_hex(8)


class TwinWatch:
    """Reads one process's devices' own status topics: during :meth:`check` it counts other instances'
    records; afterwards such a record means another process took a device's session (``on_taken``)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.checking = False
        self.seen: dict[str, list[str]] = {}  # device -> other instances' records seen during the check
        self.twin: tuple[str, str] | None = None  # (device, instance) found live
        self.taken = 0  # records of another instance seen while running (takeovers noticed)
        self._found = threading.Event()
        self._any = threading.Event()  # a record of another instance seen during the check

    def on_status(self, device: str, topic: str, data: bytes, verify: Any, on_taken: Any) -> None:
        """A record on ``device``'s own status topic (signed by the device when ``verify`` is given)."""
        if not data or self.instance.encode() in data:
            return  # this process's own records (its heartbeats come back): no signature to check
        try:
            record = open_record(data, topic, signer_of(topic), verify)
        except WireError:
            return  # a forged or malformed record says nothing about who holds the session
        other = record.get("instance")
        if not isinstance(other, str) or other == self.instance:
            return
        if self.checking:
            seen = self.seen.setdefault(device, [])
            seen.append(other)
            self._any.set()
            if len(seen) >= 2 and self.twin is None:
                self.twin = (device, other)
                self._found.set()
            return
        self.taken += 1
        log.error(  # once per record of another instance: a takeover is rare and must be seen
            "device %s: another agent process (instance %s%s) connected under this device id and took this "
            "agent's broker session: two agents with one id take the session from each other; stop the other one "
            "(this one, instance %s, re-announces itself)",
            device,
            other,
            f", {record.get('reason')}" if record.get("state") == DUPLICATE else "",
            self.instance,
        )
        on_taken()

    def check(self, window: float, grace: float = GRACE) -> tuple[str, str] | None:
        """Wait up to ``window`` seconds for a live record of another instance: ``(device, instance)``,
        or ``None`` (none live: start). Call with :attr:`checking` set before subscribing. If no record of
        another instance came within ``grace`` seconds (the broker retains none: no agent ever announced
        under these ids, or only this process), there is no other agent: start at once."""
        start = time.monotonic()
        if self._any.wait(min(window, grace)):
            self._found.wait(max(0.0, window - (time.monotonic() - start)))
        self.checking = False
        return self.twin

    def refusal(self, topic: str, trust: Any) -> bytes:
        """The retained record a refused process leaves on the device's status topic."""
        return encode_status(
            DUPLICATE, topic=topic, trust=trust, instance=self.instance, reason="that process was refused and exited"
        )
