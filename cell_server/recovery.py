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
cloud asks again. On disk: one round's inbound traffic at
most (its task and its devices' results).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from protocols.checkpoint import Journal
from protocols.divergence import diverged_reason
from protocols.failures import failed_reason
from protocols.jsonl import read_jsonl
from protocols.wire import topics
from protocols.wire.payload import Payload

if TYPE_CHECKING:
    from protocols.algorithms.base import CellRole
    from protocols.jsonl import JsonlWriter
    from protocols.transport.base import EventLoop, Transport
    from protocols.wire.messenger import Messenger

log = logging.getLogger("fedtier.cell")


class Host(Protocol):
    """What recovery needs of the cell server it restores (``cell_server.server.CellServer`` is one): its
    round state, to set it as the journal says, and the steps it resumes from."""

    run: str
    cell: str
    round: int
    edge_round: int
    loop: EventLoop
    transport: Transport
    role: CellRole
    messenger: Messenger
    log: JsonlWriter
    absent: dict[str, str]
    diverged: dict[str, str]
    failed: dict[str, str]
    losses: dict[str, float]
    bytes_in: int
    _not_participating: int
    _opened: bool
    _round_bytes: dict[str, int]
    _round_devices: set[str]
    _round_diverged: set[str]
    _round_failed: dict[str, str]
    _sent_report: bytes | None
    _t0: float
    _wall0: float

    def _emit(self, record: dict[str, Any]) -> None: ...

    def _enter_round(self, rnd: int, session: str | None) -> None: ...

    def _open_edge(
        self,
        plan: Mapping[str, Payload],
        available: list[str],
        taken: Mapping[str, Payload] | None = None,
        settled: Iterable[str] = (),
    ) -> None: ...

    def _report(self) -> None: ...

    def _reset_edge(self) -> None: ...

    def _start_edge(self) -> None: ...


class RoundJournal:
    """The typed entries of a cell's round journal (see the module docstring)."""

    def __init__(self, path: str | Path) -> None:
        self.file = Journal(path)

    def load(self, resume: bool) -> list[Payload]:
        """The entries to continue from (``resume``), else none and the journal is removed; an unreadable
        journal is logged and removed (the cell then starts afresh)."""
        if resume:
            try:
                return self.file.read()
            except (OSError, ValueError) as exc:
                log.warning("cannot resume from %s (%s): starting afresh", self.file.path, exc)
        self.file.clear()
        return []

    def task(self, rnd: int, session: str | None, task: Payload, noise_seed: int | None = None) -> None:
        """A cloud task starts the round's journal; ``noise_seed``: the seed of the noise the cell role adds
        (cell DP, drawn from the OS in deployments), kept so that a resumed cell adds the very same noise."""
        meta = {"k": "task", "round": rnd, "session": session, "task": task.meta}
        if noise_seed is not None:
            meta["noise_seed"] = noise_seed
        self.file.reset(Payload(meta, task.tensors))

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

    def result(self, edge_round: int, device: str, result: Payload, nbytes: int) -> None:
        self.file.append(
            Payload(
                {"k": "result", "edge": edge_round, "device": device, "nbytes": nbytes, "meta": result.meta},
                result.tensors,
            )
        )

    def closed(self, edge_round: int, record: dict[str, Any]) -> None:
        self.file.append(Payload({"k": "closed", "edge": edge_round, "record": record}))

    def report(self, message: bytes) -> None:
        self.file.append(Payload({"k": "report"}, {"message": np.frombuffer(message, np.uint8)}))

    def close(self) -> None:
        self.file.close()


def recover(cell: Host, entries: list[Payload]) -> None:
    """Bring ``cell`` (started, with a fresh role) back to where its journal ends, and go on from there."""
    first = entries[0].meta
    if first.get("k") != "task":
        log.warning("cell %s: journal does not start with a task, starting afresh", cell.cell)
        return
    rnd, session = int(first["round"]), first.get("session")
    if isinstance(first.get("noise_seed"), int) and hasattr(cell.role, "noise_seed"):
        # cell DP: replaying a closed edge round with fresh noise would release its sum twice, with two
        # independent noises (their mean has less): the same seed re-sends exactly what was released
        cell.role.noise_seed = first["noise_seed"]
    plans: dict[int, dict[str, Any]] = {}
    results: dict[int, dict[str, Payload]] = {}
    nbytes: dict[int, int] = {}
    closed: dict[int, dict[str, Any]] = {}
    report: bytes | None = None
    for entry in entries[1:]:
        m, e = entry.meta, entry.meta.get("edge", -1)
        if m["k"] == "plan":
            plans[e] = m
        elif m["k"] == "result":
            results.setdefault(e, {})[m["device"]] = Payload(m["meta"], entry.tensors)
            nbytes[e] = nbytes.get(e, 0) + int(m["nbytes"])
        elif m["k"] == "closed":
            closed[e] = m["record"]
        elif m["k"] == "report":
            report = entry.tensors["message"].tobytes()
    if report is not None:  # the round is over here: answer the cloud's repeat of it with this report
        cell.round, cell.messenger.session, cell._sent_report = rnd, session, report
        # journaled before it was published: it may have died in the process (the same message again:
        # a cloud that had it counts it once)
        log.warning("cell %s: resumed after round %d, sending its report again", cell.cell, rnd)
        cell.transport.publish(topics.cell_report(cell.run, cell.cell), report, qos=1)
        return
    try:
        cell.role.begin(rnd, Payload(first["task"], entries[0].tensors))
    except Exception as exc:  # the same task was accepted before the crash; never expected
        log.warning("cell %s: cannot resume round %d (%s): starting afresh", cell.cell, rnd, exc)
        return
    cell._enter_round(rnd, session)
    logged = _logged(cell, rnd)
    for e in range(cell.role.edge_rounds):
        cell.edge_round = e
        cell._reset_edge()
        if e not in plans:  # crashed before planning it: plan it now
            log.warning("cell %s: resumed round %d at edge round %d", cell.cell, rnd, e)
            cell._start_edge()
            return
        plan = cell.role.plan(e, plans[e]["available"])  # deterministic: the plan of before the crash
        cell.absent = dict(plans[e]["absent"])
        cell._not_participating = int(plans[e]["not_participating"])
        answered = dict(sorted(results.get(e, {}).items()))
        diverged = {d: why for d, r in answered.items() if (why := diverged_reason(r)) is not None}
        failed = {d: why for d, r in answered.items() if (why := failed_reason(r)) is not None}
        taken = {d: r for d, r in answered.items() if d not in diverged and d not in failed}  # never aggregated
        if e in closed:
            cell.role.aggregate(e, taken)
            cell._round_diverged |= set(diverged)
            cell._round_failed.update(failed)
            record = closed[e]
            cell._round_bytes["cell_to_device"] += int(record.get("bytes_out", 0))
            cell._round_bytes["device_to_cell"] += int(record.get("bytes_in", 0))
            cell._round_devices |= set(taken)
            if (rnd, e) not in logged:  # the crash came between the journal and the aggregation log
                cell._emit(record)
            continue
        log.warning(
            "cell %s: resumed round %d, edge round %d with %d of %d results", cell.cell, rnd, e, len(taken), len(plan)
        )
        cell._t0, cell._wall0 = cell.loop.now(), time.perf_counter()
        cell._opened = True
        cell.bytes_in = nbytes.get(e, 0)
        for d, result in taken.items():
            loss = result.meta.get("loss")
            if isinstance(loss, (int, float)) and np.isfinite(loss):
                cell.losses[d] = float(loss)
        cell.diverged, cell.failed = diverged, failed
        cell._open_edge(plan, plans[e]["available"], taken, settled=set(diverged) | set(failed))
        return
    cell.edge_round = cell.role.edge_rounds  # every edge round closed, the report not sent yet
    cell._report()


def _logged(cell: Host, rnd: int) -> set[tuple[int, int]]:
    """The (round, edge round) of ``rnd`` that this cell's aggregation log already holds."""
    path = cell.log.path
    if path is None or not path.exists():
        return set()
    return {
        (r["round"], r["edge_round"]) for r in read_jsonl(path) if r.get("cell") == cell.cell and r.get("round") == rnd
    }
