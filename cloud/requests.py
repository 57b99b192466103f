"""The operator's requests (submit, cancel) as the serving cloud takes them: signed, dated, each taken once.

A request carries its nonce (fresh from the OS) and the time the operator signed it (``at``,
``protocols.jobs.post_request``). The cloud takes a request only while it is fresh: signed at most
:data:`MAX_REQUEST_AGE` before the cloud's clock, and no more than that ahead of it. It remembers the nonce of every
fresh request it verified (at most :data:`MAX_REMEMBERED`, the oldest dropped, those older than the window forgotten)
in ``requests.json`` beside its queue, so a captured request replayed within the window is refused as a replay, also
after a restart, with its queue (``jobs.json``) or without it, and one replayed later as stale. Before, a request
carried no time: a cloud whose queue was lost queued a replayed submit again.

A cloud that finds no ``requests.json`` (its first start, or its folder lost) takes no request signed before it
started: it cannot tell a replay of one taken before from a new one. It writes the file as it claims its folder
(:meth:`OperatorRequests.create`), so a restart finds it and takes what the operator sent while it was down.
A request's nonce is remembered once the cloud acted on it (queued, cancelled or refused it:
:meth:`OperatorRequests.take`), not before: a cloud killed in between gets the request again from its session and acts
on it then (before, its nonce was kept and the request refused as a replay, the job lost).
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

    def create(self) -> None:
        """Write ``requests.json`` if there is none (a signed federation's cloud, as it claims its folder)."""
        if self.operator is not None and not self.path.exists():
            try:
                self._save()
            except OSError as exc:
                log.error("cannot write %s (%s): a restart will take no request sent before it", self.path, exc)

    def open(self, data: bytes, topic: str) -> dict[str, Any]:
        """The request in ``data``, verified, fresh and not taken before; :class:`JobError` saying why not. Once the
        cloud acted on it, :meth:`take` it."""
        record = open_job_record(data, topic, OPERATOR, self.operator.verify if self.operator else None)
        if self.operator is not None:
            self._check(record)
        return record

    def take(self, record: dict[str, Any]) -> None:
        """Remember the nonce of ``record`` (an :meth:`open` one the cloud acted on), here and in ``requests.json``;
        one it cannot write there is remembered by this process alone (logged: its action is done)."""
        at, nonce, now = finite_number(record.get("at")), request_nonce(record), self.clock()
        if self.operator is None or at is None or nonce is None:
            return
        self.taken = {n: t for n, t in self.taken.items() if now - t <= self.window}  # the stale are refused anyway
        self.taken[nonce] = at
        while len(self.taken) > self.most:
            oldest = min(self.taken, key=self.taken.__getitem__)
            self.floor = max(self.floor, self.taken.pop(oldest))
        try:
            self._save()
        except OSError as exc:
            log.error("cannot record request %s in %s (%s): a restart would not know it", nonce, self.path, exc)

    def _check(self, record: dict[str, Any]) -> None:
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

    def _save(self) -> None:
        state = {"floor": self.floor if self.floor > -float("inf") else None, "taken": self.taken}
        write_durably(self.path, json.dumps(state).encode())

    def _load(self) -> None:
        if not self.path.exists():  # a first start, or a folder lost: what it took before is unknown
            self.floor = self.clock()
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
