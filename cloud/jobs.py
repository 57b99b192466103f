"""The cloud's durable job queue: every job submitted to the federation, its state and its reason.

The queue is one JSON file (``{output}/jobs.json``), rewritten atomically (a temporary file, fsync,
rename, fsync of the folder) before the cloud acknowledges or acts on a change, so a cloud killed at
any point restarts with every job it accepted: a job that was ``running`` runs on (resumed from its
checkpoint), queued jobs follow in submission order. A queue that cannot be written raises
:class:`JobQueueError`: the cloud stops with that error rather than accept a job it could lose.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from protocols.checkpoint import write_durably
from protocols.jobs import MAX_LISTED, STATES, JobError, check_job_id, check_job_nonce, job_session, new_job_nonce
from protocols.numbers import finite_number, is_count

FORMAT = 1
ENDED = ("finished", "failed", "cancelled")
MAX_LISTED_REASON = 1000
"""Characters of a job's reason in the job list (a failure can name every cell it lost)."""
MAX_LISTED_ABSENT = 10
"""Cells absent at a job's start named in the job list (a federation of a thousand cells may begin without hundreds)."""

FIGURES = ("rounds", "accuracy", "loss")
"""What the job list says of how well an ended job did (:func:`final_figures`)."""


def final_figures(history: list[dict[str, Any]], earlier: dict[str, Any] | None = None) -> dict[str, float]:
    """An ended job's :data:`FIGURES` from its round records (``history``; ``earlier``: the last record before a
    resume): the rounds it closed, and its last evaluation's accuracy and loss (the cloud's held-out set; absent
    without one). Finite numbers only, whatever else the records hold: a few bytes in the job list at most."""
    records = [*([earlier] if earlier else []), *history]
    figures: dict[str, float] = {}
    if records and is_count(done := records[-1].get("round")):
        figures["rounds"] = done + 1  # a resumed job counts its earlier rounds
    evaluated: dict[str, Any] = next((r for r in reversed(records) if "accuracy" in r or "loss" in r), {})
    for key in ("accuracy", "loss"):
        if (value := finite_number(evaluated.get(key))) is not None:
            figures[key] = value
    return figures


class JobQueueError(RuntimeError):
    """The queue file cannot be read or written (the cloud must stop: it could lose a job)."""


class JobFolderFull(JobQueueError):
    """A job's folder has no room for what it writes as it starts (a full disk): the cloud stops, the job left as the
    queue says, to resume (or start) once the cloud can write there, rather than fail for the disk."""


@dataclass(frozen=True)
class Job:
    """One job: its id, canonical config text and hash, who submitted it, what it starts from, its state; ``nonce``:
    drawn from the OS as the queue queued it, kept in the queue file (a resumed job keeps its session), bound into its
    session (``protocols.jobs.job_session``); ``""`` for a job of a queue file from before nonces (its old session)."""

    job: str
    config: str
    digest: str
    submitter: str
    init_from: str | None = None
    state: str = "queued"
    reason: str = ""
    submitted: float = field(default_factory=time.time)
    started: float | None = None
    ended: float | None = None
    cancel_requested: bool = False
    cells_absent_at_start: dict[str, str] = field(default_factory=dict)  # cells it began without, why
    figures: dict[str, float] = field(default_factory=dict)  # how well it did, once ended (final_figures)
    nonce: str = ""

    @property
    def session(self) -> str:
        """Its cloud session: the id, config hash and nonce bound into every signed envelope of it."""
        return job_session(self.job, self.digest, self.nonce)

    def summary(self) -> dict[str, Any]:
        """What ``fedtier jobs`` lists (no config text): its reason's first ``MAX_LISTED_REASON`` characters and its
        first ``MAX_LISTED_ABSENT`` cells absent at start (``cells_absent_at_start_more``: how many more); the queue
        file and the job's ``summary.json`` keep them whole. An ended job's :data:`FIGURES`, where it has them."""
        keys = ("job", "state", "submitter", "init_from", "submitted", "started", "ended")
        listed = dict(itertools.islice(self.cells_absent_at_start.items(), MAX_LISTED_ABSENT))
        more = len(self.cells_absent_at_start) - len(listed)
        absent = {"cells_absent_at_start": listed} if listed else {}
        return (
            {k: getattr(self, k) for k in keys}
            | {"reason": self.reason[:MAX_LISTED_REASON], "hash": self.digest}
            | absent
            | ({"cells_absent_at_start_more": more} if more else {})
            | {k: v for k in FIGURES if finite_number(v := self.figures.get(k)) is not None}
        )


class JobQueue:
    """Jobs in submission order, persisted in ``path`` on every change. One thread changes it: the cloud service's
    (submissions and cancels over MQTT are taken on its loop), as two writers would race for the file's temporary."""

    def __init__(self, path: str | Path, create: bool = True) -> None:
        """``create``: write the file now if there is none (else: :meth:`create`, or the first change)."""
        self.path = Path(path)
        self.jobs: dict[str, Job] = {}
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text(encoding="utf-8"))
                if data.get("format") != FORMAT:
                    raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
                for item in data["jobs"]:
                    job = Job(**item)
                    check_job_nonce(job.nonce)
                    self.jobs[job.job] = job
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise JobQueueError(f"job queue {self.path} is unreadable: {exc}") from None
        elif create:
            self.create()

    def create(self) -> None:
        """Write the queue file if there is none: fail now, not at the first submission, when the folder is not
        writable."""
        if not self.path.exists():
            self._save()

    # ------------------------------------------------------------------ queries
    def get(self, job: str) -> Job | None:
        return self.jobs.get(job)

    def next(self) -> Job | None:
        """The job to run now: one left ``running`` by a crash first, else the oldest ``queued``."""
        running = [j for j in self.jobs.values() if j.state == "running"]
        if running:
            return running[0]
        return next((j for j in self.jobs.values() if j.state == "queued"), None)

    def listing(self, max_bytes: int | None = None) -> list[dict[str, Any]]:
        """The last ``MAX_LISTED`` jobs, oldest first; with ``max_bytes``, the newest of them whose summaries, as
        JSON, take at most that many bytes in all (what a reader takes whole: ``protocols.jobs.MAX_JOB_RECORD_BYTES``),
        however long the jobs' reasons and however many cells they began without."""
        out: list[dict[str, Any]] = []
        used = 0
        for job in reversed(list(self.jobs.values())[-MAX_LISTED:]):
            summary = job.summary()
            used += len(json.dumps(summary, separators=(",", ":"))) + 1
            if max_bytes is not None and used > max_bytes:
                break
            out.append(summary)
        return out[::-1]

    # ------------------------------------------------------------------ changes (each persisted)
    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`JobError` for a taken id or an ``init_from`` that is not a finished job."""
        check_job_id(job.job)
        if job.job in self.jobs:
            raise JobError(f"job {job.job!r} exists already ({self.jobs[job.job].state})")
        if job.init_from is not None:
            base = self.jobs.get(job.init_from)
            if base is None:
                raise JobError(f"init_from: no job {job.init_from!r}")
            if base.state in ("failed", "cancelled"):
                raise JobError(f"init_from: job {job.init_from!r} ended {base.state}")
        self._change(job.job, replace(job, state="queued", nonce=job.nonce or new_job_nonce()))

    def start(self, job: str) -> Job:
        return self._change(job, replace(self.jobs[job], state="running", started=time.time()))

    def end(
        self,
        job: str,
        state: str,
        reason: str = "",
        absent: dict[str, str] | None = None,
        figures: dict[str, float] | None = None,
    ) -> Job:
        """``job`` ended ``state`` for ``reason``; ``absent``: the cells it began without, why; ``figures``: how well
        it did (:func:`final_figures`)."""
        if state not in ENDED:
            raise ValueError(f"a job ends {', '.join(ENDED)}, not {state!r}")
        ended = replace(self.jobs[job], state=state, reason=reason, ended=time.time(), figures=dict(figures or {}))
        return self._change(job, replace(ended, cells_absent_at_start=dict(absent or {})))

    def cancel(self, job: str) -> Job:
        """A queued job is cancelled at once; a running one after its current round (``cancel_requested``)."""
        current = self.jobs.get(job)
        if current is None:
            raise JobError(f"no job {job!r}")
        if current.state in ENDED:
            raise JobError(f"job {job!r} has ended ({current.state})")
        if current.state == "queued":
            return self.end(job, "cancelled", "cancelled by the operator before it started")
        return self._change(job, replace(current, cancel_requested=True))

    def _change(self, key: str, job: Job) -> Job:
        assert job.state in STATES
        before = self.jobs.get(key)
        self.jobs[key] = job
        try:
            self._save()
        except JobQueueError:
            if before is None:
                del self.jobs[key]
            else:
                self.jobs[key] = before
            raise
        return job

    def _save(self) -> None:
        data = json.dumps({"format": FORMAT, "jobs": [asdict(j) for j in self.jobs.values()]}, indent=1)
        try:
            write_durably(self.path, data.encode())
        except OSError as exc:
            raise JobQueueError(f"cannot write the job queue {self.path}: {exc}") from None
