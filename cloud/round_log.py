"""The append-only part of a cloud role's state (``CloudRole.log_tail``: DeComFL's round log), kept in a journal
beside the checkpoint so that a checkpoint costs the same at round 10,000 as at round 10.

Each save appends the rounds closed since the last one as one entry (``protocols.checkpoint.Journal``, fsynced),
before the checkpoint is renamed; the checkpoint records how many rounds and bytes of the file are its own and their
sha256. A resume reads exactly those bytes: entries after them (a torn append, or one whose checkpoint was never
renamed) are cut off before the next append, and a file that is not what the checkpoint recorded (lost, shortened,
changed, another run's) is refused with its reason, before any of it is decoded. Nothing is sized by what the file
says: the recorded rounds are bounded by the checkpoint's round, the recorded bytes by the file's size and the
machine's memory, and each entry by the bytes the digest covered."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from protocols.checkpoint import JOURNAL_MAGIC, Journal, write_durably
from protocols.jsonl import writing
from protocols.limits import memory_refusal
from protocols.round_text import nth
from protocols.wire.payload import Payload

LogTail = Callable[[int], "Mapping[str, np.ndarray] | None"]
"""``CloudRole.log_tail``: a role's log from a round on (arrays whose first axis is the round), or None: no log."""

SUFFIX = ".rounds"  # the log of checkpoint.ftw is checkpoint.ftw.rounds (runfiles.CHECKPOINT_LOG)
_CHUNK = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def rounds_in(tail: Mapping[str, np.ndarray], what: str) -> int:
    """The rounds ``tail`` holds: the first axis of its arrays, the same for all (ValueError otherwise)."""
    lengths = {len(a) if isinstance(a, np.ndarray) and a.ndim else -1 for a in tail.values()}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(f"{what}: its arrays must share their first axis (the round), got lengths {sorted(lengths)}")
    return lengths.pop()


class RoundLog:
    """The round log beside a checkpoint at ``path`` (``path`` + :data:`SUFFIX`)."""

    def __init__(self, checkpoint: Path) -> None:
        self.journal = Journal(checkpoint.with_name(checkpoint.name + SUFFIX))
        self.rounds: int | None = None  # rounds of the file this cloud's checkpoints record; None: none written yet
        self.size = 0  # ... and their bytes, header included
        self.digest = hashlib.sha256()  # ... and their sha256, running
        self._after_rename: bytes | None = None  # a first file of no rounds: written once the checkpoint names it

    @property
    def path(self) -> Path:
        return self.journal.path

    def add(self, tail_of: LogTail) -> dict[str, Any] | None:
        """Append the rounds ``tail_of`` gives since the last save (fsynced); what the checkpoint records of the log,
        or None (the role keeps no log)."""
        start = self.rounds or 0
        if self.rounds is not None and self._file_size() < self.size:  # lost or shortened: written again whole
            start, self.rounds = 0, None
        tail = tail_of(start)
        if tail is None:
            return None
        n = rounds_in(tail, "the role's log")
        with writing(self.path):  # a full disk: the checkpoint on disk still names the bytes it had
            if self.rounds is None:
                self._first(tail, n)
            elif n:
                if self._file_size() > self.size:  # a torn append, or one whose checkpoint was not renamed
                    self.journal.cut(self.size)
                added = self.journal.append(Payload({"from": start}, dict(tail)))
                self.digest.update(added)
                self.size += len(added)
        self.rounds = start + n
        return {"rounds": self.rounds, "bytes": self.size, "sha256": self.digest.hexdigest()}

    def _first(self, tail: Mapping[str, np.ndarray], n: int) -> None:
        """This cloud's first save: the whole log as the file's one entry, written before the checkpoint (the one on
        disk names none of its rounds then: it holds its log inside, an older fedtier's, or names a log of no rounds);
        a log of no rounds (a fresh run's) after it (a previous run's file, which the checkpoint being replaced may
        name, stays until then: its header, all the new one names, is the same)."""
        self.journal.close()
        data = JOURNAL_MAGIC
        if n:
            data += Journal.frame(Payload({"from": 0}, dict(tail)))
            write_durably(self.path, data)
        else:
            self._after_rename = data
        self.digest, self.size = hashlib.sha256(data), len(data)

    def saved(self) -> None:
        """After the checkpoint's rename: write a first file of no rounds (:meth:`_first`)."""
        if self._after_rename is not None:
            write_durably(self.path, self._after_rename)
            self._after_rename = None

    def _file_size(self) -> int:
        try:
            return os.stat(self.path).st_size
        except FileNotFoundError:
            return 0

    def load(self, record: Any, last_round: int) -> dict[str, np.ndarray]:
        """The log's arrays, all rounds joined, as the checkpoint of round ``last_round`` that recorded ``record``
        left them (none: an empty dict); ValueError, naming what differs, when the file is not that."""
        rounds, size, digest = self._check_record(record, last_round)
        if rounds == 0:  # nothing to read (its file may not be written yet): the next save writes it whole
            return {}
        what = f"{self.path} (the checkpoint's round log: {rounds:,} rounds, {size:,} bytes)"
        if (have := self._file_size()) < size:
            raise ValueError(f"{what} holds {have:,} bytes: lost or cut short; run again without --resume")
        if why := memory_refusal(2 * size, f"{what}: reading it"):
            raise ValueError(why)
        hasher = hashlib.sha256()
        with self.path.open("rb") as fh:
            left = size
            while left:
                chunk = fh.read(min(left, _CHUNK))
                hasher.update(chunk)
                left -= len(chunk)
        if hasher.hexdigest() != digest:
            raise ValueError(f"{what} is not the file the checkpoint wrote (sha256); run again without --resume")
        parts: dict[str, list[np.ndarray]] = {}
        count = 0
        for entry in self.journal.scan(until=size):
            n = rounds_in(entry.tensors, what)
            if entry.meta.get("from") != count or (parts and set(entry.tensors) != set(parts)):
                raise ValueError(f"{what}: entry at round {count:,} does not continue the log")
            for name, arr in entry.tensors.items():
                parts.setdefault(name, []).append(arr)
            count += n
        if count != rounds:
            raise ValueError(f"{what} holds {count:,} rounds")
        self.rounds, self.size, self.digest = rounds, size, hasher
        return {name: np.concatenate(arrs) for name, arrs in parts.items()}

    def _check_record(self, record: Any, last_round: int) -> tuple[int, int, str]:
        """(rounds, bytes, sha256) of a checkpoint's ``log`` record, each bounded: rounds by the rounds closed."""
        ok = isinstance(record, dict) and all(
            isinstance(record.get(k), int) and not isinstance(record.get(k), bool) for k in ("rounds", "bytes")
        )
        if not ok or not isinstance(record.get("sha256"), str) or not _SHA256.fullmatch(record["sha256"]):
            raise ValueError(f"the checkpoint's record of its round log is malformed: {str(record)[:120]}")
        rounds, size = record["rounds"], record["bytes"]
        if not 0 <= rounds <= last_round + 1 or size < len(JOURNAL_MAGIC):
            raise ValueError(
                f"the checkpoint's round log: {rounds:,} rounds and {size:,} bytes after round {nth(last_round)} "
                f"(at most {last_round + 1:,} rounds, at least {len(JOURNAL_MAGIC)} bytes)"
            )
        return rounds, size, record["sha256"]
