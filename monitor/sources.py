"""Where ``fedtier monitor`` gets records: a run folder it tails, or telemetry topics it subscribes to.

Both are polled from the caller's thread: ``poll()`` returns what arrived since the last call as
``(records, bad lines, statuses)``, so the monitor state is only ever touched by one thread.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocols import runfiles
from protocols.limits import read_file
from protocols.numbers import finite_number
from protocols.records import BadLine, CellRecord, Dedup, Record, RoundRecord, parse_lines, parse_record
from protocols.state import decode_state
from protocols.status import IDLE, decode_status, published_age
from protocols.transport.base import Transport
from protocols.wire import topics
from protocols.wire.envelope import WireError
from protocols.wire.keys import PublicKeys
from protocols.wire.signed import open_record, signer_of

MAX_READ_BYTES = 4 << 20
"""A run folder's file is read at most this much a poll: a monitor opened on a run of 10^5 rounds parsed its whole log
into records at once (1.2 GB of RSS for a 109 MB log)."""
MAX_QUEUE_BYTES = 256 << 20  # a cloud's job queue (every job's config text) read for a job folder's end
MAX_TELEMETRY_BYTES = 8 << 20  # a record larger than this is refused unparsed (a cell's record names its devices)

Status = tuple[str, str, float | None, float]
"""(node, "online" | "idle" | "offline", the idle heartbeat it declares, its age: how long ago a node's first
idle record, which comes retained, says it was published; else 0)."""
Batch = tuple[list[Record], list[BadLine], list[Status]]


class _Tail:
    """New complete lines of a growing file (a half-written last line waits for its newline)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.line, self.buffer = path, 0, 1, b""
        self.inode: int | None = None  # of the file being read (a new one: rotated or replaced)
        self.restarts = 0
        self.more = False  # the last read left bytes unread (at most MAX_READ_BYTES a read)

    def read(self) -> tuple[list[str], int]:
        """New lines (of at most MAX_READ_BYTES: ``more`` says whether some are left) and the number of the first
        one; a file that shrank is read again from the start."""
        self.more = False
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], self.line
        size = stat.st_size
        if stat.st_ino != self.inode and self._rotated():  # the writer rotated: finish the old file, then on
            first = self.line
            early, _ = self._read_from(self.path.with_name(self.path.name + ".1"), whole=True)
            self.offset, self.buffer, self.inode = 0, b"", stat.st_ino
            lines, _ = self._read_from(self.path)
            self.more = size > self.offset
            return early + lines, first
        if size < self.offset or stat.st_ino != self.inode:  # truncated or replaced: a new run in the folder
            self.restarts += self.inode is not None
            self.offset, self.line, self.buffer, self.inode = 0, 1, b"", stat.st_ino
        if size == self.offset:
            return [], self.line
        read = self._read_from(self.path)
        self.more = size > self.offset
        return read

    def _rotated(self) -> bool:
        """Whether the file this tail read (its inode) is now ``path.1``: rotated by the writer, not a new run."""
        try:
            return self.inode is not None and self.path.with_name(self.path.name + ".1").stat().st_ino == self.inode
        except FileNotFoundError:
            return False

    def _read_from(self, path: Path, whole: bool = False) -> tuple[list[str], int]:
        """The complete lines of ``path`` past ``offset`` in its next MAX_READ_BYTES (``whole``: to its end), and
        the number of the first."""
        with path.open("rb") as fh:
            fh.seek(self.offset)
            data = fh.read(-1 if whole else MAX_READ_BYTES)
        self.offset += len(data)
        data = self.buffer + data
        head, sep, self.buffer = data.rpartition(b"\n")
        lines = (head + sep).decode("utf-8", errors="replace").splitlines() if sep else []
        first = self.line
        self.line += len(lines)
        return lines, first


NOT_JSON = object()
"""What :func:`read_summary` gives as a ``summary.json`` that is no JSON (a run killed while writing it)."""


def read_summary(run_dir: Path) -> tuple[float, Any] | None:
    """(when it was written, its JSON or :data:`NOT_JSON`) of a run folder's ``summary.json``; None where it is
    missing or unreadable."""
    path = run_dir / runfiles.SUMMARY
    try:
        written, text = path.stat().st_mtime, path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    try:
        return written, json.loads(text)
    except ValueError:
        return written, NOT_JSON


class RunDirFollower:
    """Tails ``aggregation.jsonl``, ``cells.jsonl`` (the cells' records a deployed cloud collected; a record in
    both files counts once) and ``metrics.jsonl`` of a run folder; ``restarts`` counts the times a file was
    replaced or truncated (a new run started in the folder)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._tails = [
            _Tail(self.run_dir / name) for name in (runfiles.AGGREGATION, runfiles.CELL_RECORDS, runfiles.METRICS)
        ]
        self._dedup, self._restarts_seen = Dedup(), 0

    def poll(self) -> Batch:
        records: list[Record] = []
        bad: list[BadLine] = []
        for tail in self._tails:
            lines, first = tail.read()
            r, b = parse_lines(lines, str(tail.path), first)
            records += r
            bad += b
        restarts = self.restarts
        if restarts != self._restarts_seen:  # a new run in the folder: its records are new
            self._dedup, self._restarts_seen = Dedup(), restarts
        return self._dedup(records), bad, []

    @property
    def restarts(self) -> int:
        return sum(t.restarts for t in self._tails)

    @property
    def pending(self) -> bool:
        """The last :meth:`poll` left lines unread (a file's backlog is read MAX_READ_BYTES a poll)."""
        return any(t.more for t in self._tails)

    def cell_folder(self) -> list[dict]:
        """The cells whose own job folder this is (``fedtier cell --serve``: their records only, no cloud's), each
        with its job and how it ended for it (``runfiles.write_cell_job``); [] for any other folder."""
        if (self.run_dir / runfiles.METRICS).exists() or (self.run_dir / runfiles.SUMMARY).exists():
            return []  # the cloud's records are here too: a run folder
        return runfiles.cell_jobs(self.run_dir)

    def poll_states(self) -> list[dict]:
        """The cloud's end as its retained state would say it (``protocols.state``), from ``summary.json``:
        ``finished``, ``stopped`` or ``failed`` with the reason; none while the run goes on (no summary yet,
        or an earlier attempt's, older than the records of a resumed run). A cell's own job folder has no summary:
        the job's end as the cloud told its cell (:meth:`cell_folder`)."""
        return self.states_of(read_summary(self.run_dir))

    def states_of(self, summary: tuple[float, Any] | None) -> list[dict]:
        """:meth:`poll_states` from ``summary.json`` as :func:`read_summary` read it (a caller that reads it for
        itself reads it once)."""
        metrics = self.run_dir / runfiles.METRICS
        if summary is None:
            return self._unsummarised()
        written, data = summary
        try:
            if metrics.exists() and metrics.stat().st_mtime > written:
                return self._abandoned()
        except OSError:
            return self._unsummarised()
        if data is NOT_JSON:
            return self._unsummarised()
        phase = data.get("status") if isinstance(data, dict) else None
        if phase not in ("finished", "stopped", "failed"):
            return []
        reason = data.get(phase)  # (text, as the cloud writes it: anything else is not said)
        said = {"reason": reason} if isinstance(reason, str) and reason else {}
        return [{"node": "cloud", "phase": phase, "since": written, **said}]

    def _unsummarised(self) -> list[dict]:
        """The end of a folder without a readable ``summary.json``."""
        return self._cell_ended() or self._queue_ended() or self._abandoned()

    def _cell_ended(self) -> list[dict]:
        """A cell's job folder whose job ended, as the cloud said to the cell (its ``finished`` record)."""
        ended = [c for c in self.cell_folder() if c["phase"] != "running"]
        if not ended:
            return []
        last = max(ended, key=lambda c: c["since"])
        reason = last.get("reason")
        return [
            {"node": "cloud", "phase": last["phase"], "since": last["since"], **({"reason": reason} if reason else {})}
        ]

    def _queue_ended(self) -> list[dict]:
        """A federation job's folder (``{output}/jobs/{job}``) with no summary: the job's end as the cloud's queue
        (``{output}/jobs.json``) says it. A cloud that could not write the job's folder (full or read-only: the job
        failed for it) wrote no ``summary.json``, and the folder read as a job still running."""
        if self.run_dir.parent.name != runfiles.JOB_FOLDERS:
            return []
        queue = self.run_dir.parent.parent / runfiles.JOBS
        try:
            jobs = json.loads(read_file(queue, MAX_QUEUE_BYTES)).get("jobs")
            job = next(j for j in jobs if isinstance(j, dict) and j.get("job") == self.run_dir.name)
        except (OSError, ValueError, AttributeError, TypeError, StopIteration):
            return []
        phase = {"finished": "finished", "failed": "failed", "cancelled": "stopped"}.get(str(job.get("state")))
        since, reason = finite_number(job.get("ended")), job.get("reason")
        if phase is None or since is None:
            return []
        said = {"reason": reason} if isinstance(reason, str) and reason else {}
        return [{"node": "cloud", "phase": phase, "since": since, **said}]

    def _abandoned(self) -> list[dict]:
        """A ``stopped`` state, ``interrupted``, when the ``fedtier sim|run`` that wrote the folder is gone without a
        summary of its end (killed: ``kill -9``, out of memory, a lost machine): it held ``run.lock`` while it ran,
        and nobody holds it now. None while it runs, or where no such command wrote (a deployed cloud holds no lock)."""
        lock = self.run_dir / runfiles.LOCK
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return []  # held: the run goes on
        finally:
            os.close(fd)  # releases it
        written = [t.path.stat().st_mtime for t in self._tails if t.path.exists() and t.path.stat().st_size]
        if not written:
            return []  # nothing written yet: a run that is starting (it takes the lock first)
        why = "the fedtier sim|run process ended before the run did (interrupted or killed); --resume continues it"
        return [{"node": "cloud", "phase": "stopped", "since": max(written), "reason": why, "interrupted": True}]


def check_topic(record: Record, topic: str, run: str) -> None:
    """Raise ``ValueError`` saying why when ``record`` is not what ``topic`` carries: a cell's telemetry topic
    carries that cell's aggregation records, the cloud's its round records (a node, even one that signs what it
    publishes, may only speak for itself)."""
    parts = topic.split("/")
    if isinstance(record, CellRecord):
        expected = topics.telemetry_cell(run, record.cell)
    elif isinstance(record, RoundRecord):
        expected = topics.telemetry_cloud(run)
    else:
        raise ValueError(f"a {type(record).__name__} is no telemetry record")
    if topic != expected:
        what = f"cell {record.cell!r}" if isinstance(record, CellRecord) else "the cloud"
        raise ValueError(f"record of {what} on {'/'.join(parts[2:]) or topic}: refused (its topic is {expected})")


class TelemetryFeed:
    """Subscribes ``fedtier/{run}/telemetry/#`` and the status topics on any :class:`Transport`.

    With ``keys`` (the public keys of a signed run) a record counts only if the node its topic names
    signed it for that topic: anything else (unsigned, forged, moved to another cell's topic) is a bad
    record saying why, and such a status is dropped; with them too it reads the cloud's signed roster, whose revoked
    nodes :meth:`poll_revoked` returns (a revoked cell's retained status may still say idle). Without, signatures
    are not checked. Records
    larger than ``MAX_TELEMETRY_BYTES`` are refused unparsed. Handlers run on the transport's loop (a
    broker thread for MQTT) and only queue what they get.
    """

    def __init__(self, transport: Transport, run: str, keys: PublicKeys | None = None) -> None:
        self.transport, self.run, self.keys = transport, run, keys
        self._lock = threading.Lock()
        self._records: list[Record] = []
        self._bad: list[BadLine] = []
        self._statuses: list[Status] = []
        self._heard: set[str] = set()  # nodes with a status already (a first one comes retained)
        self._states: list[tuple[int, int, dict]] = []  # each with how many records and statuses came before it
        self._revoked: dict[str, str] = {}  # node -> why, from the newest signed roster
        self._roster_version: int | None = None  # of the newest roster taken
        self._jobs: list[dict] | None = None  # the cloud's newest (signed) job list not yet polled
        self.received = 0  # telemetry records
        self.heard = 0  # messages of every kind (records, statuses, states, job lists, rosters): --once waits for quiet

    def start(self) -> TelemetryFeed:
        self._subscribe(topics.telemetry_all(self.run), self._on_record, qos=0)
        self._subscribe(topics.statuses(self.run), self._on_status)
        self._subscribe(topics.device_statuses(self.run), self._on_status)
        self._subscribe(topics.states(self.run), self._on_state)  # retained: a stall shows at once
        self._subscribe(topics.job_list(self.run), self._on_jobs)  # retained: a job ended before we came
        if self.keys is not None:
            from protocols.roster import roster_topic

            self._subscribe(roster_topic(self.run), self._on_roster)
        return self

    def _subscribe(self, pattern: str, handler: Callable[[str, bytes], None], qos: int = 1) -> None:
        def heard(topic: str, data: bytes) -> None:
            self.heard += 1  # (one reader thread: the transport's)
            handler(topic, data)

        self.transport.subscribe(pattern, heard, qos=qos)

    def _on_roster(self, topic: str, data: bytes) -> None:
        """The cloud's signed roster (newer than the last taken): its revoked nodes; another is a bad record."""
        from protocols.roster import RosterError, newer_roster

        if not data or self.keys is None:
            return
        with self._lock:
            try:
                roster = newer_roster(data, self.keys.verify, self.run, self._roster_version)
            except RosterError as exc:
                self._bad.append(BadLine(topic, 0, str(exc)))
                return
            if roster is None:  # the one held, delivered again
                return
            self._roster_version = roster.version
            self._revoked |= {
                n: f"revoked (roster version {roster.version})" for n in roster.revoked - self._revoked.keys()
            }

    def _on_jobs(self, topic: str, data: bytes) -> None:
        """A federation's job list (``fedtier jobs``), signed by the cloud where ``keys`` are given; another is a bad
        record. Its entries are the cloud's word: :func:`monitor.state.job_entries` takes only well-formed ones."""
        from protocols.jobs import JobError, open_job_record

        if not data:
            return
        with self._lock:
            try:
                record = open_job_record(data, topic, "cloud", self.keys.verify if self.keys else None)
            except JobError as exc:
                self._bad.append(BadLine(topic, 0, str(exc)))
                return
            jobs = record.get("jobs")
            self._jobs = jobs if isinstance(jobs, list) else []

    def poll_jobs(self) -> list[dict] | None:
        """The cloud's job list if a new one came since the last call (a federation's; a single run has none)."""
        with self._lock:
            jobs, self._jobs = self._jobs, None
        return jobs

    def poll_revoked(self) -> dict[str, str]:
        """Every node the signed roster revoked so far, with why (``revoked (roster version N)``)."""
        with self._lock:
            return dict(self._revoked)

    def _on_state(self, topic: str, data: bytes) -> None:
        state = decode_state(data, topic, self.keys) if data else None
        if state is not None:
            with self._lock:
                self._states.append((len(self._records), len(self._statuses), state))

    def poll_states(self) -> list[dict]:
        """The current-state records (``protocols.state``) that arrived since the last call."""
        with self._lock:
            states, self._states = self._states, []
        return [state for _, _, state in states]

    def poll_in_order(self) -> tuple[Batch, list[tuple[int, int, dict]]]:
        """:meth:`poll` and :meth:`poll_states` at once, each state with how many of the batch's records and statuses
        came before it: a federation's next job begins between them (the cloud's state says it), and a view that took
        every record first and the states after forgot the new job's first rounds with the ended one's."""
        with self._lock:
            batch, states = (self._records, self._bad, self._statuses), self._states
            self._records, self._bad, self._statuses, self._states = [], [], [], []
        return batch, states

    def _on_record(self, topic: str, data: bytes) -> None:
        with self._lock:
            self.received += 1
            try:
                record = open_record(
                    data,
                    topic,
                    signer_of(topic),
                    self.keys.verify if self.keys else None,
                    max_bytes=MAX_TELEMETRY_BYTES,
                )
                parsed = parse_record(record)
                check_topic(parsed, topic, self.run)
                self._records.append(parsed)
            except WireError as exc:
                self._bad.append(BadLine(topic, self.received, f"rejected: {exc}"))
            except ValueError as exc:
                self._bad.append(BadLine(topic, self.received, str(exc)))

    def _on_status(self, topic: str, data: bytes) -> None:
        status = decode_status(data, topic, self.keys)
        if status is not None:
            with self._lock:
                beat = finite_number(status.get("heartbeat"))
                node = topic.rsplit("/", 1)[-1]
                age = published_age(status) if status["state"] == IDLE and node not in self._heard else 0.0
                self._heard.add(node)
                self._statuses.append((node, status["state"], beat, age))

    def poll(self) -> Batch:
        with self._lock:
            batch = (self._records, self._bad, self._statuses)
            self._records, self._bad, self._statuses = [], [], []
        return batch

    def close(self) -> None:
        self.transport.close()


def wait_quiet(feed: TelemetryFeed, quiet: float, timeout: float) -> None:
    """Block until telemetry came and then none for ``quiet`` seconds, or ``timeout`` passed (``--once``). Retained
    statuses and states count: a monitor of a stalled or idle run (no records flowing) drew its frame only after
    ``timeout`` (3 s by default), not once they had come."""
    end = time.monotonic() + timeout
    last, seen = time.monotonic(), feed.heard
    while time.monotonic() < end:
        time.sleep(min(0.05, quiet))
        if feed.heard != seen:
            last, seen = time.monotonic(), feed.heard
        elif seen and time.monotonic() - last >= quiet:
            return
