"""FedMRN (Li et al., ACM MM 2024) at its Fashion-MNIST settings, against FedAvg and two 1-bit SignSGD baselines.

Through ``fedtier sim`` with the cohort engine: one cell of 100 devices, 10 a round (uniform), Dirichlet 0.3,
10 local epochs of batch 64, plain SGD, CNN4 (4 x [conv3x3 -> GroupNorm -> ReLU -> maxpool] -> linear; the
paper's batch norm replaced by GroupNorm, which keeps no running statistics and so federates by plain
averaging), weights ~ N(0, 0.01^2), FedMRN noise U[-0.01, 0.01] (binary masks) and U[-0.005, 0.005]
(FedMRN-S, signed masks). Baselines: FedAvg (dense float32 uplink), SignSGD (stochastic binarization, the
paper's: R = max|x| per tensor, unbiased) and SignSGD with majority vote (Bernstein et al. 2019: devices
send sign bits plus mean|x| per tensor, the cell takes the per-coordinate majority). Every method gets the
same learning-rate grid (the paper's {1, 0.3, 0.1, 0.03, 0.01}, or the part the preset affords) on the tuning
seeds; the winner (best mean of the best-round accuracy, the paper's metric) then runs on the remaining seeds.

    python benchmarks/fedmrn.py --preset quick   # ~15 min on 2 cores
    python benchmarks/fedmrn.py --preset paper   # see benchmarks/README.md for what it scales down
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tuning import Cell, add_journal_args, edge_note, grid_line, open_journal, pick, sweep  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # the paper: 60k train / 10k test, channels 32-64-128-256, 100 rounds, 5 seeds, lr grid of 5
    "paper": {"devices": 100, "per_round": 10, "max_train": 6000, "max_test": 2000, "channels": [16, 32, 64, 128],
              "rounds": 100, "epochs": 10, "grid": [0.03, 0.1, 0.3], "tune_seeds": [0, 1], "seeds": [0, 1, 2, 3, 4]},
    "quick": {"devices": 100, "per_round": 10, "max_train": 3000, "max_test": 1000, "channels": [8, 8, 16, 16],
              "rounds": 20, "epochs": 5, "grid": [0.01, 0.03, 0.1, 0.3, 1.0], "tune_seeds": [0, 1], "seeds": [0, 1, 2]},
}
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"name": "fedavg"},
    "FedMRN": {"name": "fedmrn", "alpha": 0.01},
    "FedMRN-S": {"name": "fedmrn", "alpha": 0.005, "signed": True},
    "SignSGD": {"name": "fedavg", "uplink": "signsgd"},
    "SignSGD-MV": {"name": "fedavg", "uplink": "signsgd", "signsgd_mode": "scaled", "cell_aggregator": "majority"},
}


def config(method: str, lr: float, seed: int, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": "bench-fedmrn", "seed": seed, "rounds": s["rounds"]},
        "topology": {"cells": 1, "devices_per_cell": s["devices"]},
        "algorithm": {**METHODS[method], "lr": lr, "edge_rounds": 1, "local_steps": 0, "local_epochs": s["epochs"],
                      "batch_size": 64},
        "model": {"name": "cnn4", "channels": s["channels"], "init_std": 0.01},
        "data": {"dataset": "fmnist", "partition": "dirichlet", "alpha": 0.3, "max_train": s["max_train"],
                 "max_test": s["max_test"]},
        "participation": {"model": "uniform", "per_round": s["per_round"]},
        "runtime": {"engine": "cohort", "eval_every": 1},
    }


def run(method: str, lr: float, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    t0 = time.perf_counter()
    result = run_simulation(parse_config(config(method, lr, seed, settings)), write_output=False)
    accs = [r["accuracy"] if math.isfinite(r.get("accuracy", math.nan)) else 0.0 for r in result.history
            if "accuracy" in r]
    device_rounds = sum(len(r["answered"]) for r in result.cell_records)
    up = result.history[-1]["cumulative_bytes"]["device_to_cell"]
    n = sum(v.size for v in result.params.values())
    return {"best": max(accs), "final": accs[-1], "bpp": 8 * up / max(1, device_rounds) / n, "params": n,
            "s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="quick")
    ap.add_argument("--methods", help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--tune-seeds", help="comma-separated seeds of the lr grid (default: the preset's)")
    ap.add_argument("--seeds", help="comma-separated seeds of the winners (default: the preset's)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each single-threaded)")
    add_journal_args(ap)
    args = ap.parse_args()
    s = dict(PRESETS[args.preset])
    for key in ("tune_seeds", "seeds"):
        if getattr(args, key):
            s[key] = [int(x) for x in getattr(args, key).split(",")]
    methods = [m for m in METHODS if not args.methods or m in args.methods.split(",")]
    journal = open_journal(args, __file__, args.preset, {  # what changes a run beyond its (method, lr, seed)
        "settings": {k: v for k, v in s.items() if k not in ("grid", "tune_seeds", "seeds")}, "methods": METHODS})
    t0 = time.perf_counter()
    cells = sweep(run, {m: s["grid"] for m in methods}, s["tune_seeds"], args.jobs, journal=journal, settings=s)
    winners = pick(cells, "best", lower_is_better=False)
    rest = [x for x in s["seeds"] if x not in s["tune_seeds"]]
    if rest:  # the winners on the remaining seeds (every method the same number of runs)
        more = sweep(run, {m: [w.cell.value] for m, w in winners.items()}, rest, args.jobs, journal=journal,
                     settings=s)
        for m, w in winners.items():
            w.cell = Cell(m, w.cell.value, w.cell.runs + more[m][0].runs)
    wall = time.perf_counter() - t0
    journal.close()
    params = next(iter(cells.values()))[0].runs[0]["params"]
    print(f"\nFedMRN preset {args.preset}: Fashion-MNIST ({s['max_train']} train / {s['max_test']} test), "
          f"{s['devices']} devices, {s['per_round']} a round, Dirichlet 0.3, CNN4-GroupNorm {s['channels']} "
          f"({params:,} params), N(0, 0.01) init, {s['epochs']} local epochs, batch 64, {s['rounds']} rounds; "
          f"lr grid {s['grid']} on seeds {s['tune_seeds']}, winners on seeds {s['seeds']}; wall {wall:.0f} s "
          f"({args.jobs} jobs); {journal.summary()}")
    print("\ntuning (mean best-round accuracy on the tuning seeds; lr: value):")
    for m, row in cells.items():
        print(f"  {m:<11} " + grid_line(row, "best", lambda v: f"{100 * v:.2f}"))
    print(f"\n{'method':<11}{'lr':>6}{'best acc %':>16}{'final acc %':>16}{'uplink bits/param':>19}   best per seed")
    for m, w in winners.items():
        c = w.cell
        print(f"{m:<11}{c.value:>6g}{100 * c.mean('best'):>10.2f} ±{100 * c.std('best'):>4.2f}"
              f"{100 * c.mean('final'):>10.2f} ±{100 * c.std('final'):>4.2f}{c.mean('bpp'):>19.3f}   "
              + " ".join(f"{100 * r['best']:.2f}" for r in c.runs) + edge_note(w))


if __name__ == "__main__":
    main()
