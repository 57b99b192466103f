"""Equal tuning effort for every method of a paper preset: a learning-rate grid x seeds, run in parallel.

Each method gets the same kind of grid (wide enough that the winner should sit inside it) and the same
seeds; the winner is the grid value with the best mean metric over the seeds, and a winner at either end
of its grid is flagged (``EDGE``): the grid should be widened before the figure is trusted. Runs go to a
process pool (each run single-threaded torch), so a preset uses ``--jobs`` cores.

Every finished run is appended to a :class:`Journal` (one JSON line, flushed and fsynced) named after the
script, the preset and a hash of the settings that change results: a sweep killed at any point loses only
its unfinished runs, and the same command resumes it (``--fresh`` ignores the journal).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"  # default home of the journals (gitignored)


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


# ------------------------------------------------------------------------------------------ journal
def _same(a: Any, b: Any) -> bool:
    """``a == b`` with NaN equal to NaN, any float type equal to float, and containers compared strictly (a
    tuple is not a list, a float key is not a string key): whether a run's metrics survive JSON unchanged."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _warn(msg: str) -> None:
    print(f"journal: WARNING: {msg}", file=sys.stderr, flush=True)


class Journal:
    """Finished runs of a sweep, one JSON line each, in an append-only file (``path=None``: in memory only).

    A line holds the method, grid value, seed, the run's metrics and its CPU and wall seconds. Runs already in
    the file are not run again; a truncated last line (a process killed mid-write) is dropped with a warning;
    ``fresh`` moves an existing file aside and starts empty. One process at a time may hold a journal (an
    exclusive lock). The first line records what the file is for (script, preset, settings and their hash).
    """

    def __init__(
        self,
        path: str | Path | None,
        params: dict[str, Any] | None = None,
        fresh: bool = False,
        label: dict[str, Any] | None = None,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.params = params or {}
        self.digest = settings_hash({**(label or {}), "params": self.params})
        self.entries: dict[tuple[str, float, int], dict[str, Any]] = {}
        self.reused = self.ran = 0
        self.cpu = self.wall = 0.0  # over every run a sweep used (reused ones with their recorded seconds)
        self._fh: Any = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists() and self.path.stat().st_size:
            aside = self.path.with_name(f"{self.path.stem}.stale-{time.strftime('%Y%m%dT%H%M%S')}{self.path.suffix}")
            self.path.rename(aside)
            print(f"journal: --fresh: moved {self.path} aside to {aside.name}", file=sys.stderr, flush=True)
        self._fh = open(self.path, "ab+")
        try:
            import fcntl

            # a POSIX record lock: held by this process only (pool workers forked later share the file but not
            # the lock, so a sweep's lingering workers never block the next one)
            fcntl.lockf(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._fh.close()
            raise SystemExit(
                f"journal {self.path} is in use by another process (the same preset running "
                f"twice?): wait for it, or pass --journal PATH"
            ) from None
        except ImportError:  # no fcntl (Windows): no lock
            pass
        self._load()
        if self._fh.tell() == 0:
            self._write({"journal": 1, **(label or {}), "hash": self.digest, "params": self.params})

    def _load(self) -> None:
        self._fh.seek(0)
        data = self._fh.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):  # the last write was cut short: drop it, so that the next line starts clean
            _warn(f"{self.path}: ignoring a truncated last line ({len(data) - end} bytes, a run killed mid-write)")
            self._fh.truncate(end)
            data = data[:end]
        for n, raw in enumerate(data.splitlines(), 1):
            try:
                line = json.loads(raw)
                if "journal" in line:
                    if line.get("hash") != self.digest:
                        raise SystemExit(
                            f"journal {self.path} was written for other settings (hash "
                            f"{line.get('hash')}, now {self.digest}): pass --fresh or another path"
                        )
                    continue
                key = (str(line["method"]), float(line["value"]), int(line["seed"]))
                entry = {"metrics": line["metrics"], "cpu": float(line["cpu"]), "wall": float(line["wall"])}
            except (ValueError, KeyError, TypeError) as exc:
                _warn(f"{self.path}:{n}: ignoring an unreadable line ({exc})")
                continue
            self.entries.setdefault(key, entry)
        self._fh.seek(0, os.SEEK_END)

    def _write(self, obj: dict[str, Any] | str) -> None:
        self._fh.write(((obj if isinstance(obj, str) else json.dumps(obj)) + "\n").encode())
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def get(self, method: str, value: float, seed: int) -> dict[str, Any] | None:
        """The recorded run ``{"metrics", "cpu", "wall"}``, or None."""
        return self.entries.get((method, float(value), int(seed)))

    def record(self, method: str, value: float, seed: int, metrics: dict[str, Any], cpu: float, wall: float) -> None:
        """Keep one finished run (and append it to the file, durably, before returning)."""
        line = {
            "method": method,
            "value": float(value),
            "seed": int(seed),
            "metrics": metrics,
            "cpu": cpu,
            "wall": wall,
        }
        if self._fh is not None:
            try:
                text = json.dumps(line)
            except TypeError as exc:
                raise TypeError(f"{method} {value:g} seed {seed}: the run's metrics are not JSON ({exc})") from None
            if not _same(json.loads(text)["metrics"], metrics):  # a resumed table must be the same table
                raise TypeError(
                    f"{method} {value:g} seed {seed}: the run's metrics do not survive JSON "
                    "(tuples, non-string keys, numpy scalars?): return plain dicts, lists, floats"
                )
            self._write(text)
        self.entries[(method, float(value), int(seed))] = {"metrics": metrics, "cpu": cpu, "wall": wall}

    def summary(self) -> str:
        """One line: runs used, how many came from the journal, and their CPU and wall seconds."""
        where = f" (journal {self.path})" if self.path else ""
        return (
            f"runs: {self.ran + self.reused}, {self.reused} reused from the journal{where}; CPU of the runs "
            f"{self.cpu:,.0f} s, {self.cpu / max(1, self.ran + self.reused):,.0f} s per run"
        )

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def settings_hash(params: dict[str, Any]) -> str:
    """12 hex digits identifying ``params`` (key order does not matter)."""
    text = json.dumps(params, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_device(ap: argparse.ArgumentParser, device: str | None) -> None:
    """Refuse ``--device`` this machine cannot serve (``cuda`` without a GPU) before any run starts: one line
    and exit 2, not a traceback from every worker of the sweep."""
    if device:
        from protocols.config import ConfigError
        from protocols.torch_trainer import pick_device

        try:
            pick_device(device)
        except ConfigError as exc:
            ap.error(f"--device {device}: {exc}")


def add_journal_args(ap: argparse.ArgumentParser) -> None:
    """``--journal PATH`` and ``--fresh`` for a benchmark script."""
    ap.add_argument(
        "--journal",
        help=f"journal of finished runs (default: {RESULTS.name}/<script>-<preset>-"
        "<settings hash>.jsonl beside this script); a rerun of the same command reuses its runs",
    )
    ap.add_argument("--fresh", action="store_true", help="ignore (move aside) the journal and run everything again")


def open_journal(args: argparse.Namespace, script: str, preset: str, params: dict[str, Any]) -> Journal:
    """The journal of ``script`` at ``preset`` for the settings ``params``: everything that changes a run's result
    beyond its (method, grid value, seed), so that a line is reused only for the very same run (a wider grid or
    more seeds reuse the runs already done; another dataset, model or round count starts another file)."""
    label = {"script": Path(script).stem, "preset": preset}
    path = args.journal or RESULTS / f"{label['script']}-{preset}-{settings_hash({**label, 'params': params})}.jsonl"
    return Journal(path, params, fresh=args.fresh, label=label)


# ------------------------------------------------------------------------------------------ sweep
def _init_worker() -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's sweep handler: terminate() ends a worker

    # single-threaded torch without importing it here (~2 s of CPU per worker, for runs that may not use it):
    # torch takes its thread count from these when it is first imported
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # already imported (not by a fresh spawned worker): set it directly
        sys.modules["torch"].set_num_threads(1)


def _timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, float, float]:
    """``fn(*args, **kwargs)`` in a worker, with its CPU and wall seconds."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.process_time() - c0, time.perf_counter() - t0


class SweepSignal(KeyboardInterrupt):
    """SIGTERM stopping a sweep, as Ctrl-C does; ``signum`` sets the script's exit status (128 + it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _stop_on_sigterm() -> Callable[[], None]:
    """Until the returned function is called, SIGTERM (``timeout``, ``kill``) stops a sweep as Ctrl-C does."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum: int, frame: Any) -> None:
        raise SweepSignal(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    return lambda: signal.signal(signal.SIGTERM, previous)


def middle_out(n: int) -> list[int]:
    """Grid positions from the middle outwards (an interrupted sweep has the central values of every method)."""
    return sorted(range(n), key=lambda i: (abs(i - (n - 1) / 2), i))


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def sweep(
    run: Callable[..., dict[str, Any]],
    grids: dict[str, Sequence[float]],
    seeds: Sequence[int],
    jobs: int,
    progress: bool = True,
    journal: Journal | None = None,
    order: Callable[[int], Iterable[int]] = middle_out,
    prepare: Callable[..., Any] | None = None,
    **common: Any,
) -> dict[str, list[Cell]]:
    """``run(method, value, seed, **common)`` for every method, grid value and seed; cells per method.

    Runs go interleaved (grid position in ``order`` of the longest grid, then seed, then method). Runs found
    in ``journal`` are not run again; every new one is recorded there as it ends. ``prepare(seed, **common)``,
    if given, runs once per seed that still has runs to do, and its result goes to ``run`` as ``prepared=``.
    The cells list each grid value's runs in that fixed order, whether they ran now or came from the journal.
    """
    journal = journal if journal is not None else Journal(None)
    cells = {m: [Cell(m, v) for v in grid] for m, grid in grids.items()}
    longest = max(len(g) for g in grids.values())
    tasks = [(m, i, s) for i in order(longest) for s in seeds for m, grid in grids.items() if i < len(grid)]
    results: dict[tuple[str, int, int], dict[str, Any]] = {}
    pending = []
    for m, i, s in tasks:
        entry = journal.get(m, cells[m][i].value, s)
        if entry is None:
            pending.append((m, i, s))
        else:
            results[(m, i, s)] = entry["metrics"]
            journal.reused += 1
            journal.cpu += entry["cpu"]
            journal.wall += entry["wall"]
    reused = len(tasks) - len(pending)
    cpu_known = [journal.get(m, cells[m][i].value, s)["cpu"] for (m, i, s) in results]
    t0 = time.perf_counter()
    workers = max(1, min(jobs, len(pending) or 1))

    def eta(cpus: list[float], left: int) -> str:
        if not cpus or not left:
            return ""
        return f", ETA {_minutes(left * sum(cpus) / len(cpus) / min(workers, left))} on {workers} idle cores"

    if progress:
        where = f" (journal {journal.path})" if journal.path else ""
        print(
            f"sweep: {len(tasks)} runs, {reused} reused{where}, {len(pending)} to run on {workers} workers"
            f"{eta(cpu_known, len(pending))}",
            file=sys.stderr,
            flush=True,
        )
    if pending:
        # spawned, not forked: a worker forked after the parent touched CUDA cannot use it (CUDA initialization error)
        pool = ProcessPoolExecutor(max_workers=workers, initializer=_init_worker, mp_context=mp.get_context("spawn"))
        stop = _stop_on_sigterm()
        try:
            prepared: dict[int, Any] = {}
            if prepare is not None:
                need = sorted({s for _, _, s in pending})
                for s, f in [(s, pool.submit(_timed, prepare, s, **common)) for s in need]:
                    prepared[s], cpu, wall = f.result()
                    if progress:
                        print(f"  prepared seed {s} ({cpu:.0f} s CPU, {wall:.0f} s wall)", file=sys.stderr, flush=True)
            extra = (lambda s: {"prepared": prepared[s]}) if prepare is not None else (lambda s: {})
            futures: dict[Future, tuple[str, int, int]] = {
                pool.submit(_timed, run, m, cells[m][i].value, s, **common, **extra(s)): (m, i, s)
                for m, i, s in pending
            }
            error: BaseException | None = None
            left = set(futures)
            while left:
                finished, left = wait(left, return_when=FIRST_COMPLETED)
                for f in finished:
                    m, i, s = futures[f]
                    if f.cancelled():
                        continue
                    if f.exception() is not None:  # keep what the other workers finish, then re-raise
                        if error is None:
                            error = f.exception()
                            for g in left:
                                g.cancel()
                        continue
                    metrics, cpu, wall = f.result()
                    journal.record(m, cells[m][i].value, s, metrics, cpu, wall)
                    journal.ran += 1
                    journal.cpu += cpu
                    journal.wall += wall
                    cpu_known.append(cpu)
                    results[(m, i, s)] = metrics
                    if progress:  # every run's figures as it completes: partial sweeps stay usable
                        brief = {
                            k: (round(v, 4) if isinstance(v, float) else v)
                            for k, v in metrics.items()
                            if not isinstance(v, (list, dict))
                        }
                        print(
                            f"  [{len(results)}/{len(tasks)} runs, {_minutes(time.perf_counter() - t0)}"
                            f"{eta(cpu_known, len(tasks) - len(results))}] {m} "
                            f"{cells[m][i].value:g} seed {s}: {brief} ({cpu:.0f} s CPU, {wall:.0f} s wall)",
                            file=sys.stderr,
                            flush=True,
                        )
            if error is not None:
                raise error
        except BaseException as exc:  # Ctrl-C, SIGTERM or a failed run: the finished runs are journaled
            if not isinstance(exc, Exception):  # stopped from outside: the workers' runs in progress stop too
                for proc in list(getattr(pool, "_processes", {}).values()):
                    proc.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            if progress:
                print(
                    f"sweep stopped: {len(results)} of {len(tasks)} runs done"
                    + (f" and kept in {journal.path}; the same command resumes" if journal.path else ""),
                    file=sys.stderr,
                    flush=True,
                )
            if isinstance(exc, KeyboardInterrupt):  # stopped by its user: that line says it all, not a traceback
                raise SystemExit(128 + getattr(exc, "signum", 2)) from None
            raise
        finally:
            stop()
        pool.shutdown()
    for m, i, s in tasks:
        cells[m][i].runs.append(results[(m, i, s)])
    return cells


def tune(
    run: Callable[..., dict[str, Any]],
    grids: dict[str, Sequence[float]],
    tune_seeds: Sequence[int],
    seeds: Sequence[int],
    jobs: int,
    key: str,
    lower_is_better: bool,
    journal: Journal | None = None,
    **common: Any,
) -> tuple[dict[str, list[Cell]], dict[str, Winner]]:
    """The grids on ``tune_seeds``, each method's winner by the seed mean of ``key``, then every winner on the
    ``seeds`` not tuned on (each method the same runs). Returns the tuning cells and the winners, whose cells
    hold the runs of every seed (the tuning seeds' first)."""
    cells = sweep(run, grids, tune_seeds, jobs, journal=journal, **common)
    winners = pick(cells, key, lower_is_better)
    rest = [x for x in seeds if x not in tune_seeds]
    if rest:
        more = sweep(run, {m: [w.cell.value] for m, w in winners.items()}, rest, jobs, journal=journal, **common)
        for m, w in winners.items():
            w.cell = Cell(m, w.cell.value, w.cell.runs + more[m][0].runs)
    return cells, winners


def cost_line(
    grids: dict[str, Sequence[float]],
    tune_seeds: Sequence[int],
    seeds: Sequence[int],
    cpu_per_run: dict[str, float],
    jobs: int,
) -> str:
    """The estimated cost of :func:`tune`: its runs x each method's measured CPU seconds per run."""
    rest = [x for x in seeds if x not in tune_seeds]
    runs = {m: len(g) * len(tune_seeds) + len(rest) for m, g in grids.items()}
    cpu = sum(n * cpu_per_run[m] for m, n in runs.items())
    return (
        f"estimated cost: {sum(runs.values())} runs x ~{cpu / max(1, sum(runs.values())):.0f} CPU-s (measured per "
        f"method) = ~{cpu:,.0f} CPU-s, ~{cpu / max(1, jobs) / 60:.0f} min on {jobs} idle cores"
    )


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
