"""Equal tuning effort for every method of a paper preset: a learning-rate grid x seeds, run in parallel.

Each method gets the same kind of grid (wide enough that the winner should sit inside it) and the same
seeds; the winner is the grid value with the best mean metric over the seeds, and a winner at either end
of its grid is flagged (``EDGE``): the grid should be widened before the figure is trusted. Runs go to a
process pool (each run single-threaded torch), so a preset uses ``--jobs`` cores.
"""
from __future__ import annotations

import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


@dataclass
class Cell:
    """One (method, grid value): the per-seed results of ``run`` (dicts of metrics)."""

    method: str
    value: float
    runs: list[dict[str, Any]] = field(default_factory=list)

    def mean(self, key: str) -> float:
        vals = [r[key] for r in self.runs]
        return sum(vals) / len(vals) if vals else math.nan

    def std(self, key: str) -> float:
        vals = [r[key] for r in self.runs]
        if len(vals) < 2 or any(math.isinf(v) for v in vals):
            return 0.0 if len(vals) < 2 else math.nan
        m = sum(vals) / len(vals)
        return math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))


@dataclass
class Winner:
    method: str
    cell: Cell
    grid: list[float]
    edge: bool  # the winner sits at an end of its grid


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def sweep(run: Callable[..., dict[str, Any]], grids: dict[str, Sequence[float]], seeds: Sequence[int],
          jobs: int, progress: bool = True, **common: Any) -> dict[str, list[Cell]]:
    """``run(method, value, seed, **common)`` for every method, grid value and seed; cells per method."""
    cells = {m: [Cell(m, v) for v in grid] for m, grid in grids.items()}
    # interleaved (grid position from the middle out, seed, method): an interrupted sweep still has the
    # central grid values of every method
    longest = max(len(g) for g in grids.values())
    middle_out = sorted(range(longest), key=lambda i: (abs(i - (longest - 1) / 2), i))
    tasks = [(m, i, s) for i in middle_out for s in seeds for m, grid in grids.items() if i < len(grid)]
    t0, done = time.perf_counter(), 0
    with ProcessPoolExecutor(max_workers=max(1, jobs), initializer=_init_worker) as pool:
        futures = [(m, i, pool.submit(run, m, cells[m][i].value, s, **common)) for m, i, s in tasks]
        for m, i, f in futures:
            result = f.result()
            cells[m][i].runs.append(result)
            done += 1
            if progress:  # every run's figures as it completes: partial sweeps stay usable
                brief = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in result.items()
                         if not isinstance(v, (list, dict))}
                print(f"  [{done}/{len(tasks)} runs, {time.perf_counter() - t0:.0f} s] {m} {cells[m][i].value:g}: "
                      f"{brief}", file=sys.stderr, flush=True)
    return cells


def pick(cells: dict[str, list[Cell]], key: str, lower_is_better: bool) -> dict[str, Winner]:
    """The best grid value per method by the seed mean of ``key`` (ties: the first), flagged at an edge."""
    out = {}
    for m, row in cells.items():
        sign = 1.0 if lower_is_better else -1.0
        order = sorted(range(len(row)), key=lambda i: (sign * _finite(row[i].mean(key), lower_is_better), i))
        best = order[0]
        out[m] = Winner(m, row[best], [c.value for c in row], len(row) > 1 and best in (0, len(row) - 1))
    return out


def _finite(v: float, lower_is_better: bool) -> float:
    if math.isnan(v):
        return math.inf if lower_is_better else -math.inf
    return v


def grid_line(cells: list[Cell], key: str, fmt: Callable[[float], str]) -> str:
    """``value: mean`` for every grid value of a method (the tuning curve)."""
    return "  ".join(f"{c.value:g}: {fmt(c.mean(key))}" for c in cells)


def edge_note(w: Winner) -> str:
    return "  EDGE: winner at the end of its grid, widen it" if w.edge else ""


def cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its finished children (e.g. a closed pool's workers)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
