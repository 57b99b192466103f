"""An asynchronous cell's crash-consistent state: what ``fedtier cell --resume`` continues from under
``algorithm.mode = "async"`` (a cell of rounds has ``cell_server.recovery``).

Two files, each written atomically (temporary file, fsync, rename) or appended to with an fsync, before the
cell acts on what they say:

- ``{journal}.model``: the cloud model the cell adopted last (its version, session, and the cell's model
  version then), rewritten only when the cell adopts a new cloud model;
- ``{journal}`` (the cell's journal): its last push to the cloud (rewritten, with the cell's model version,
  before the push is published) and every cell model version it made since (appended before a device task
  carries it): small entries and one push message (the cell's progress since its previous push, model-sized).

A push no longer rewrites the cloud model (measured for the MLP 784-200-200-10: 1.59 MB and two fsyncs a push
before, 0.80 MB and one after, at ``async_push_every = 1``). The files need not agree: the cell's newest version
is the largest either names, and the last push is re-sent whichever cloud model it derives from (the cloud
counts a push once). A resumed cell adopts the journaled cloud model again, numbers its model versions past
every one it used (its devices refuse a task numbered below one they had: a replay), and sends its last push
again: the same message, which a cloud that had it counts once, and which tells a cloud that has sent the cell
a newer model since that the cell may have lost it (taken, acknowledged to the broker, and the cell died before
journaling it): the cloud sends it the current model (``cloud.parts.RoundCounts.lost_task``). The progress
made since the last push is lost, as a crashed device's is. On disk: one cloud model and one push at most.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from protocols.checkpoint import Journal, load_payload, save_payload
from protocols.wire.envelope import WireError, decode_message
from protocols.wire.payload import Payload

log = logging.getLogger("fedtier.cell")


@dataclass
class Resumed:
    """What an asynchronous cell's journal holds: the cloud model it adopted last (its version and session),
    the newest model version the cell used, and its last push message (``None``: none since it started) and the
    cloud version it derives from."""

    global_version: int
    session: str | None
    model: Mapping[str, np.ndarray]
    version: int
    push: bytes | None
    push_base: int | None = None  # the cloud version the last push derives from (its header's round)
    job: str | None = None  # the job session it is of (its cell's pinned session, else its model's; None: unsigned)


class AsyncJournal:
    """The journal of an asynchronous cell (see the module docstring): ``path`` and ``{path}.model``."""

    def __init__(self, path: str | Path) -> None:
        self.file = Journal(path)
        self.model_path = self.file.path.with_name(self.file.path.name + ".model")
        self.used: int | None = None  # a fresh start: the newest model version the journal says a task carried

    def load(self, resume: bool) -> Resumed | None:
        """What to continue from (``resume``), else ``None`` and the journal is removed; an unreadable
        journal, or one without a cloud model, is logged and removed (the cell then starts afresh). A fresh
        start keeps the newest model version the journal names (:attr:`used`): its cell numbers its versions
        past it (its devices refuse a task numbered below one they had, as a replay)."""
        if resume:
            try:
                resumed = self._resumed()
                if resumed is not None:
                    return resumed
                log.warning("cannot resume from %s (no cloud model in it): starting afresh", self.file.path)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("cannot resume from %s (%s): starting afresh", self.file.path, exc)
        self.used = self._newest()
        self.clear()
        return None

    def _resumed(self) -> Resumed | None:
        if not self.model_path.exists():
            return None
        head = load_payload(self.model_path)
        if head.meta.get("k") != "model":
            raise ValueError(f"{self.model_path} holds no cloud model")
        version, push = int(head.meta["version"]), None
        for entry in self.file.read():
            if entry.meta["k"] == "version":
                version = max(version, int(entry.meta["version"]))
            elif entry.meta["k"] == "push":
                push = entry.tensors["message"].tobytes()
        base = _base(push) if push is not None else None
        session, job = head.meta.get("session"), head.meta.get("job") or head.meta.get("session")
        return Resumed(int(head.meta["global"]), session, dict(head.tensors), version, push, base, job)

    def _newest(self) -> int | None:
        """The newest model version either file names (``None``: none, or unreadable)."""
        versions: list[int] = []
        try:
            if self.model_path.exists():
                versions.append(int(load_payload(self.model_path).meta["version"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        try:
            versions += [int(e.meta["version"]) for e in self.file.read() if "version" in e.meta]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        return max(versions, default=None)

    def adopted(
        self,
        global_version: int,
        session: str | None,
        model: Mapping[str, np.ndarray],
        version: int,
        job: str | None = None,
    ) -> None:
        """A new cloud model (the cell model is at ``version`` now): it replaces the journaled one (the last push
        stays, still the one to send again). The journal file is started at the first one (``fedtier cell
        --serve`` resumes a cell whose journal exists). ``job``: the session of the job its cell serves (pinned)."""
        meta = {"k": "model", "global": global_version, "session": session, "version": version, "job": job}
        save_payload(self.model_path, Payload(meta, dict(model)))
        if not self.file.path.exists():
            self.file.reset(_version(version))

    def updated(self, version: int) -> None:
        """The cell model is at ``version`` (before a task carries it)."""
        self.file.append(_version(version))

    def pushed(self, message: bytes, version: int) -> None:
        """The push ``message`` (the cell model at ``version``), before it is published: it replaces the last, in
        one atomic write of the journal file (the cloud model is not written again)."""
        self.file.reset(_version(version), Payload({"k": "push"}, {"message": np.frombuffer(message, np.uint8)}))

    def clear(self) -> None:
        """Remove both files."""
        self.file.clear()
        self.model_path.unlink(missing_ok=True)

    def close(self) -> None:
        self.file.close()


def _base(push: bytes) -> int | None:
    """The cloud version ``push`` derives from (its header's round); ``None`` for bytes that are no message."""
    try:
        return decode_message(push)[0].round
    except WireError:
        return None


def _version(version: int) -> Payload:
    return Payload({"k": "version", "version": version})
