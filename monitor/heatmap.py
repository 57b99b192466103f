"""The participation heatmap of ``fedtier report``, folded in one pass over a run's cell records, in bounded memory.

Each entry of the full matrix (device, cloud round) is the share of its cell's edge rounds in that round that the
device answered (0: absent or not planned). A run of up to :data:`MAX_ROWS` devices and :data:`MAX_COLUMNS` rounds
is drawn as that matrix, entry for entry. A larger one is drawn as a grid of at most ``MAX_ROWS x MAX_COLUMNS``
buckets, each the mean of the full matrix's entries it covers: columns of ``width`` consecutive rounds, and rows
that are its devices (up to ``MAX_ROWS``), else groups of consecutive devices of a cell (up to ``MAX_TRACKED``
devices), else its cells, else groups of consecutive cells (in name order). What is held is the grid, per device
(its cell; its columns while there are up to ``MAX_TRACKED``) and per cell, never devices x rounds: a run of 10^6
devices over 10^5 rounds made the matrix alone 800 GB. The per-cell mean aggregation durations of the same columns
come along (:meth:`Participation.durations`).

Records of one cell's cloud round are taken to come together, as every writer writes them (a cell's round is
settled once its records of two later rounds came); a record of a cell's round after that counts as another round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from protocols.records import CellRecord

MAX_ROWS = 200
MAX_COLUMNS = 500
MAX_TRACKED = 1000  # devices whose columns are kept one by one (4 MB), to draw them or groups of them
OPEN_ROUNDS = 2  # rounds of a cell held open (their edge rounds still coming) before the oldest is settled


@dataclass
class Heatmap:
    """The drawn matrix: ``rows`` (device names, or cells / cell groups when bucketed), ``cells`` (the cell of each
    row, or its first), ``matrix[row, column]``; each column is ``width`` cloud rounds of the ``rounds``."""

    rows: list[str]
    cells: list[str]
    matrix: np.ndarray
    rounds: int
    width: int = 1
    per_row: str = "device"

    def x_label(self) -> str:
        if self.width == 1:
            return "cloud round"
        cols = self.matrix.shape[1]
        return f"cloud rounds 1-{self.rounds:,} in {cols} columns of {self.width} (each: the mean share of them)"


@dataclass
class _Open:
    """One cell's cloud round whose records may still come: answers counted, edge rounds seen."""

    answers: float = 0.0
    edges: set[int] = field(default_factory=set)
    by_device: dict[str, int] | None = None


def _row(sums: dict[str, np.ndarray], key: str) -> np.ndarray:
    """``sums[key]``, a row of MAX_COLUMNS zeros the first time."""
    row = sums.get(key)
    if row is None:
        row = sums[key] = np.zeros(MAX_COLUMNS)
    return row


class Participation:
    """Fold cell records (:meth:`add`) into the heatmap of a run whose cloud closed ``rounds`` rounds; the cells'
    rounds right after them count too (a run stopped mid-round), up to the grid's last column."""

    def __init__(self, rounds: int) -> None:
        self.base = rounds
        self.width = max(1, math.ceil(rounds / MAX_COLUMNS))
        self.limit = MAX_COLUMNS * self.width  # rounds past this are never drawn (a record of round 1e12)
        self.cell_of: dict[str, str] = {}  # every device named, its cell
        self.cell_sums: dict[str, np.ndarray] = {}  # cell -> per column: the sum over (device, round) of the shares
        self.device_sums: dict[str, np.ndarray] | None = {}  # the same per device, while there are <= MAX_TRACKED
        self.duration: dict[str, np.ndarray] = {}  # cell -> per column: [seconds summed, aggregations]
        self.points: list[tuple[str, int, int, float]] | None = [] if self.width == 1 else None  # each aggregation's
        self.later: set[int] = set()  # the cells' rounds the cloud did not close
        self._open: dict[str, dict[int, _Open]] = {}
        self._after: list[tuple[str, int, _Open]] = []  # settled rounds past the cloud's: drawn if contiguous

    def add(self, r: CellRecord) -> None:
        for d in (*r.planned, *r.absent, *r.answered):
            self.cell_of[d] = r.cell
        if r.round >= self.limit:
            return
        if self.device_sums is not None and len(self.cell_of) > MAX_TRACKED:
            self.device_sums = None  # too many devices to keep each one's columns: cells from now on
        if r.round >= self.base:
            self.later.add(r.round)
        col = r.round // self.width
        if self.points is not None:
            self.points.append((r.cell, r.round, r.edge_round, r.duration_s))
            if len(self.points) > MAX_ROWS * MAX_COLUMNS:
                self.points = None  # many edge rounds: their means per round from now on
        if r.cell not in self.duration:
            self.duration[r.cell] = np.zeros((MAX_COLUMNS, 2))
        spent = self.duration[r.cell][col]
        spent[0] += r.duration_s
        spent[1] += 1
        rounds = self._open.setdefault(r.cell, {})
        entry = rounds.get(r.round)
        if entry is None:
            entry = rounds[r.round] = _Open(by_device={} if self.device_sums is not None else None)
            if len(rounds) > OPEN_ROUNDS:
                oldest = min(rounds)
                self._settle(r.cell, oldest, rounds.pop(oldest))
        entry.answers += len(r.answered)
        entry.edges.add(r.edge_round)
        if entry.by_device is not None:
            for d in r.answered:
                entry.by_device[d] = entry.by_device.get(d, 0) + 1

    def _settle(self, cell: str, rnd: int, entry: _Open) -> None:
        if rnd >= self.base:
            self._after.append((cell, rnd, entry))  # held until we know whether its round is drawn
            return
        col, edges = rnd // self.width, len(entry.edges)
        _row(self.cell_sums, cell)[col] += entry.answers / edges
        if self.device_sums is not None and entry.by_device is not None:
            for d, n in entry.by_device.items():
                _row(self.device_sums, d)[col] += n / edges

    def rounds(self) -> int:
        """The rounds drawn: the cloud's, then the cells' right after them up to the first gap."""
        n = self.base
        while n in self.later:
            n += 1
        return n

    def finish(self) -> Heatmap:
        """The heatmap of everything added (call once)."""
        for cell, rounds in self._open.items():
            for rnd, entry in sorted(rounds.items()):
                self._settle(cell, rnd, entry)
        self._open = {}
        n = self.rounds()
        self.base, after, self._after = n, self._after, []
        for cell, rnd, entry in after:
            if rnd < n:
                self._settle(cell, rnd, entry)
        cols = math.ceil(n / self.width)
        spans = np.minimum(self.width, n - self.width * np.arange(cols)).astype(float)  # rounds in each column
        if self.device_sums is not None and len(set(self.cell_of.values())) <= MAX_ROWS:
            return self._by_devices(n, cols, spans)
        return self._by_cells(n, cols, spans)

    def _device_groups(self) -> tuple[int, list[list[str]]]:
        """The devices by (cell, name), in groups of ``g`` consecutive ones of a cell (a cell's last one smaller),
        ``g`` the least that makes at most MAX_ROWS groups (1: a row per device)."""
        by_cell: dict[str, list[str]] = {}
        for d in sorted(self.cell_of, key=lambda d: (self.cell_of[d], d)):
            by_cell.setdefault(self.cell_of[d], []).append(d)
        g = max(1, math.ceil(len(self.cell_of) / MAX_ROWS))
        while sum(math.ceil(len(ds) / g) for ds in by_cell.values()) > MAX_ROWS:
            g += 1
        return g, [ds[i : i + g] for ds in by_cell.values() for i in range(0, len(ds), g)]

    def _by_devices(self, n: int, cols: int, spans: np.ndarray) -> Heatmap:
        (g, groups), sums = self._device_groups(), self.device_sums or {}
        matrix = np.zeros((len(groups), cols))
        for i, group in enumerate(groups):
            total = sum((sums[d][:cols] for d in group if d in sums), np.zeros(cols))
            matrix[i] = total / (len(group) * spans)
        firsts = [group[0] for group in groups]
        if g == 1:
            return Heatmap(firsts, [self.cell_of[d] for d in firsts], matrix, n, self.width)
        labels = [f"{ds[0]}..{ds[-1]} ({len(ds)} devices)" if len(ds) > 1 else ds[0] for ds in groups]
        return Heatmap(labels, [self.cell_of[d] for d in firsts], matrix, n, self.width, f"{g} devices of a cell")

    def _by_cells(self, n: int, cols: int, spans: np.ndarray) -> Heatmap:
        sizes: dict[str, int] = {}
        for c in self.cell_of.values():
            sizes[c] = sizes.get(c, 0) + 1
        cells = sorted(sizes)
        per = math.ceil(len(cells) / MAX_ROWS)
        groups = [cells[i : i + per] for i in range(0, len(cells), per)]
        matrix = np.zeros((len(groups), cols))
        labels = []
        for i, group in enumerate(groups):
            devices = sum(sizes[c] for c in group)
            total = sum((self.cell_sums[c][:cols] for c in group if c in self.cell_sums), np.zeros(cols))
            matrix[i] = total / (devices * spans)
            name = group[0] if len(group) == 1 else f"{group[0]}..{group[-1]}"
            labels.append(f"{name} ({devices:,} devices)")
        per_row = "cell" if per == 1 else f"{per} cells"
        return Heatmap(labels, [g[0] for g in groups], matrix, n, self.width, per_row)

    def durations(self, cols: int) -> dict[str, tuple[list[float], list[float]]]:
        """Per cell: (cloud round + edge round / edge rounds, wall seconds) of each aggregation of a run of up to
        MAX_COLUMNS rounds, as :func:`monitor.report.plot_cell_durations` draws kept records; else (the middle round
        of each of the first ``cols`` columns that had aggregations, 1-based; their mean aggregation seconds)."""
        out: dict[str, tuple[list[float], list[float]]] = {}
        if self.points is not None:
            edges = max((p[2] for p in self.points), default=0) + 1
            for cell, rnd, edge, seconds in sorted(self.points, key=lambda p: (p[1], p[2], p[0])):
                x, y = out.setdefault(cell, ([], []))
                x.append(rnd + 1 + edge / edges)
                y.append(seconds)
            return dict(sorted(out.items()))
        for cell in sorted(self.duration):
            spent = self.duration[cell][:cols]
            has = np.nonzero(spent[:, 1])[0]
            x = [float(c * self.width + (self.width + 1) / 2) for c in has]
            out[cell] = (x, [float(s) for s in spent[has, 0] / spent[has, 1]])
        return out
