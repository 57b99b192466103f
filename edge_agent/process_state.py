"""The parts of an agent process's state, grouped by what they answer: where each device stands
(:class:`Presence`), which job it serves (:class:`JobView`), and how long its devices trained
(:class:`TrainClock`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocols.roster import Roster, RosterError, Verifier, newer_roster
from protocols.session import EndedJobs
from protocols.transport.base import TimerHandle

log = logging.getLogger("fedtier.agent")


@dataclass
class Presence:
    """Where each device stands; ``lock`` guards ``present`` and the announcements (the I/O thread's
    heartbeat reads them)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    live: set[str] = field(default_factory=set)  # not yet left for good
    present: set[str] = field(default_factory=set)  # connected and announced online (the heartbeat keeps them so)
    fresh: set[str] = field(default_factory=set)  # read a manifest on their current connection
    polls: dict[str, TimerHandle] = field(default_factory=dict)  # an absent device's next reconnect


@dataclass
class JobView:
    """The job the devices serve: ``session`` pins their cloud view to one job's cloud session (``None``: any).
    ``long_lived`` devices stay connected between jobs, so they keep the newest verified roster and each
    device's latest cloud status and manifest records (the next job's roles start from them)."""

    session: str | None = None
    long_lived: bool = False
    roster: Roster | None = None  # long-lived: the newest verified roster (its members' keys)
    past_jobs: EndedJobs = field(default_factory=EndedJobs)  # long-lived: the jobs its service is done with
    last_status: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # per device
    last_manifest: dict[str, dict[str, Any]] = field(default_factory=dict)  # per device

    def newer_roster(self, data: bytes, verify: Verifier, federation: str) -> Roster | None:
        """The roster in ``data`` if it is newer than ``roster`` (``protocols.roster.newer_roster``), which it
        becomes; ``None`` otherwise (a refused one logged)."""
        if not data:
            return None
        try:
            roster = newer_roster(data, verify, federation, self.roster.version if self.roster else None)
        except RosterError as exc:
            log.warning("ignored a roster: %s", exc)
            return None
        if roster is not None:
            self.roster = roster
        return roster


@dataclass
class TrainClock:
    """Wall seconds the devices trained one by one, and with ``timing`` each training's span per device
    (``[round, edge_round, start, end]`` on the system-wide monotonic clock, comparable across processes of
    one machine)."""

    timing: bool = False
    seconds: float = 0.0
    compute: dict[str, list[list[float]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def timed(self, device: str, train: Callable[..., Any], batched: Callable[[], bool]) -> Callable[..., Any]:
        """``train`` adding its time to ``seconds`` unless ``batched()`` (in a cohort, devices train side by
        side: the cohort executor times it), and with ``timing`` its span to ``compute``."""
        spans = self.compute.setdefault(device, []) if self.timing else None

        def timed_train(task: Any, data: Any, trainer: Any, ctx: Any) -> Any:
            start = time.monotonic()
            try:
                return train(task, data, trainer, ctx)
            finally:
                end = time.monotonic()
                if not batched():
                    with self.lock:
                        self.seconds += end - start
                if spans is not None:
                    spans.append([ctx.round, ctx.edge_round, start, end])

        return timed_train
