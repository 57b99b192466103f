"""The operator's requests (submit, cancel) as the serving cloud takes them: signed, dated, each taken once.

A request carries its nonce (fresh from the OS) and the time the operator signed it (``at``,
``protocols.jobs.post_request``). The cloud takes a request only while it is fresh: signed at most
:data:`MAX_REQUEST_AGE` before the cloud's clock, and no more than that ahead of it. It remembers the nonce of every
fresh request it verified (at most :data:`MAX_REMEMBERED`, the oldest dropped, those older than the window forgotten)
in ``requests.json`` beside its queue, so a captured request replayed within the window is refused as a replay, also
after a restart, with its queue (``jobs.json``) or without it, and one replayed later as stale. Before, a request
carried no time: a cloud whose queue was lost queued a replayed submit again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocols.checkpoint import write_durably
from protocols.jobs import OPERATOR, JobError, open_job_record, request_nonce
from protocols.numbers import finite_number
from protocols.wire.keys import PublicKeys

log = logging.getLogger("fedtier.cloud.requests")

REQUESTS_FILE = "requests.json"
MAX_REQUEST_AGE = 600.0
"""Seconds a signed request stays valid after the operator signed it (and how far ahead of the cloud's clock its time
may be): wide enough for clocks kept by NTP and a broker that held the request a while, narrow enough that the nonces
of every request taken within it are remembered (:data:`MAX_REMEMBERED`)."""
MAX_REMEMBERED = 4096
"""Nonces remembered at most (~60 bytes each in ``requests.json``); past it the oldest is dropped, and a request no
newer than a dropped one is refused (so none is ever taken twice)."""


class OperatorRequests:
    """Opens the requests on the federation's submit topic: the operator's signature (with ``operator``, its public
    key; ``None``: an unsigned federation, where anyone may submit and nothing below applies), then its time and
    nonce. ``clock``: the cloud's (seconds since the epoch)."""

    def __init__(
        self,
        path: Path,
        operator: bytes | None,
        clock: Callable[[], float] = time.time,
        window: float = MAX_REQUEST_AGE,
        most: int = MAX_REMEMBERED,
    ) -> None:
        self.path, self.clock, self.window, self.most = path, clock, window, most
        self.operator = PublicKeys({OPERATOR: operator}) if operator is not None else None
        self.taken: dict[str, float] = {}  # nonce -> the time its request was signed
        self.floor = -float("inf")  # requests signed no later than this are refused: their nonces may be dropped
        self._load()

    def open(self, data: bytes, topic: str) -> dict[str, Any]:
        """The request in ``data``, verified and taken (its nonce remembered); :class:`JobError` saying why not."""
        record = open_job_record(data, topic, OPERATOR, self.operator.verify if self.operator else None)
        if self.operator is not None:
            self._take(record)
        return record

    def _take(self, record: dict[str, Any]) -> None:
        at, nonce, now = finite_number(record.get("at")), request_nonce(record), self.clock()
        if at is None or nonce is None:
            raise JobError(
                "the request carries no time or no nonce: it comes from a fedtier older than the cloud's, whose "
                "requests could be replayed; upgrade fedtier on the operator's machine (fedtier submit, fedtier cancel)"
            )
        if now - at > self.window:
            raise JobError(
                f"the request is {now - at:,.0f} s older than the cloud's clock allows ({self.window:,.0f} s): "
                "check the operator's clock (or it is a replay)"
            )
        if at - now > self.window:
            raise JobError(
                f"the request is dated {at - now:,.0f} s ahead of the cloud's clock, more than it allows "
                f"({self.window:,.0f} s): check the operator's clock"
            )
        if nonce in self.taken:
            raise JobError("the cloud took this request before (its nonce): a replay, refused")
        if at <= self.floor:
            raise JobError("the request is older than those the cloud still remembers: send it again")
        self.taken = {n: t for n, t in self.taken.items() if now - t <= self.window}  # the stale are refused anyway
        self.taken[nonce] = at
        while len(self.taken) > self.most:
            oldest = min(self.taken, key=self.taken.__getitem__)
            self.floor = max(self.floor, self.taken.pop(oldest))
        self._save()

    def _save(self) -> None:
        state = {"floor": self.floor if self.floor > -float("inf") else None, "taken": self.taken}
        try:
            write_durably(self.path, json.dumps(state).encode())
        except OSError as exc:  # not taken: a restart would not know it
            raise JobError(f"the cloud cannot record the request in {self.path}: {exc.strerror}") from None

    def _load(self) -> None:
        if not self.path.exists():
            return
        try:
            state = json.loads(self.path.read_bytes())
            taken = {str(n): float(t) for n, t in state["taken"].items()}
            floor = -float("inf") if state.get("floor") is None else float(state["floor"])
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            self.floor = self.clock()  # what it took is unknown: nothing signed before now is taken
            log.warning("%s is unreadable (%s): requests signed before now are refused", self.path, exc)
            return
        self.taken, self.floor = taken, floor
