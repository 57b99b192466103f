"""One run folder as ``fedtier report`` reads it: :func:`load_run`, in one pass and bounded memory.

The cloud's round records (one per round) are read into exact figures and bounded series (:mod:`monitor.round_series`:
at most a few thousand points a series, ~0.5 KB each). The cells' aggregation records are kept while the run is small
(:data:`KEEP_NAMES` device names, :data:`KEEP_RECORDS` records); past that they are folded into what the report draws
as they are read (:class:`monitor.heatmap.Participation`: the heatmap and the per-cell durations, bucketed) and
dropped: a run of 1,000 devices over 20,000 rounds held its whole log as records (GBs) before the report began.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monitor.heatmap import Heatmap, Participation
from monitor.round_series import RoundPoint, Rounds, RoundSeries
from monitor.sources import RunDirFollower, read_summary
from protocols import runfiles
from protocols.jsonl import rotated
from protocols.records import BadLine, BadLines, CellRecord, Dedup, RoundRecord, iter_records

KEEP_NAMES = 50_000  # device names (planned, answered, absent) the kept cell records may hold
KEEP_RECORDS = 1_000  # cell records kept (~4.5 KB each)


class NotARunFolder(ValueError):
    """A folder given as a run's that is not one (a cell's own job folder): the input is wrong (``fedtier report``
    exits 2, as for a federation's folder)."""


@dataclass
class RunData:
    """One run folder, read and validated."""

    path: Path
    label: str
    algorithm: str
    series: Rounds
    """The cloud rounds: the exact figures and the bounded series the plots draw (:mod:`monitor.round_series`)."""
    cells: list[CellRecord]
    """Every cell record of the run, or none where it had too many to keep (``folded`` then draws them)."""
    bad: BadLines = field(default_factory=BadLines)
    summary: dict[str, Any] = field(default_factory=dict)
    ended: str = "running"
    """How the run ended (``finished``, ``stopped: why``, ``failed: why``), as ``fedtier monitor`` says it; ``running``
    where nothing says it ended."""
    mean_participation: float | None = None
    """The mean over the cell records of answered / planned (None: nobody planned)."""
    folded: Folded | None = None

    @property
    def rounds(self) -> list[RoundPoint]:
        """Every round sorted, or a bounded stride over them with the first, last and best (``series.points``)."""
        return self.series.points

    @property
    def evaluated(self) -> list[RoundPoint]:
        """The rounds with an accuracy, likewise (``series.evaluated``: the last one is the run's last)."""
        return self.series.evaluated

    def elapsed(self, r: RoundPoint) -> float:
        """Loop-clock seconds from the start of the first round to the end of ``r`` (virtual in sim)."""
        return r.clock_s - self._clock_start

    @property
    def _clock_start(self) -> float:
        first = self.series.first
        return first.clock_start_s if first.clock_start_s is not None else 0.0

    @property
    def has_epsilon(self) -> bool:
        """True when the run accounted differential privacy (its round records carry ``epsilon``)."""
        return self.series.has_epsilon

    @property
    def has_clock(self) -> bool:
        """True when the loop clock moved (a virtual clock, deadlines, or a real-time run)."""
        return self.series.max_clock_s > self._clock_start  # as some round's elapsed() > 0


@dataclass
class Folded:
    """What the report draws of a run whose cell records were not kept: its heatmap and per-cell durations
    (:meth:`monitor.heatmap.Participation.durations`)."""

    heatmap: Heatmap
    durations: dict[str, tuple[list[float], list[float]]]


def heatmap(run: RunData) -> Heatmap:
    """The participation heatmap of ``run`` (:mod:`monitor.heatmap`)."""
    if run.folded is not None:
        return run.folded.heatmap
    fold = Participation(run.series.last.round + 1)
    for r in run.cells:
        fold.add(r)
    return fold.finish()


class _CellRecords:
    """The cell records as they are read: kept while few, else folded; their mean participation."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.kept: list[CellRecord] = []  # until they are folded
        self.names = 0
        self.fold: Participation | None = None
        self.algorithm: str | None = None
        self.part_sum, self.part_n = 0.0, 0

    def add(self, r: CellRecord) -> None:
        if self.algorithm is None:
            self.algorithm = r.algorithm
        if r.participation is not None:
            self.part_sum, self.part_n = self.part_sum + r.participation, self.part_n + 1
        if self.fold is not None:
            self.fold.add(r)
            return
        self.kept.append(r)
        self.names += len(r.planned) + len(r.answered) + len(r.absent)
        if self.names > KEEP_NAMES or len(self.kept) > KEEP_RECORDS:  # too many to keep: fold them from now on
            self.fold = Participation(self.rounds)
            for k in self.kept:
                self.fold.add(k)
            self.kept = []

    def folded(self) -> Folded | None:
        if self.fold is None:
            return None
        heat = self.fold.finish()
        return Folded(heat, self.fold.durations(heat.matrix.shape[1]))


def _stream(path: Path, bad: BadLines) -> Iterator[CellRecord | RoundRecord]:
    """The records of ``aggregation.jsonl`` then those of ``cells.jsonl`` (a deployed cloud's collection of the
    cells' records) not in it, one at a time; the bad lines go to ``bad``. Without a ``cells.jsonl`` (``fedtier
    sim``'s folders) nothing is held to tell copies apart: ~185 bytes a record, 1.9 GB for 100 cells x 10^5 rounds."""
    dedup = Dedup() if rotated(path / runfiles.CELL_RECORDS) else None
    for name in (runfiles.AGGREGATION, runfiles.CELL_RECORDS):
        for item in iter_records(path / name):
            if isinstance(item, BadLine):
                bad.add(item)
            elif dedup is None or dedup([item]):
                yield item


def _ended(ends: list[dict]) -> str:
    """How a run ended, from its end states (``RunDirFollower.states_of``): ``finished``, ``failed: why``, ..."""
    return ": ".join(filter(None, (ends[-1]["phase"], ends[-1].get("reason"))))


def _read(path: Path) -> tuple[Rounds, _CellRecords, BadLines]:
    """The run's rounds, its cell records (kept or folded) and its bad lines (``metrics.jsonl``'s first). Nothing
    of ``metrics.jsonl`` but its rounds is held: its cell records (none in what fedtier writes) are read again once the
    rounds are known, and its bad lines are counted (the first kept), however many there are."""
    rounds, bad, cells_in_metrics = RoundSeries(), BadLines(), False
    for item in iter_records(path / runfiles.METRICS):
        if isinstance(item, RoundRecord):
            rounds.add(RoundPoint.of(item))
        elif isinstance(item, BadLine):
            bad.add(item)
        else:
            cells_in_metrics = True
    if rounds.last is None:
        jobs = runfiles.cell_jobs(path)
        if jobs:  # fedtier cell --serve's job folder: was "no cloud round records in metrics.jsonl", for a job done
            whose = ", ".join(sorted({j["cell"] for j in jobs}))
            raise NotARunFolder(
                f"{path}: cell {whose}'s job folder (job {jobs[0]['job']}): its own aggregation records only; "
                "the job's rounds, which a report plots, are in the cloud's job folder"
            )
        if ends := RunDirFollower(path).states_of(read_summary(path)):  # walked: a job failed at once said only this
            raise ValueError(f"{path}: no round to plot: the run ended before its first round closed ({_ended(ends)})")
        raise ValueError(f"{path}: no cloud round records in {runfiles.METRICS}")
    cells = _CellRecords(rounds.last.round + 1)
    for r in _stream(path, bad):
        if isinstance(r, RoundRecord):
            rounds.add(RoundPoint.of(r))
        else:
            cells.add(r)
    if cells_in_metrics:
        for item in iter_records(path / runfiles.METRICS):
            if isinstance(item, CellRecord):
                cells.add(item)
    return rounds.finish(), cells, bad


def load_run(path: str | Path) -> RunData:
    """Read a run folder; raise ``ValueError`` when it holds no cloud round record."""
    path = Path(path)
    rounds, cells, bad = _read(path)
    name, algorithm = rounds.first.run or path.name, cells.algorithm or "?"
    config = path / runfiles.CONFIG
    if config.exists():
        try:
            cfg = tomllib.loads(config.read_text(encoding="utf-8"))
            name = cfg.get("run", {}).get("name", name)
            algorithm = cfg.get("algorithm", {}).get("name", algorithm)
        except tomllib.TOMLDecodeError:
            pass
    read = read_summary(path)
    data = read[1] if read is not None else None
    # every device's traffic: not drawn, and as large as the population
    summary = {k: v for k, v in data.items() if k != "device_traffic"} if isinstance(data, dict) else {}
    ends = RunDirFollower(path).states_of(read)
    ended = _ended(ends) if ends else "running"
    kept = sorted(cells.kept, key=lambda r: (r.round, r.edge_round, r.cell))
    run = RunData(path, f"{name} ({algorithm})", algorithm, rounds, kept, bad, summary, ended)
    run.mean_participation = cells.part_sum / cells.part_n if cells.part_n else None
    run.folded = cells.folded()
    return run
