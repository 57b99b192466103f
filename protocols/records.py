"""The telemetry records a run writes and publishes, as a versioned pydantic schema.

Two kinds, one JSON object per line (``aggregation.jsonl`` / ``metrics.jsonl`` of a run folder) and one
per message on ``fedtier/{run}/telemetry/cell/{cell}`` / ``fedtier/{run}/telemetry/cloud``:

* :class:`CellRecord` (``"event": "aggregation"``): one per edge-round aggregation of a cell.
* :class:`RoundRecord` (``"event": "round"``): one per cloud round.

Every record carries ``"schema": SCHEMA_VERSION``. Optional fields that are ``None`` are left out of the
JSON. Algorithms put their own numbers under the free-form ``metrics`` dict; the top level is fixed
(an unknown top-level key is an error), except that a round record also takes extra evaluation
numbers (floats) next to ``accuracy`` and ``loss``. Readers validate every line: a bad line is
reported as a :class:`BadLine` and skipped, never fatal.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .jsonl import loads, rotated
from .rejections import RejectKind

SCHEMA_VERSION: Literal[1] = 1

MAX_LISTED_REJECTIONS = 100
"""A record lists at most this many rejections (a flood of bad messages keeps records and memory small);
``rejected_more`` counts the others."""

TIERS = ("cloud_to_cell", "cell_to_cloud", "cell_to_device", "device_to_cell")
TASKED = ("deadline", "quorum")  # absent reasons of devices that were planned (sent a task) and did not answer in time
"""The four links whose bytes every round record counts."""


BUFFER_FULL = "buffer full"
"""``closed_by`` of an asynchronous job's records: a version closed by its full buffer (its cells' and its cloud's)."""
_HEAD = ("schema", "event", "run", "round", "edge_round", "cell", "algorithm")
Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""A count or round number a record holds: an int64, as any reader holds it (JSON bounds no integer: a peer's
10**400 would make a reader's float of it raise)."""


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)

    schema_version: Literal[1] = Field(SCHEMA_VERSION, alias="schema", description="record schema version")
    run: str | None = Field(None, description="run name")
    round: Count = Field(description="cloud round")
    time: float | None = Field(None, description="wall clock (Unix seconds) when the record was written")
    closed_by: str = Field(description="why the aggregation closed: all answered, quorum, deadline, ...")
    duration_s: float = Field(ge=0, description="wall seconds the aggregation took")
    metrics: dict[str, Any] = Field(default_factory=dict, description="free-form numbers of the algorithm")

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this record (``None`` fields left out)."""
        data = {k: v for k, v in self.model_dump(mode="json", by_alias=True).items() if v is not None}
        head = {k: data.pop(k) for k in _HEAD if k in data}
        return {**head, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)


class Rejection(BaseModel):
    """A message a tier refused, and why."""

    model_config = ConfigDict(extra="forbid")
    device: str = Field(description="the device (or topic) it came from")
    kind: RejectKind = Field(
        RejectKind.INVALID,
        description="what was wrong, from a fixed vocabulary (protocols/rejections.py; the metrics' reason label); "
        "`invalid` in records written before kinds existed",
    )
    reason: str = Field(description="why, in words (free text: may be reworded at any time)")


class CellRecord(_Record):
    """One aggregation of one cell (an edge round)."""

    event: Literal["aggregation"] = "aggregation"
    edge_round: Count
    cell: str
    algorithm: str
    planned: list[str] = Field(default_factory=list, description="devices sent a task")
    answered: list[str] = Field(default_factory=list, description="devices whose result was aggregated")
    absent: dict[str, str] = Field(
        default_factory=dict,
        description="device -> offline | not participating | not selected | deadline | quorum (the edge round "
        "closed at runtime.quorum before it answered) (reasons with more than runtime.absent_ids devices only counted)",
    )
    absent_counts: dict[str, Count] | None = Field(
        None, description="reason -> absent devices, when `absent` leaves some out"
    )
    rejected: list[Rejection] = Field(default_factory=list, description="results refused, with reasons")
    rejected_more: Count | None = Field(None, description="refused beyond the MAX_LISTED_REJECTIONS listed")
    excluded: dict[str, str] | None = Field(
        None, description="answered devices the robust aggregator (algorithm.cell_aggregator) left out, with why"
    )
    diverged: dict[str, str] | None = Field(
        None,
        description="devices whose training diverged (non-finite "
        "loss or parameters): answered, not aggregated, with why",
    )
    failed: dict[str, str] | None = Field(
        None, description="devices whose task raised (answered with the reason, not aggregated): device -> reason"
    )
    failed_counts: dict[str, Count] | None = Field(
        None, description="reason -> devices whose task failed with it (at most 8 reasons, the rest as other)"
    )
    bytes_in: Count = Field(0, description="device -> cell payload bytes of this edge round")
    bytes_out: Count = Field(0, description="cell -> device payload bytes of this edge round (each task's first send)")
    bytes_resent: Count | None = Field(
        None,
        description="cell -> device payload bytes of tasks sent again in this edge round (a device back while its "
        "result was pending, e.g. after a reconnect; asynchronous: a task replacing one it lost): retransmission "
        "overhead, not in bytes_out nor the cloud's bytes",
    )
    loss_mean: float | None = Field(None, description="mean training loss the answering devices reported")
    loss_std: float | None = Field(None, description="its standard deviation over devices")
    clock_s: float = Field(0.0, ge=0, description="loop-clock seconds of the edge round (virtual in simulation)")
    clock_end_s: float | None = Field(None, description="loop clock when it closed (virtual time in simulation)")
    deadline_s: float | None = Field(None, description="the cell's device deadline (loop-clock seconds)")

    @property
    def participation(self) -> float | None:
        """Answered / planned, or None when nobody was planned."""
        return len(self.answered) / len(self.planned) if self.planned else None

    @property
    def cell_size(self) -> int:
        """Devices of the cell this record knows of (planned or absent, named or only counted)."""
        listed = set(self.absent.values())
        unnamed = sum(n for why, n in (self.absent_counts or {}).items() if why not in listed and why not in TASKED)
        return len(set(self.planned) | set(self.absent)) + unnamed  # a reason is named in full or only counted

    @property
    def coverage(self) -> float | None:
        """Answered / all devices of the cell (drops when devices go offline or stop participating)."""
        return len(self.answered) / self.cell_size if self.cell_size else None

    def absent_by_reason(self) -> dict[str, int]:
        """How many devices were absent, by reason (all of them, also those ``absent`` leaves out)."""
        if self.absent_counts is not None:
            return dict(self.absent_counts)
        counts: dict[str, int] = {}
        for why in self.absent.values():
            counts[why] = counts.get(why, 0) + 1
        return counts


class RoundRecord(_Record):
    """One cloud round. ``accuracy`` and ``loss`` are present on evaluated rounds only."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, allow_inf_nan=False)
    __pydantic_extra__: dict[str, float] = Field(init=False)  # other evaluation numbers

    event: Literal["round"] = "round"
    rounds: Count | None = Field(None, ge=1, description="cloud rounds the run is configured for")
    cells_planned: list[str] = Field(default_factory=list)
    cells_reported: list[str] = Field(default_factory=list)
    cells_absent: list[str] = Field(default_factory=list)
    devices: dict[str, Count] = Field(default_factory=dict, description="cell -> devices that took part")
    devices_diverged: dict[str, Count] | None = Field(
        None, description="cell -> devices whose training diverged (answered, never aggregated)"
    )
    cells_failed: dict[str, str] | None = Field(
        None,
        description="cells that answered 'failed' (their handler raised: runtime.fail_on_cell_failure off), with why; "
        "async: a cell that refused to work (restarted without its journal), left out of the job until it is "
        "restarted properly (its status refuses no more)",
    )
    cells_revoked: dict[str, str] | None = Field(
        None,
        description="cells of the job the federation revoked so far (its signed roster), with when: never planned "
        "again, what they send refused; one revoked in this round is in cells_absent, its report not aggregated",
    )
    devices_failed: dict[str, Count] | None = Field(
        None, description="cell -> devices whose task failed in every edge round they had (answered, not aggregated)"
    )
    failures: dict[str, Count] | None = Field(
        None, description="reason -> devices whose task failed with it this round, over the cells (bounded)"
    )
    rejected: list[dict[str, str]] = Field(default_factory=list, description="cell reports refused: from, kind, reason")
    rejected_more: Count | None = Field(None, description="refused beyond the MAX_LISTED_REJECTIONS listed")
    excluded: dict[str, str] | None = Field(
        None, description="reporting cells the robust aggregator (algorithm.cloud_aggregator) left out, with why"
    )
    bytes: dict[str, Count] = Field(
        default_factory=dict, description="payload bytes of this round per tier (each task's first send)"
    )
    bytes_resent: dict[str, Count] | None = Field(
        None,
        description="payload bytes of tasks the cloud sent again this round (a cell that lost its task, or its "
        "model version) per tier: retransmission overhead, not in bytes nor cumulative_bytes",
    )
    cumulative_bytes: dict[str, Count] = Field(default_factory=dict, description="payload bytes so far per tier")
    clock_start_s: float | None = Field(None, description="loop clock when the round began")
    clock_s: float = Field(0.0, description="loop clock when the round closed (virtual time in simulation)")
    epsilon: float | None = Field(
        None,
        ge=0,
        description="differential privacy: epsilon spent after this round "
        "(at privacy.delta; see protocols/privacy/accountant.py)",
    )
    epsilon_by_party: dict[str, float | None] | None = Field(
        None,
        description="differential privacy: epsilon against the cloud, a device's cell and the other devices "
        "(null: no guarantee against that party, e.g. the cell under cell DP without secure aggregation)",
    )
    epsilon_basis: str | None = Field(
        None, description="what the epsilon assumes: the sampling rate q, the neighbouring relation, the noise"
    )
    accuracy: float | None = None
    loss: float | None = None
    diverged: str | None = Field(
        None,
        description="the global model's evaluation numbers that were not finite "
        "(left out of the record); the job fails after this round",
    )
    failed: str | None = Field(None, description="why the job failed after this round (it ends here)")


Record = CellRecord | RoundRecord
_BY_EVENT: dict[str, type[CellRecord] | type[RoundRecord]] = {"aggregation": CellRecord, "round": RoundRecord}


@dataclass(frozen=True)
class BadLine:
    """A line that is not a valid record: where, and why."""

    source: str
    line: int
    error: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.error}"


KEPT_BAD_LINES = 50
"""Invalid lines a reader keeps to show (the first ones); the rest are counted, the last one kept."""


class BadLines:
    """The invalid lines a reader met, in bounded memory: how many, the first :data:`KEPT_BAD_LINES` and the last. A
    file of garbage, or a broker user publishing garbage to the records' topics for as long as `fedtier monitor`
    runs, grew a list of every one of them (~200 bytes each, without bound)."""

    def __init__(self, keep: int = KEPT_BAD_LINES) -> None:
        self.keep, self.count = keep, 0
        self.first: list[BadLine] = []
        self.last: BadLine | None = None

    def add(self, line: BadLine) -> None:
        self.count += 1
        self.last = line
        if len(self.first) < self.keep:
            self.first.append(line)

    def extend(self, lines: Iterable[BadLine]) -> None:
        for line in lines:
            self.add(line)

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[BadLine]:
        """The kept ones, first to last (at most ``keep``)."""
        return iter(self.first)


def parse_record(obj: Any) -> Record:
    """Validate one record (a dict, JSON text or bytes); raise ``ValueError`` naming the problem."""
    if isinstance(obj, (bytes, bytearray, str)):
        try:
            obj = loads(bytes(obj) if isinstance(obj, bytearray) else obj, finite=True)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a record is a JSON object, got {type(obj).__name__}")
    version = obj.get("schema")
    if version != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {version!r} (this fedtier reads {SCHEMA_VERSION})")
    cls = _BY_EVENT.get(obj.get("event"))  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event {obj.get('event')!r} (expected one of {sorted(_BY_EVENT)})")
    try:
        return cls.model_validate(obj)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(record)'}: {e['msg']}" for e in exc.errors()[:5])
        raise ValueError(errors) from None


def parse_lines(
    lines: Iterable[str], source: str = "<records>", first_line: int = 1
) -> tuple[list[Record], list[BadLine]]:
    """Validate JSON lines; blank lines are skipped, bad ones reported."""
    records: list[Record] = []
    bad: list[BadLine] = []
    for n, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            records.append(parse_record(line))
        except ValueError as exc:
            bad.append(BadLine(source, n, str(exc)))
    return records, bad


def iter_records(path: str | Path) -> Iterator[Record | BadLine]:
    """Each line of a JSON-lines file and of its rotated predecessors (``path.1``...: a long-lived node's bounded
    files, ``protocols.jsonl.JsonlWriter``), oldest first, as its record or a :class:`BadLine`, one at a time (a
    reader that folds records in holds none of them); blank lines skipped, a missing file yields nothing."""
    for part in rotated(Path(path)):
        with part.open(encoding="utf-8", errors="replace") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield parse_record(line)
                except ValueError as exc:
                    yield BadLine(str(part), n, str(exc))


def read_records(path: str | Path) -> tuple[list[Record], list[BadLine]]:
    """Every valid record of a JSON-lines file and of its rotated predecessors (:func:`iter_records`), oldest
    first, and the lines that are not (a missing file: none)."""
    records: list[Record] = []
    bad: list[BadLine] = []
    for item in iter_records(path):
        (bad if isinstance(item, BadLine) else records).append(item)  # type: ignore[arg-type]
    return records, bad


def record_key(record: Record) -> tuple[Any, ...]:
    """What tells two copies of one record apart from two records: a cell's record as the cell wrote it and as
    a deployed cloud received it (``cells.jsonl``) have the same key."""
    if isinstance(record, CellRecord):
        return ("aggregation", record.cell, record.round, record.edge_round, record.time)
    return ("round", record.round, record.time)


class Dedup:
    """Passes each record once (by :func:`record_key`)."""

    def __init__(self) -> None:
        self.seen: set[tuple[Any, ...]] = set()

    def __call__(self, records: Iterable[Record]) -> list[Record]:
        fresh = []
        for r in records:
            key = record_key(r)
            if key not in self.seen:
                self.seen.add(key)
                fresh.append(r)
        return fresh


def read_run(run_dir: str | Path) -> tuple[list[Record], list[BadLine]]:
    """The cell records (``aggregation.jsonl``, then those a deployed cloud collected in ``cells.jsonl`` that
    are not in it) then the cloud records (``metrics.jsonl``) of a run folder."""
    from . import runfiles

    cells, bad_cells = read_records(Path(run_dir) / runfiles.AGGREGATION)
    collected, bad_collected = read_records(Path(run_dir) / runfiles.CELL_RECORDS)
    rounds, bad_rounds = read_records(Path(run_dir) / runfiles.METRICS)
    merged = Dedup()([*cells, *collected])
    if collected and cells:  # both: order the cells' records as they happened
        merged.sort(key=lambda r: (r.round, getattr(r, "edge_round", 0), r.time or 0.0, getattr(r, "cell", "")))
    return [*merged, *rounds], [*bad_cells, *bad_collected, *bad_rounds]
