"""An asynchronous cell's crash-consistent state: what ``fedtier cell --resume`` continues from under
``algorithm.mode = "async"`` (a cell of rounds has ``cell_server.recovery``).

The cell journals, each entry fsynced before it acts on it, the cloud model it adopted last (which starts
the journal afresh), every cell model version it made since (before a device task carries it), and its last
push to the cloud (before it is published). A resumed cell adopts that cloud model again, numbers its model
versions past every one it used (its devices refuse a task numbered below one they had: a replay), and
sends its last push again: the same message, which a cloud that had it counts once, and which tells a cloud
that has sent the cell a newer model since that the cell may have lost it (taken, acknowledged to the
broker, and the cell died before journaling it): the cloud sends it the current model
(``cloud.parts.RoundCounts.lost_task``). The progress made since the last push is lost, as a crashed
device's is. On disk: one cloud model and one push at most.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols.checkpoint import Journal
from protocols.wire.payload import Payload

log = logging.getLogger("fedtier.cell")


@dataclass
class Resumed:
    """What an asynchronous cell's journal holds: the cloud model it adopted last (its version and session),
    the newest model version the cell used, and its last push message (``None``: none since it started)."""

    global_version: int
    session: str | None
    model: Mapping[str, np.ndarray]
    version: int
    push: bytes | None


class AsyncJournal:
    """The journal of an asynchronous cell (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.file = Journal(path)
        self._head: Payload | None = None  # the cloud model adopted last (the journal's first entry)
        self._push: bytes | None = None  # the last push: kept across a new cloud model (re-sent on resume)
        self.used: int | None = None  # a fresh start: the newest model version the journal says a task carried

    def load(self, resume: bool) -> Resumed | None:
        """What to continue from (``resume``), else ``None`` and the journal is removed; an unreadable or
        empty journal is logged and removed (the cell then starts afresh). A fresh start keeps the newest model
        version the journal names (:attr:`used`): its cell numbers its versions past it (its devices refuse a
        task numbered below one they had, as a replay)."""
        if not resume:
            try:
                self.used = max((int(e.meta["version"]) for e in self.file.read() if "version" in e.meta), default=None)
            except (OSError, ValueError, KeyError, TypeError):
                self.used = None
        if resume:
            try:
                entries = self.file.read()
                if entries and entries[0].meta.get("k") == "model":
                    return self._resumed(entries)
                log.warning("cannot resume from %s (no cloud model in it): starting afresh", self.file.path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot resume from %s (%s): starting afresh", self.file.path, exc)
        self.file.clear()
        return None

    def _resumed(self, entries: list[Payload]) -> Resumed:
        first = entries[0].meta
        version, push = int(first["version"]), None
        for entry in entries[1:]:
            if entry.meta["k"] == "version":
                version = max(version, int(entry.meta["version"]))
            elif entry.meta["k"] == "push":
                push = entry.tensors["message"].tobytes()
        self._head, self._push = entries[0], push
        model = dict(entries[0].tensors)
        return Resumed(int(first["global"]), first.get("session"), model, version, push)

    def adopted(self, global_version: int, session: str | None, model: Mapping[str, np.ndarray], version: int) -> None:
        """A new cloud model (the cell model is at ``version`` now): the journal starts afresh with it (and the
        last push, still the one to send again)."""
        meta = {"k": "model", "global": global_version, "session": session, "version": version}
        self._head = Payload(meta, dict(model))
        self._rewrite(version)

    def updated(self, version: int) -> None:
        """The cell model is at ``version`` (before a task carries it)."""
        self.file.append(Payload({"k": "version", "version": version}))

    def pushed(self, message: bytes, version: int) -> None:
        """The push ``message`` (the cell model at ``version``), before it is published; it replaces the last."""
        self._push = message
        self._rewrite(version)

    def _rewrite(self, version: int) -> None:
        """The journal afresh, in one atomic write: the cloud model, the cell's version, the last push (one push on
        disk at most; a crash mid-way leaves the journal before it)."""
        assert self._head is not None, "a cell pushes only after it adopted a cloud model"
        entries = [Payload({"k": "version", "version": version})]
        if self._push is not None:
            entries.append(Payload({"k": "push"}, {"message": np.frombuffer(self._push, np.uint8)}))
        self.file.reset(self._head, *entries)

    def close(self) -> None:
        self.file.close()
