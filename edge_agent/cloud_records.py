"""What an agent process's devices do on the cloud's records (on the loop): each device reads the cloud's
``finished`` control record, status and round manifest on its own connection, and leaves on its current
session's ``finished`` (long-lived: stays connected, idle, for the next job).

With churn (``availability(round) -> devices that take part in that cloud round``), on the cloud's round
manifest a device that does not take part says offline and disconnects (after the results it owes: the
manifest is handled after them), then reconnects every ``rejoin_poll`` seconds just long enough to read the
retained manifest, and stays, announced online, from the first round it takes part in. Its polls start clean
(ending what the broker queued while it sat out); it is persistent again once it stays.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from protocols.rejections import RejectKind
from protocols.round_text import nth
from protocols.session import CloudSession, decode_manifest
from protocols.status import decode_status
from protocols.wire.messenger import Messenger

from .agent import DeviceAgent
from .connections import DeviceConnections
from .process_state import JobView, Presence

log = logging.getLogger("fedtier.agent")


class CloudRecords:
    """The cloud's records as the devices of one process read them, and their going and coming back.

    ``clouds`` and ``agents`` are the process's own dicts (it replaces their entries per job); ``leave``,
    ``job_done`` and ``connect(device, transport, present)`` are the process's."""

    def __init__(
        self,
        clouds: dict[str, CloudSession],
        agents: dict[str, DeviceAgent],
        presence: Presence,
        job: JobView,
        links: DeviceConnections,
        rejoin_poll: float,
        *,
        leave: Callable[[str], None],
        job_done: Callable[[str], None],
        connect: Callable[[str, Any, bool], None],
    ) -> None:
        self.clouds, self.agents, self.presence, self.job, self.links = clouds, agents, presence, job, links
        self.rejoin_poll = rejoin_poll
        self.availability: Callable[[int], Iterable[str]] | None = None  # churn: who takes part in a round
        self.ended_wait: float | None = None  # one-shot: how long a device that finds its job ended waits for a cloud
        self.ended: dict[str, str] = {}  # device -> the ended session it left on (its job was over before it started)
        self._ended_timers: set[str] = set()
        self._leave, self._job_done, self._connect = leave, job_done, connect

    def on_control(self, device: str, messenger: Messenger, topic: str, data: bytes) -> None:
        if not data:
            return  # a cleared retained record
        msg = messenger.receive(topic, data, kinds=("control",))
        if msg is not None and messenger.signed and msg.header.sender != "cloud":
            messenger.reject(
                topic, RejectKind.WRONG_SENDER, f"control record signed by {msg.header.sender!r}, not the cloud", None
            )
            return
        if msg is not None and msg.payload.meta.get("event") == "finished":
            self.clouds[device].on_finished(msg.payload.meta.get("session"))
            self.update(device)

    def on_cloud_status(self, device: str, topic: str, data: bytes) -> None:
        record = decode_status(data, topic, self.agents[device].trust) if data else None
        if self.job.long_lived:
            self.job.last_status[device] = record
        self.clouds[device].on_status(record)
        self.update(device)

    def on_manifest(self, device: str, topic: str, data: bytes) -> None:
        record = decode_manifest(data, topic, self.agents[device].trust) if data else None
        if record is not None:
            if self.job.long_lived:
                self.job.last_manifest[device] = record
            self.clouds[device].on_manifest(record)
            self.presence.fresh.add(device)
            self.update(device)

    def update(self, device: str) -> None:
        """Leave on the current session's ``finished``; with churn, go or stay for the current round."""
        cloud = self.clouds[device]
        if device not in self.presence.live:
            return
        if cloud.finished:
            log.info("device %s: the run is finished", device)
            if self.job.long_lived:
                self._job_done(device)
            else:
                self._leave(device)
            return
        if cloud.ended is not None and self.ended_wait is not None and device not in self._ended_timers:
            self._ended_timers.add(device)  # as `fedtier cell`: a new run's cloud may be about to start
            self.links.loop.call_later(self.ended_wait, lambda: self._job_over(device))
        rnd = cloud.round
        if self.availability is None or rnd is None:
            return
        takes_part = device in set(self.availability(rnd))
        if device in self.presence.present:
            if not takes_part:
                log.info("device %s: not in round %s, leaving for now", device, nth(rnd))
                with self.presence.lock:
                    self.presence.present.discard(device)
                    self.agents[device].announce("offline")
                self._disconnect(device)
        elif device in self.presence.fresh:  # a poll that read the manifest
            if takes_part:
                log.info("device %s: back for round %s", device, nth(rnd))
                self.links.transports[device].persist()
                with self.presence.lock:
                    self.presence.present.add(device)
                    self.agents[device].announce("online")
            else:
                self._disconnect(device)

    def _job_over(self, device: str) -> None:
        """``ended_wait`` after ``device`` found its job ended (``CloudSession.ended``): still so, it leaves."""
        ended = self.clouds[device].ended
        if ended is not None and device in self.presence.live:
            log.warning("device %s: the job was over before it started (cloud session %s finished)", device, ended)
            self.ended[device] = ended
            self._leave(device)

    def _disconnect(self, device: str) -> None:
        """Close the connection cleanly (after its pending publishes) and poll again later."""
        self.links.transports[device].close()
        self.presence.polls[device] = self.links.loop.call_later(self.rejoin_poll, lambda: self._poll(device))

    def _poll(self, device: str) -> None:
        if device not in self.presence.live:
            return
        try:
            # a clean session: it ends the one the device left, and what the broker queued for it
            # while it sat out (records it reads retained anyway); persistent again once it stays
            self._connect(device, self.links.open(device, persistent=False), False)
        except (ConnectionError, RuntimeError) as exc:
            log.warning("device %s: reconnect failed (%s); retrying", device, exc)
            self.links.transports[device].close(flush_timeout=0)
            self.presence.polls[device] = self.links.loop.call_later(self.rejoin_poll, lambda: self._poll(device))
