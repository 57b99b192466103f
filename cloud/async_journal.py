"""The asynchronous cloud's pushes taken since its last model version: what ``fedtier cloud --resume`` buffers
again under ``algorithm.mode = "async"`` (the model and version come from the checkpoint, ``cloud.checkpoint``).

Every push the cloud takes is appended, fsynced, before it counts (the message as received: replayed through the
same checks); when a version applies the buffer (after its checkpoint) the journal starts afresh at the next
version. Each entry names the version it was taken in: a cloud stopped between a checkpoint and the fresh start of
the journal finds the pushes of the version before, which the checkpoint's model holds already, and skips them.

It also keeps the cells heard holding a model of the job (an entry when one is first heard; every fresh start
names them all): a resumed cloud still marks the version it sends such a cell ``held``, so one restarted without its
journal refuses it, saying to resume (``cell_server.async_server``), rather than task its devices from version 0
again, which they refuse as replays. And the newest version sent each cell (an entry before a version or a resend
goes out; every fresh start names them all): a resumed cloud refuses a push from a version it never sent that cell
(one cell participation left out of it), as the cloud that stopped did.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from protocols.checkpoint import Journal
from protocols.wire.payload import Payload

log = logging.getLogger("fedtier.cloud")


class PushJournal:
    """The journal at ``path``; ``resumed``: the version a resumed cloud continues (its pushes are replayed), else
    ``None`` (a fresh start: the journal is emptied)."""

    def __init__(self, path: Path, resumed: int | None) -> None:
        self.file = Journal(path)
        self._version = resumed
        self._until: int | None = None  # resumed: where the pushes to take again end in the file (none: None)
        self._replaying = False  # taking the journaled pushes again: they are in the journal already
        self.holders: set[str] = set()  # cells heard holding a model of this job (kept across a resume)
        self.sent: dict[str, int] | None = {}  # cell -> the newest version sent to it (None: not known, an old journal)
        if resumed is not None and self._scan(resumed):
            return  # the file holds the pushes of this version: kept as it is, read again one at a time (replay)
        self.file.reset(self._head(resumed))

    def _scan(self, resumed: int) -> bool:
        """Read the journal of a resumed cloud a push at a time (never all of them in memory: a version may hold
        ``TAKE_PER_CELL`` x cells pushes): the cells it names as holders, and True if its pushes are of ``resumed``
        (a journal holds one version's: else the cloud stopped before it started afresh, and they are skipped)."""
        pushes = others = 0
        self.sent = None  # known from the journal's head on
        try:
            for n, e in enumerate(self.file.scan()):
                self.holders.update(str(c) for c in _held(e.meta.get("held")))
                self._take_sent(e.meta.get("sent"), head=n == 0)
                if "message" in e.tensors:
                    pushes, others = (pushes + 1, others) if e.meta.get("version") == resumed else (pushes, others + 1)
        except (OSError, ValueError) as exc:
            log.warning(
                "cannot read %s (%s): the pushes buffered when the cloud stopped are not replayed", self.file.path, exc
            )
            self.sent = None
            return False
        log.info("cloud: %d pushes of version %d to buffer again", pushes if not others else 0, resumed)
        if pushes and not others:
            self._until = self.file.end
        return self._until is not None

    def _take_sent(self, value: object, head: bool) -> None:
        """Take an entry's ``sent`` (cell -> version): the head's starts the map, a later one adds to it."""
        if isinstance(value, dict) and (head or self.sent is not None):
            self.sent = {**(self.sent or {}), **{str(c): v for c, v in value.items() if isinstance(v, int)}}

    def _head(self, version: int | None) -> Payload:
        return Payload({"version": version, "held": sorted(self.holders), "sent": self.sent})

    @staticmethod
    def _entry(version: int | None, topic: str, data: bytes) -> Payload:
        return Payload({"version": version, "topic": topic}, {"message": np.frombuffer(data, np.uint8)})

    @property
    def pending(self) -> bool:
        """Pushes to take again are left (:meth:`replay` not called yet)."""
        return self._until is not None

    def replay(self) -> Iterator[tuple[str, bytes]]:
        """The pushes to take again (once: the first call after a resume), read from the file one at a time."""
        until, self._until = self._until, None
        if until is None:
            return
        self._replaying = True
        try:
            for e in self.file.scan(until):
                if "message" in e.tensors and e.meta.get("version") == self._version:
                    yield str(e.meta["topic"]), e.tensors["message"].tobytes()
        finally:
            self._replaying = False

    def taken(self, version: int, topic: str, data: bytes) -> None:
        """A push taken in ``version`` (before it counts); a replayed one is in the journal already."""
        if not self._replaying:
            self.file.append(self._entry(version, topic, data))

    def holding(self, cell: str) -> None:
        """``cell`` is heard holding a model of this job (durably, the first time)."""
        if cell not in self.holders:
            self.holders.add(cell)
            self.file.append(Payload({"held": [cell]}))

    def sending(self, cells: list[str], version: int) -> None:
        """``version`` goes to ``cells`` now (durably, before it does)."""
        if cells:
            self.file.append(Payload({"sent": dict.fromkeys(cells, version)}))
            if self.sent is not None:
                self.sent.update(dict.fromkeys(cells, version))

    def applied(self, version: int) -> None:
        """A model version applied the buffered pushes (checkpointed): the journal starts afresh at ``version``."""
        self.file.reset(self._head(version))

    def close(self) -> None:
        self.file.close()


def _held(value: object) -> list[object]:
    """The cells an entry names as holding a model (none for an entry of another kind, or of an older journal)."""
    return value if isinstance(value, list) else []
