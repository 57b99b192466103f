"""DeComFL (Li et al., ICLR 2025) vs FedAvg at the paper's MNIST settings: bytes per device to a target accuracy.

Both run through ``fedtier sim`` with the cohort engine: 2 cells x (M/2) devices, one edge round per cloud
round, 10 % of the devices a round (uniform), Dirichlet alpha = 1 across devices, SGD with momentum 0.5 for
every method (the paper's, its momentum state replayed by DeComFL devices that missed rounds), and the
CNN of the paper's repository (conv5x5 16 -> pool -> conv5x5 32 -> pool -> linear; 28,938 parameters on
MNIST). Baselines: FedAvg with 20 local steps and FedAvg with 1 local step. Every method gets the same
learning-rate grid width (4 values, x~3 apart) on the same tuning seeds (quick: all 3; paper: seed 0); the winner
per method is the lr with the fewest bytes to the target (a seed that misses it counts as infinite), flagged when
it sits at a grid edge, and then runs on the remaining seeds (paper: 1-4). The estimated cost is printed first.
Bytes are whole messages as the runtimes count them (envelope, metadata, data), cell <-> device, both
directions, averaged over all M devices.

    python benchmarks/decomfl.py --preset quick    # digits, 50 devices: <= 15 min on 2 idle cores
    python benchmarks/decomfl.py --preset paper    # MNIST, 100 devices: see benchmarks/README.md
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tuning import add_journal_args, check_device, cost_line, edge_note, grid_line, open_journal, tune  # noqa: E402

# CPU-s of one paper-preset run, per method (measured: benchmarks/README.md, DeComFL, Cost)
CPU_PER_PAPER_RUN = {"DeComFL": 700.0, "FedAvg K=20": 130.0, "FedAvg K=1": 95.0}
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {
        "dataset": "digits",
        "devices": 50,
        "per_round": 5,
        "max_train": 0,
        "max_test": 0,
        "batch": 32,
        "zo_rounds": 1000,
        "fo_rounds": 30,
        "k1_rounds": 150,
        "targets": [0.6, 0.7, 0.8],
        "headline": 0.7,
        "P": 10,
        "seeds": [0, 1, 2],
        "tune_seeds": [0, 1, 2],
        "zo_evals": 50,
        "cpu_per_run": {"DeComFL": 35.0, "FedAvg K=20": 3.0, "FedAvg K=1": 7.0},
    },
    # the paper: ~10k rounds; here 1,000 DeComFL rounds and (to fit 2 h on 2 cores: a DeComFL round costs ~0.7 CPU-s)
    # every grid on seed 0 only, then the winners on seeds 1-4
    "paper": {
        "dataset": "mnist",
        "devices": 100,
        "per_round": 10,
        "max_train": 0,
        "max_test": 2000,
        "batch": 32,
        "zo_rounds": 1000,
        "fo_rounds": 50,
        "k1_rounds": 300,
        "targets": [0.80, 0.85, 0.90],
        "headline": 0.85,
        "P": 10,
        "seeds": [0, 1, 2, 3, 4],
        "tune_seeds": [0],
        "zo_evals": 50,
        "cpu_per_run": CPU_PER_PAPER_RUN,
    },
}
GRIDS = {  # the same width for every method: 4 values x~3 apart around the paper's (DeComFL 1e-3, FedAvg 0.1), widened
    # until no winner sits at an edge (quick: DeComFL peaked at 1e-2 and diverged at 3e-2; FedAvg K=20 peaked at 0.3)
    "quick": {
        "DeComFL": [1e-3, 3e-3, 1e-2, 3e-2],
        "FedAvg K=20": [0.03, 0.1, 0.3, 1.0],
        "FedAvg K=1": [0.03, 0.1, 0.3, 1.0],
    },
    # paper: shifted down one step for DeComFL after MNIST seed 0 diverged at 3e-3, 1e-2 and 3e-2 (1e-3 at the edge)
    "paper": {
        "DeComFL": [3e-4, 1e-3, 3e-3, 1e-2],
        "FedAvg K=20": [0.03, 0.1, 0.3, 1.0],
        "FedAvg K=1": [0.03, 0.1, 0.3, 1.0],
    },
}


def config(method: str, lr: float, seed: int, s: dict[str, Any]) -> dict[str, Any]:
    if method == "DeComFL":
        alg = {"name": "decomfl", "local_steps": 1, "perturbations": s["P"], "mu": 1e-3, "direction": "gaussian"}
        rounds, every = s["zo_rounds"], max(1, s["zo_rounds"] // s["zo_evals"])
    else:
        alg = {"name": "fedavg", "local_steps": 20 if method == "FedAvg K=20" else 1}
        rounds, every = (s["fo_rounds"], 1) if method == "FedAvg K=20" else (s["k1_rounds"], 2)
    return {
        "run": {"name": "bench-decomfl", "seed": seed, "rounds": rounds},
        "topology": {"cells": 2, "devices_per_cell": s["devices"] // 2},
        "algorithm": {**alg, "lr": lr, "momentum": 0.5, "batch_size": s["batch"], "edge_rounds": 1},
        "model": {"name": "cnn", "channels": [16, 32], "fc": 0},
        "data": {
            "dataset": s["dataset"],
            "partition": "dirichlet",
            "alpha": 1.0,
            "max_train": s["max_train"],
            "max_test": s["max_test"],
        },
        "participation": {"model": "uniform", "per_round": s["per_round"]},
        "runtime": {
            "engine": "cohort",
            "eval_every": every,
            "device": s.get("device", "cpu"),
            "direction_threads": s.get("direction_threads", 1),
            "cell_processes": s.get("cell_processes", 0),
        },
    }


KERNEL = [0.0, 0.0]  # wall s, CPU s this process spent inside the forward passes (see RoundSplit)


def _time_kernels() -> None:
    """Count the time inside the forward passes in :data:`KERNEL` (once per process): the cohort engine's
    batched forwards and the cloud's evaluation; on a GPU each is timed to its end (the queue drained)."""
    import functools

    import torch

    import protocols.cohort_trainer as engine
    import protocols.torch_trainer as device

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t, c = time.perf_counter(), time.process_time()
            out = fn(*args, **kwargs)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            KERNEL[0] += time.perf_counter() - t
            KERNEL[1] += time.process_time() - c
            return out

        return wrapper

    if not hasattr(engine.batched_forward, "__wrapped__"):
        engine.batched_forward = timed(engine.batched_forward)
        device.TorchTrainer.evaluate = timed(device.TorchTrainer.evaluate)  # type: ignore[method-assign]


def descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (``runtime.cell_processes``: its fork server and the cell processes forked from
    it), from /proc (none where it cannot tell)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [
                int(k) for t in os.listdir(f"/proc/{p}/task") for k in _read(f"/proc/{p}/task/{t}/children").split()
            ]
        except (OSError, ValueError):
            continue
        out += kids
        todo += kids
    return out


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _cpu(pid: int, tid: int | None = None) -> float:
    """CPU seconds of process ``pid`` (or of its thread ``tid``) from /proc; 0 once it is gone."""
    try:
        stat = _read(f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat")
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0.0


SAMPLE_EVERY = 20
"""RoundSplit reads the cell processes' CPU at every 20th round's end."""


class RoundSplit:
    """Where a run's rounds go, in ms a round: wall, CPU, **kernel** (inside the forward passes, which a GPU
    makes cheap) and **host** (the rest: histories, replay, probes, momentum steps, messages, records; what a GPU
    cannot speed up), this process's; its main thread's CPU (``main_cpu_ms``: without the threads that draw
    directions ahead). With cell processes, their CPU (``cells_cpu_ms``, their forwards not timed apart) and the
    busiest one's main thread's (``cell_main_cpu_ms``): on free cores a round takes about ``main_cpu_ms`` +
    ``cell_main_cpu_ms`` (the cloud, then the cells, in turn). Timed from the end of the first round to the end of
    the last (setup excluded)."""

    def __init__(self) -> None:
        _time_kernels()
        self.marks: list[tuple[float, ...]] = []  # (wall, CPU, kernel wall, kernel CPU, main thread CPU) a round end
        self.pids: list[int] = []  # the processes under this one (looked for again now and then: cheap reads)
        self.cells: list[tuple[int, dict[int, tuple[float, float]]]] = []  # (a mark, pid -> its CPU, its main
        # thread's), every SAMPLE_EVERY marks

    def mark(self, _record: Any = None) -> None:
        self.marks.append((time.perf_counter(), time.process_time(), KERNEL[0], KERNEL[1], time.thread_time()))
        at = len(self.marks) - 1
        if at % SAMPLE_EVERY == 0:  # (every round, the reads would cost the main process ~0.4 ms a round)
            if at % (5 * SAMPLE_EVERY) == 0:
                self.pids = descendants(os.getpid())
            self.cells.append((at, {p: (_cpu(p), _cpu(p, p)) for p in self.pids}))

    def figures(self) -> dict[str, float]:
        """``round_ms``, ``kernel_ms`` and ``host_ms`` a round (wall), and the same as CPU ms (``cpu_ms``, ...),
        ``main_cpu_ms``, ``cells_cpu_ms`` and ``cell_main_cpu_ms`` (see the class)."""
        if len(self.marks) < 2:
            return {}
        (w0, c0, k0, kc0, t0), (w1, c1, k1, kc1, t1) = self.marks[0], self.marks[-1]
        (a, first), (b, last) = self.cells[0], self.cells[-1]  # (the cell processes: between samples)
        both = [p for p in last if p in first]
        n = len(self.marks) - 1
        ms = lambda v, rounds=n: round(1e3 * v / max(1, rounds), 2)  # noqa: E731
        return {
            "round_ms": ms(w1 - w0),
            "cpu_ms": ms(c1 - c0),
            "kernel_ms": ms(k1 - k0),
            "host_ms": ms((w1 - w0) - (k1 - k0)),
            "kernel_cpu_ms": ms(kc1 - kc0),
            "host_cpu_ms": ms((c1 - c0) - (kc1 - kc0)),
            "main_cpu_ms": ms(t1 - t0),
            "cells_cpu_ms": ms(sum(last[p][0] - first[p][0] for p in both), b - a),
            "cell_main_cpu_ms": ms(max((last[p][1] - first[p][1] for p in both), default=0.0), b - a),
        }


def run(method: str, lr: float, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One run: accuracy curve against mean bytes per device, the bytes to each target, and where a round's
    time goes (:class:`RoundSplit`)."""
    from protocols.config import ConfigError, parse_config
    from sim.launcher import run_simulation

    if settings.get("host_only"):  # (before RoundSplit wraps the forwards in its timers)
        import benchmarks.host_only as stand_in

        stand_in.reach_cell_processes()
    t0, c0 = time.perf_counter(), time.process_time()
    split = RoundSplit()
    try:
        result = run_simulation(
            parse_config(config(method, lr, seed, settings)), write_output=False, on_round=split.mark
        )
    except ConfigError:  # a setting this machine cannot run (e.g. --device cuda without a GPU): the sweep fails
        raise
    except ValueError as exc:  # ZO divergence raises on non-finite scalars: a failed grid point, not a crash
        return {
            "best": 0.0,
            "final": 0.0,
            "params": 0,
            "s": time.perf_counter() - t0,
            "cpu": time.process_time() - c0,
            "error": str(exc),
            **{f"bytes@{t}": math.inf for t in settings["targets"]},
            **{f"round@{t}": math.inf for t in settings["targets"]},
            "score": math.inf,
        }
    n = settings["devices"]
    curve = []
    for r in result.history:
        if "accuracy" in r and math.isfinite(r["accuracy"]):
            b = r["cumulative_bytes"]
            curve.append((r["round"] + 1, r["accuracy"], (b["cell_to_device"] + b["device_to_cell"]) / n))
    out: dict[str, Any] = {
        "best": max((a for _, a, _ in curve), default=0.0),
        "final": curve[-1][1] if curve else 0.0,
        "params": sum(v.size for v in result.params.values()),
        "s": time.perf_counter() - t0,
        "cpu": time.process_time() - c0,
        "bytes_total": curve[-1][2] if curve else 0.0,
        **split.figures(),
    }
    for t in settings["targets"]:
        hit = next((b for _, a, b in curve if a >= t), math.inf)
        out[f"bytes@{t}"] = hit
        out[f"round@{t}"] = next((rnd for rnd, a, _ in curve if a >= t), math.inf)
    # tuning score: bytes to the headline target; runs that miss it rank below by their best accuracy
    out["score"] = out[f"bytes@{settings['headline']}"]
    if math.isinf(out["score"]):
        out["score"] = 1e18 * (2.0 - out["best"])
    return out


def kb(v: float) -> str:
    return "not reached" if not math.isfinite(v) or v >= 1e17 else f"{v / 1e3:,.1f} KB"


def spread_defaults(
    device: str | None, jobs: int, cell_processes: int | None, threads: int | None, cores: int | None = None
) -> tuple[int, int, str]:
    """``--cell-processes`` and ``--direction-threads`` where not given, and why in a line ("" where nothing is
    chosen): with ``--device cuda|auto`` a round is its host side (benchmarks/README.md, DeComFL, "Time a round"),
    which a run spreads over the cores its share of the machine has (``cores`` / ``jobs``): the 2 cells in
    processes of their own from 8 cores (3 processes, each drawing a round's directions ahead), and up to 4 draw
    threads a process (runtime.direction_threads: with 2 or more, drawn ahead of their use). On a CPU (the forward
    passes are the round) one process, one draw thread, as before."""
    if device not in ("cuda", "auto") or (cell_processes is not None and threads is not None):
        return cell_processes or 0, threads or 1, ""
    cores = cores or os.cpu_count() or 1
    share = max(1, cores // max(1, jobs))
    chosen = []
    if cell_processes is None:
        cell_processes = 2 if share >= 8 else 0
        chosen.append(f"{cell_processes} cell processes" if cell_processes else "one process")
    if threads is None:
        threads = min(4, share // (3 if cell_processes else 1))
        threads = threads if threads >= 2 and share >= 4 else 1  # (2 shared cores: drawing ahead costs wall time)
        chosen.append(f"direction_threads {threads}")
    why = (
        f"on {device}: {' and '.join(chosen)} by default ({share} cores a run: {cores} for {jobs} job(s) at once; "
        "--cell-processes 0 --direction-threads 1 runs as before)"
    )
    return cell_processes, threads, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="quick")
    ap.add_argument("--seeds", help="comma-separated run seeds (default: the preset's)")
    ap.add_argument(
        "--tune-seeds",
        help="comma-separated seeds of the lr grids; the winners then run on the other seeds (default: the preset's)",
    )
    ap.add_argument("--methods", help="comma-separated subset of " + ", ".join(GRIDS["quick"]))
    ap.add_argument(
        "--lrs", help="comma-separated learning rates: the grid of every method run (default: the preset's)"
    )
    ap.add_argument(
        "--rounds", type=int, help="DeComFL's rounds, the horizon (default: the preset's; the paper ran ~10,000)"
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        help="runtime.device (default cpu); with cuda, the --jobs runs share the one GPU",
    )
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each single-threaded)")
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="forward passes faked by a cheap stand-in: time the host side alone (accuracies meaningless)",
    )
    ap.add_argument(
        "--direction-threads",
        type=int,
        help="runtime.direction_threads: threads a run draws a step's P directions in, and above 1 ahead of their "
        "use (the same bits; default 1, with --device cuda|auto up to 4 where the cores allow: spread_defaults)",
    )
    ap.add_argument(
        "--cell-processes",
        type=int,
        help="runtime.cell_processes: the preset's 2 cells, with their devices, in processes of their own (the same "
        "bits; a run's host side spread over 3 processes; default 0, with --device cuda|auto 2 where the cores allow)",
    )
    add_journal_args(ap)
    args = ap.parse_args()
    check_device(ap, args.device)
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    s = dict(PRESETS[args.preset])
    if args.rounds:  # the estimate scales with the horizon; the journal's settings record it (and the device)
        s["cpu_per_run"] = {**s["cpu_per_run"], "DeComFL": s["cpu_per_run"]["DeComFL"] * args.rounds / s["zo_rounds"]}
        s["zo_rounds"] = args.rounds
    if args.device:
        s["device"] = args.device
    cell_processes, threads, why = spread_defaults(args.device, args.jobs, args.cell_processes, args.direction_threads)
    if why:
        print(why, flush=True)
    if threads != 1:  # (a setting: the journal records it)
        s["direction_threads"] = threads
    if cell_processes:  # (a setting: the journal records it)
        s["cell_processes"] = cell_processes
    if args.host_only:  # (a setting: the journal keeps these runs apart from real ones)
        s["host_only"] = True
    seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else s["seeds"]
    tune_seeds = (
        [int(x) for x in args.tune_seeds.split(",")]
        if args.tune_seeds
        else [x for x in s["tune_seeds"] if x in seeds] or seeds[:1]
    )
    grids = {m: g for m, g in GRIDS[args.preset].items() if not args.methods or m in args.methods.split(",")}
    if args.lrs:  # e.g. one run alone, timed (benchmarks/gpu_check.sh)
        grids = {m: [float(v) for v in args.lrs.split(",")] for m in grids}
    print(
        f"DeComFL preset {args.preset}: " + cost_line(grids, tune_seeds, seeds, s["cpu_per_run"], args.jobs), flush=True
    )
    journal = open_journal(
        args, __file__, args.preset, {k: v for k, v in s.items() if k not in ("seeds", "tune_seeds", "cpu_per_run")}
    )
    t0 = time.perf_counter()
    cells, winners = tune(
        run, grids, tune_seeds, seeds, args.jobs, "score", lower_is_better=True, journal=journal, settings=s
    )
    wall = time.perf_counter() - t0
    journal.close()
    head = s["headline"]
    print(
        f"\nDeComFL preset {args.preset}: {s['dataset']} ({'all' if not s['max_train'] else s['max_train']} train), "
        f"{s['devices']} devices in 2 cells, {s['per_round']} a round, Dirichlet 1, CNN "
        f"{next(iter(cells.values()))[0].runs[0]['params']:,} params, momentum 0.5, batch {s['batch']}; "
        f"DeComFL K=1 P={s['P']} mu=1e-3 gaussian, {s['zo_rounds']} rounds; FedAvg K=20 {s['fo_rounds']} rounds, K=1 "
        f"{s['k1_rounds']} rounds; "
        f"lr tuned on seeds {tune_seeds}, winners on seeds {seeds}; "
        f"wall {wall:.0f} s ({args.jobs} jobs); {journal.summary()}"
    )
    print(f"\ntuning (mean bytes per device to {head:.0%} on the tuning seeds; lr: value):")
    for m, row in cells.items():
        print(f"  {m:<12} " + grid_line(row, f"bytes@{head}", kb))
    print(
        f"\n{'method':<12}{'lr':>8}{'best acc':>10}{'final acc':>11}"
        + "".join(f"{f'KB to {t:.0%}':>16}" for t in s["targets"])
        + f"{'round to ' + format(head, '.0%'):>14}"
    )
    for m, w in winners.items():
        c = w.cell
        print(
            f"{m:<12}{c.value:>8g}{c.mean('best'):>10.4f}{c.mean('final'):>11.4f}"
            + "".join(f"{kb(c.mean(f'bytes@{t}')):>16}" for t in s["targets"])
            + f"{c.mean(f'round@{head}'):>14.0f}{edge_note(w)}"
        )
    zo = winners.get("DeComFL")
    for m in ("FedAvg K=20", "FedAvg K=1"):
        if zo and m in winners:
            for t in s["targets"]:
                a, b = zo.cell.mean(f"bytes@{t}"), winners[m].cell.mean(f"bytes@{t}")
                ratio = f"{b / a:.1f}x fewer bytes for DeComFL" if math.isfinite(a) and math.isfinite(b) else "-"
                print(f"  to {t:.0%}: {m} (tuned) / DeComFL (tuned): {ratio}")
    per_seed = {m: [round(r["best"], 4) for r in w.cell.runs] for m, w in winners.items()}
    print(f"best accuracy per seed at the winning lr: {per_seed}")
    for m, row in cells.items():  # where a round goes, over this method's tuning runs (the journal's too)
        timed = [r for c in row for r in c.runs if "round_ms" in r]
        if timed:
            keys = ("round_ms", "cpu_ms", "kernel_ms", "kernel_cpu_ms", "host_ms", "host_cpu_ms", "main_cpu_ms")
            keys += ("cells_cpu_ms", "cell_main_cpu_ms")
            mean = {k: sum(r.get(k, 0.0) for r in timed) / len(timed) for k in keys}
            tree, path = mean["cpu_ms"] + mean["cells_cpu_ms"], mean["main_cpu_ms"] + mean["cell_main_cpu_ms"]
            split = (
                f"; cell processes' CPU {mean['cells_cpu_ms']:.1f}, the tree's {tree:.1f}; the main threads in turn "
                f"{path:.1f} (this one {mean['main_cpu_ms']:.1f} + the busiest cell process's "
                f"{mean['cell_main_cpu_ms']:.1f})"
                if mean["cells_cpu_ms"]
                else f"; its main thread {mean['main_cpu_ms']:.1f}"
            )
            print(
                f"{m}: host ms a round {mean['host_ms']:.1f} / kernel ms a round {mean['kernel_ms']:.1f} (wall; "
                f"CPU: host {mean['host_cpu_ms']:.1f} / kernel {mean['kernel_cpu_ms']:.1f}; a round "
                f"{mean['round_ms']:.1f} wall, {mean['cpu_ms']:.1f} CPU{split}; mean of {len(timed)} runs)"
            )


if __name__ == "__main__":
    main()
