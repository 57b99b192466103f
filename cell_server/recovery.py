"""A cell's crash-consistent round: what ``fedtier cell --resume`` continues from.

The cell journals, each entry fsynced before it acts on it, the inputs of its current cloud round: the
cloud's task (which starts a fresh journal, atomically: the file never holds more than one round),
then per edge round the devices it planned from, every device result it took, the record of each
edge round it closed, and finally the report message it sent (and the seed of the noise its role adds
under cell DP, secret like the noise: a resumed cell re-sends what it released). Roles are deterministic, so replaying
these inputs rebuilds the cell's state exactly: a restarted cell re-plans the edge round it was in
(the same plan), keeps the results it had, re-sends the task to the devices still pending (a device
that already answered answers again: the same result) and waits for them; a cell that had reported
sends the same report message again at once (it is journaled before it is published) and whenever the
cloud asks again; a cloud already in a later round takes that repeat as the cell's return and sends it that
round's task again (the cell may have taken it, acknowledged, and died before journaling it). On disk: one
round's inbound traffic at most (its task and its devices' results).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocols.checkpoint import Journal
from protocols.divergence import diverged_reason
from protocols.failures import failed_reason
from protocols.jsonl import read_jsonl
from protocols.params import Sums, sums_on
from protocols.round_text import nth, nth_edge
from protocols.wire import topics
from protocols.wire.envelope import payload_digest
from protocols.wire.payload import Payload, encode_payload

from .parts import EdgeRound, RoundTally

if TYPE_CHECKING:
    from protocols.algorithms.base import CellRole
    from protocols.session import CloudSession
    from protocols.transport.base import EventLoop, Transport
    from protocols.wire.messenger import Incoming, Messenger

    from .telemetry import CellTelemetry

log = logging.getLogger("fedtier.cell")


class Host(Protocol):
    """What recovery needs of the cell server it restores (``cell_server.server.CellServer`` is one): where
    its round is and its parts (the open edge round, the cloud round's tally, the records), to set them as
    the journal says, and the steps it resumes from."""

    run: str
    cell: str
    round: int
    edge_round: int
    loop: EventLoop
    transport: Transport
    role: CellRole
    sums: Sums | None
    messenger: Messenger
    telemetry: CellTelemetry
    edge: EdgeRound
    tally: RoundTally
    sent_report: bytes | None
    journal: RoundJournal | None
    journaled: tuple[bool, str | None]
    cloud: CloudSession

    @property
    def resumes(self) -> bool: ...

    def enter_round(self, rnd: int, session: str | None) -> None: ...

    def start_edge(self) -> None: ...

    def open_edge(
        self,
        plan: Mapping[str, Payload],
        available: list[str],
        taken: Mapping[str, Payload] | None = None,
        settled: Iterable[str] = (),
    ) -> None: ...

    def send_report(self) -> None: ...


class RoundJournal:
    """The typed entries of a cell's round journal (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.file = Journal(path)
        self.held: dict[tuple[int, int, str], str] = {}  # (round, edge round, device) -> digest of a result taken

    def load(self, resume: bool) -> list[Payload]:
        """The entries to continue from (``resume``), else none and the journal is removed; an unreadable
        journal is logged and removed (the cell then starts afresh)."""
        if resume:
            try:
                entries = self.file.read()
            except (OSError, ValueError) as exc:
                log.warning("cannot resume from %s (%s): starting afresh", self.file.path, exc)
            else:
                rnd = int(entries[0].meta.get("round", -1)) if entries else -1
                for m in (e.meta for e in entries if e.meta.get("k") == "result" and "digest" in e.meta):
                    self.held[(rnd, int(m["edge"]), str(m["device"]))] = str(m["digest"])
                return entries
        self.held = {}
        self.file.clear()
        return []

    def holds(self, device: str, msg: Incoming) -> bool:
        """Whether ``msg`` is a result of ``device`` this journal took already, the same bytes: one the broker
        delivers again to a cell restarted after it took it (its session's messages not yet acknowledged)."""
        held = self.held.get((msg.header.round, msg.header.edge_round, device))
        return held is not None and held == result_digest(msg)  # (hashed only then)

    def task(
        self, rnd: int, session: str | None, task: Payload, noise_seed: int | None = None, job: str | None = None
    ) -> None:
        """A cloud task starts the round's journal; ``noise_seed``: the seed of the noise the cell role adds
        (cell DP, drawn from the OS in deployments), kept so that a resumed cell adds the very same noise; ``job``: the
        session of the job its cell serves (pinned to: a long-lived cell's), which it resumes only in that job."""
        meta = {"k": "task", "round": rnd, "session": session, "task": task.meta, "job": job}
        if noise_seed is not None:
            meta["noise_seed"] = noise_seed
        self.file.reset(Payload(meta, task.tensors))
        self.held = {}

    def plan(self, edge_round: int, available: list[str], absent: Mapping[str, str], not_participating: int) -> None:
        self.file.append(
            Payload(
                {
                    "k": "plan",
                    "edge": edge_round,
                    "available": list(available),
                    "absent": dict(absent),
                    "not_participating": not_participating,
                }
            )
        )

    def result(self, edge_round: int, device: str, msg: Incoming) -> None:
        """A result taken: its payload, its size on the wire and its digest (:meth:`holds`)."""
        digest = result_digest(msg)
        meta = {"k": "result", "edge": edge_round, "device": device, "nbytes": msg.nbytes, "meta": msg.payload.meta}
        self.file.append(Payload({**meta, "digest": digest}, msg.payload.tensors))
        self.held[(msg.header.round, edge_round, device)] = digest

    def closed(self, edge_round: int, record: dict[str, Any]) -> None:
        self.file.append(Payload({"k": "closed", "edge": edge_round, "record": record}))

    def report(self, message: bytes) -> None:
        self.file.append(Payload({"k": "report"}, {"message": np.frombuffer(message, np.uint8)}))

    def close(self) -> None:
        self.file.close()


def result_digest(msg: Incoming) -> str:
    """The sha256 of a device result's payload as it arrived (its signature check's, where it computed it over those
    bytes: hashed once; as encoded, where its bytes were not kept)."""
    if msg.digest is not None:
        return msg.digest.hex()
    raw = msg.received.view() if msg.received is not None else encode_payload(msg.payload)
    return payload_digest(raw).hex()


def already_taken(journal: RoundJournal | None, cell: str, device: str, msg: Incoming) -> bool:
    """Whether ``msg``, refused as stale, is a result of ``device`` the cell's journal holds already (the same
    bytes): delivered again after a restart, it is said at info level, not as a rejection. Another result of that
    device for that round (other bytes), or one for a round the journal does not hold, stays a rejection."""
    if journal is None or not journal.holds(device, msg):
        return False
    h = msg.header
    log.info(
        "cell %s: result of %s for round %s delivered again, already taken",
        cell,
        device,
        nth_edge(h.round, h.edge_round),
    )
    return True


@dataclass
class _Journaled:
    """A round's journal, by edge round: its plans, the results taken, their bytes, the records of those
    closed, and the report if it was sent."""

    plans: dict[int, dict[str, Any]] = field(default_factory=dict)
    results: dict[int, dict[str, Payload]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    closed: dict[int, dict[str, Any]] = field(default_factory=dict)
    report: bytes | None = None

    @classmethod
    def read(cls, entries: list[Payload]) -> _Journaled:
        """The entries after the task, sorted by kind and edge round."""
        j = cls()
        for entry in entries:
            m, e = entry.meta, entry.meta.get("edge", -1)
            if m["k"] == "plan":
                j.plans[e] = m
            elif m["k"] == "result":
                j.results.setdefault(e, {})[m["device"]] = Payload(m["meta"], entry.tensors)
                j.nbytes[e] = j.nbytes.get(e, 0) + int(m["nbytes"])
            elif m["k"] == "closed":
                j.closed[e] = m["record"]
            elif m["k"] == "report":
                j.report = entry.tensors["message"].tobytes()
        return j


def journaled_job(entries: list[Payload]) -> tuple[bool, str | None]:
    """Whether ``entries`` (a journal read back) hold a round to continue, and the job session it is of (its cell's
    pinned session, else its task's: ``None`` for an unsigned task journaled before cells said it)."""
    first = entries[0].meta if entries else {}
    job = first.get("job") or first.get("session")
    return bool(entries), job if isinstance(job, str) else None


def say_another_job(cell: str, journaled: str | None, pinned: str | None) -> None:
    """Why a cell starts afresh over the journal in its job's folder: another job's (an earlier job of the same id)."""
    log.info(
        "cell %s: its journal is of job session %s, not of the one it serves (%s): left by an earlier job of the same "
        "id in the job's folder; starting afresh",
        cell,
        journaled,
        pinned,
    )


def recover(cell: Host, entries: list[Payload]) -> None:
    """Bring ``cell`` (started, with a fresh role) back to where its journal ends, and go on from there; a journal of
    another job than the one it is pinned to (``resumes`` false) is removed instead."""
    if not cell.resumes and cell.journal is not None:  # (its round, task, results and noise seed: none of this job's)
        say_another_job(cell.cell, cell.journaled[1], cell.cloud.pinned)
        cell.journal.load(False)
        return
    first = entries[0].meta
    if first.get("k") != "task":
        log.warning("cell %s: journal does not start with a task, starting afresh", cell.cell)
        return
    rnd, session = int(first["round"]), first.get("session")
    if isinstance(first.get("noise_seed"), int) and hasattr(cell.role, "noise_seed"):
        # cell DP: replaying a closed edge round with fresh noise would release its sum twice, with two
        # independent noises (their mean has less): the same seed re-sends exactly what was released
        cell.role.noise_seed = first["noise_seed"]
    j = _Journaled.read(entries[1:])
    if j.report is not None:  # the round is over here: answer the cloud's repeat of it with this report
        cell.round, cell.messenger.session, cell.sent_report = rnd, session, j.report
        # journaled before it was published: it may have died in the process (the same message again:
        # a cloud that had it counts it once)
        log.warning("cell %s: resumed after round %s, sending its report again", cell.cell, nth(rnd))
        cell.transport.publish(topics.cell_report(cell.run, cell.cell), j.report, qos=1)
        return
    try:
        cell.role.begin(rnd, Payload(first["task"], entries[0].tensors))
    except Exception as exc:  # the same task was accepted before the crash; never expected
        log.warning("cell %s: cannot resume round %s (%s): starting afresh", cell.cell, nth(rnd), exc)
        return
    cell.enter_round(rnd, session)
    logged = _logged(cell, rnd)
    for e in range(cell.role.edge_rounds):
        cell.edge_round = e
        cell.edge = EdgeRound()
        if e not in j.plans:  # crashed before planning it: plan it now
            log.warning("cell %s: resumed round %s at edge round %s", cell.cell, nth(rnd), nth_edge(rnd, e))
            cell.start_edge()
            return
        if not _replay_edge(cell, j, e, logged):
            return
    cell.edge_round = cell.role.edge_rounds  # every edge round closed, the report not sent yet
    cell.send_report()


def _replay_edge(cell: Host, j: _Journaled, e: int, logged: set[tuple[int, int]]) -> bool:
    """Replay edge round ``e`` as planned: a closed one is aggregated again (True: go on to the next); an open
    one is re-opened with the results it had, waiting for the others (False)."""
    plan = cell.role.plan(e, j.plans[e]["available"])  # deterministic: the plan of before the crash
    cell.edge.absent = dict(j.plans[e]["absent"])
    cell.edge.not_participating = int(j.plans[e]["not_participating"])
    answered = dict(sorted(j.results.get(e, {}).items()))
    diverged = {d: why for d, r in answered.items() if (why := diverged_reason(r)) is not None}
    failed = {d: why for d, r in answered.items() if (why := failed_reason(r)) is not None}
    taken = {d: r for d, r in answered.items() if d not in diverged and d not in failed}  # never aggregated
    if e in j.closed:
        with sums_on(cell.sums):
            cell.role.aggregate(e, taken)
        record = j.closed[e]
        cell.tally.add(int(record.get("bytes_out", 0)), int(record.get("bytes_in", 0)), taken, diverged, failed)
        if (cell.round, e) not in logged:  # the crash came between the journal and the aggregation log
            cell.telemetry.emit(record)
        return True
    log.warning(
        "cell %s: resumed edge round %s with %d of %d results",
        cell.cell,
        nth_edge(cell.round, e),
        len(taken),
        len(plan),
    )
    cell.edge.t0, cell.edge.wall0 = cell.loop.now(), time.perf_counter()
    cell.edge.opened = True
    cell.edge.bytes_in = j.nbytes.get(e, 0)
    for d, result in taken.items():
        cell.edge.note_loss(d, result)
    cell.edge.diverged, cell.edge.failed = diverged, failed
    cell.open_edge(plan, j.plans[e]["available"], taken, settled=set(diverged) | set(failed))
    return False


def _logged(cell: Host, rnd: int) -> set[tuple[int, int]]:
    """The (round, edge round) of ``rnd`` that this cell's aggregation log already holds."""
    path = cell.telemetry.log.path
    if path is None or not path.exists():
        return set()
    return {
        (r["round"], r["edge_round"]) for r in read_jsonl(path) if r.get("cell") == cell.cell and r.get("round") == rnd
    }
