"""The cloud keeps the whole run: every cell's aggregation records, as their signed telemetry brings them.

Each cell writes ``aggregation.jsonl`` on its own machine and publishes every record on
``fedtier/{run}/telemetry/cell/{cell}`` (bridged to the cloud's broker). A deployed cloud subscribes to them
and appends each record that its cell signed for that topic (signed runs; as ``fedtier monitor --keys``
checks) to ``cells.jsonl`` in its run folder, so ``fedtier monitor|logs|report`` on the cloud's folder show
every cell (``protocols.records.read_run`` merges both files and drops a record present in both, as when a
cell shares the cloud's folder). A record that fails its checks is logged (rate-limited) and dropped: a
hostile cell can neither write another cell's records nor stop the job, nor name in them a device that is not its
own (where the cloud knows which cell a device belongs to: ``cell_of``), so the records ``fedtier report|monitor``
read off the cloud's folder hold no other cell's device and no more device names than the cell has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from protocols.jsonl import JsonlWriter
from protocols.records import CellRecord, parse_record
from protocols.round_text import nth
from protocols.transport.base import Handler, Transport
from protocols.wire import topics
from protocols.wire.envelope import WireError
from protocols.wire.ratelog import RateLimitedLog
from protocols.wire.signed import open_record, signer_of

if TYPE_CHECKING:
    from protocols.wire.keys import PublicKeys

log = logging.getLogger("fedtier.cloud")
_rejections = RateLimitedLog(log)

MAX_RECORD_BYTES = 8 << 20  # as the monitor's bound: a cell's record names its devices


class AtRound(Protocol):
    """The job's cloud server, as the collector sees it."""

    round: int


def named_devices(record: CellRecord) -> Iterator[str]:
    """Every device ``record`` names (planned, answered, absent, excluded, diverged or failed)."""
    yield from record.planned
    yield from record.answered
    for named in (record.absent, record.excluded, record.diverged, record.failed):
        yield from named or ()


def stranger(record: CellRecord, cell_of: Callable[[str], str | None]) -> str | None:
    """The first device ``record`` names that ``cell_of`` (the topology's or the roster's) puts in no cell or in
    another cell than the record's, or None."""
    return next((d for d in named_devices(record) if cell_of(d) != record.cell), None)


class CellRecordCollector:
    """Appends the aggregation records of ``cells`` that arrive as telemetry to ``path``; with ``cell_of``, only
    those naming devices of their own cell."""

    def __init__(
        self,
        transport: Transport,
        run: str,
        cells: list[str],
        path: str | Path,
        keys: PublicKeys | None = None,
        max_bytes: int | None = None,
        job: AtRound | None = None,
        cell_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.transport, self.run, self.cells, self.keys = transport, run, set(cells), keys
        self.job = job  # the cloud's round: a cell's record is never of a later one
        self.cell_of = cell_of  # device -> its cell: a cell's record names only its own devices
        self.writer = JsonlWriter(path, max_bytes)
        self.written = 0
        self.dropped = 0

    def start(self, wrap: Callable[[Handler], Handler] = lambda h: h) -> None:
        """Subscribe (``wrap``: the cloud's guard around the handler)."""
        self.transport.subscribe(topics.telemetry_cell(self.run, "+"), wrap(self._on_record))

    def _on_record(self, topic: str, data: bytes) -> None:
        cell = topic.rsplit("/", 1)[-1]
        try:
            if cell not in self.cells:
                raise ValueError(f"cell {cell!r} is not in this job")
            raw = open_record(
                data, topic, signer_of(topic), self.keys.verify if self.keys else None, max_bytes=MAX_RECORD_BYTES
            )
            record = parse_record(raw)
            if not isinstance(record, CellRecord) or record.cell != cell or record.run not in (None, self.run):
                raise ValueError(f"not an aggregation record of cell {cell!r} of run {self.run!r}")
            if self.job is not None and record.round > (now := self.job.round) + 1:
                # a cell with its own key could write round 1e12: fedtier report sized its heatmap by it
                raise ValueError(f"a record of round {nth(record.round)}, with the job at round {nth(now)}")
            if self.cell_of is not None and (other := stranger(record, self.cell_of)) is not None:
                # a cell with its own key named c1-d0 (or a million made-up ids): fedtier report put them in its row
                raise ValueError(f"the record names {other[:40]!r}, not a device of cell {cell!r}")
        except (WireError, ValueError) as exc:
            self.dropped += 1
            _rejections.warning("cloud: dropped a record on %s: %s", topic, exc)
            return
        self.writer.write(raw)
        self.written += 1

    def close(self) -> None:
        self.writer.close()


def collector(
    transport: Transport,
    run: str,
    cells: list[str],
    path: str | Path | None,
    keys: PublicKeys | None = None,
    max_bytes: int | None = None,
    job: AtRound | None = None,
) -> CellRecordCollector | None:
    """The collector of ``cells``' records into ``path``; ``None`` when the cloud keeps none (no ``path``)."""
    return CellRecordCollector(transport, run, cells, path, keys, max_bytes, job) if path is not None else None
