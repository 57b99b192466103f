"""FedMRN (Li et al., ACM MM 2024) at its Fashion-MNIST settings, against FedAvg and two 1-bit SignSGD baselines.

Through ``fedtier sim`` (paper preset: the per-device engine, see below; quick: the cohort engine): one cell of
100 devices, 10 a round (uniform), Dirichlet 0.3,
10 local epochs of batch 64, plain SGD, CNN4 (4 x [conv3x3 -> GroupNorm -> ReLU -> maxpool] -> linear; the
paper's batch norm replaced by GroupNorm, which keeps no running statistics and so federates by plain
averaging), weights ~ N(0, 0.01^2), FedMRN noise U[-0.01, 0.01] (binary masks) and U[-0.005, 0.005]
(FedMRN-S, signed masks). Baselines: FedAvg (dense float32 uplink), SignSGD (stochastic binarization, the
paper's: R = max|x| per tensor, unbiased) and SignSGD with majority vote (Bernstein et al. 2019: devices
send sign bits plus mean|x| per tensor, the cell takes the per-coordinate majority). Every method gets the
same tuning effort on the tuning seeds (quick: the paper's grid {1, 0.3, 0.1, 0.03, 0.01} for all; paper: 3
values x3 apart per method, around the paper's code's lr and the quick preset's winner); the winner (best
mean of the best-round accuracy, the paper's metric) then runs on the remaining seeds. The paper preset prints its
estimated cost first (runs x measured CPU-s per run); with a journal (benchmarks/tuning.py) a killed run resumes.

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

from benchmarks.tuning import add_journal_args, check_device, cost_line, edge_note, grid_line, open_journal, tune  # noqa: E402

# CPU-s of one 100-round paper run, per method: measured before the epoch fix (benchmarks/README.md, FedMRN, Cost),
# times 1,420 / 987, the steps 10 full epochs take on the preset's partition over those the old count ran
CPU_PER_PAPER_RUN = {"FedAvg": 330.0, "FedMRN": 352.0, "FedMRN-S": 352.0, "SignSGD": 330.0, "SignSGD-MV": 330.0}
# what a journal line's run means beyond its settings: bumped when the code's meaning of a setting changes
# (2: ``local_epochs`` = E full passes over a device's data; version 1 ran ceil(E * n / batch) steps, fewer)
RUN_SEMANTICS = {"local_epochs": 2}
PRESETS: dict[str, dict[str, Any]] = {
    # the paper: 60k train / 10k test, channels 32-64-128-256, 100 rounds, 5 seeds, lr grid {1, .3, .1, .03, .01}.
    # Here (to fit 2 h on 2 cores): a 6k / 2k subsample, channels 16-32-64-128, the lr tuned on seed 0 only, 4 values
    # x~3 apart per method spanning the paper's code's lr (FedAvg 0.03, FedMRN and FedMRN-S 0.1) and the quick
    # preset's winner (FedAvg, FedMRN 0.3; FedMRN-S 1.0; SignSGD 0.1; SignSGD-MV 1.0, the top of the paper's grid,
    # hence 3.0), then the winners on seeds 1-3 (4 seeds, the paper's 5 would cost 95 min). The per-device engine:
    # on this model the cohort engine costs more
    # CPU (FedAvg 1.4x since finished devices drop out of the cohort's steps, FedMRN 1.5x; measured, README).
    "paper": {
        "devices": 100,
        "per_round": 10,
        "max_train": 6000,
        "max_test": 2000,
        "channels": [16, 32, 64, 128],
        "rounds": 100,
        "epochs": 10,
        "engine": "device",
        # widened down where seed 0's winner sat at the low edge (FedAvg 0.01, SignSGD 0.01, SignSGD-MV 0.1 then 0.03)
        "grids": {
            "FedAvg": [0.003, 0.01, 0.03, 0.1, 0.3],
            "FedMRN": [0.03, 0.1, 0.3, 1.0],
            "FedMRN-S": [0.03, 0.1, 0.3, 1.0],
            "SignSGD": [0.003, 0.01, 0.03, 0.1, 0.3],
            "SignSGD-MV": [0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
        },
        "tune_seeds": [0],
        "seeds": [0, 1, 2, 3],
        "cpu_per_run": CPU_PER_PAPER_RUN,
    },
    "quick": {
        "devices": 100,
        "per_round": 10,
        "max_train": 3000,
        "max_test": 1000,
        "channels": [8, 8, 16, 16],
        "rounds": 20,
        "epochs": 5,
        "grid": [0.01, 0.03, 0.1, 0.3, 1.0],
        "tune_seeds": [0, 1],
        "seeds": [0, 1, 2],
        "cpu_per_run": dict.fromkeys(("FedAvg", "FedMRN", "FedMRN-S", "SignSGD", "SignSGD-MV"), 10.0),
    },
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
        "algorithm": {
            **METHODS[method],
            "lr": lr,
            "edge_rounds": 1,
            "local_steps": 0,
            "local_epochs": s["epochs"],
            "batch_size": 64,
        },
        "model": {"name": "cnn4", "channels": s["channels"], "init_std": 0.01},
        "data": {
            "dataset": "fmnist",
            "partition": "dirichlet",
            "alpha": 0.3,
            "max_train": s["max_train"],
            "max_test": s["max_test"],
        },
        "participation": {"model": "uniform", "per_round": s["per_round"]},
        "runtime": {"engine": s.get("engine", "cohort"), "eval_every": 1, "device": s.get("device", "cpu")},
    }


def run(method: str, lr: float, seed: int, settings: dict[str, Any]) -> dict[str, Any]:
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    t0 = time.perf_counter()
    result = run_simulation(parse_config(config(method, lr, seed, settings)), write_output=False)
    accs = [
        r["accuracy"] if math.isfinite(r.get("accuracy", math.nan)) else 0.0 for r in result.history if "accuracy" in r
    ]
    device_rounds = sum(len(r["answered"]) for r in result.cell_records)
    up = result.history[-1]["cumulative_bytes"]["device_to_cell"]
    n = sum(v.size for v in result.params.values())
    return {
        "best": max(accs),
        "final": accs[-1],
        "bpp": 8 * up / max(1, device_rounds) / n,
        "params": n,
        "s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="quick")
    ap.add_argument("--methods", help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--tune-seeds", help="comma-separated seeds of the lr grid (default: the preset's)")
    ap.add_argument("--seeds", help="comma-separated seeds of the winners (default: the preset's)")
    ap.add_argument("--rounds", type=int, help="rounds per run (default: the preset's; fewer: a cost probe)")
    ap.add_argument("--engine", choices=["device", "cohort"], help="runtime.engine (default: the preset's)")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda", "auto"],
        help="runtime.device (default cpu); with cuda, the --jobs runs share the one GPU",
    )
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each single-threaded)")
    add_journal_args(ap)
    args = ap.parse_args()
    check_device(ap, args.device)
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    s = dict(PRESETS[args.preset])
    for key in ("tune_seeds", "seeds"):
        if getattr(args, key):
            s[key] = [int(x) for x in getattr(args, key).split(",")]
    for key in ("rounds", "engine", "device"):
        if getattr(args, key):
            s[key] = getattr(args, key)
    methods = [m for m in METHODS if not args.methods or m in args.methods.split(",")]
    grids = {m: s.get("grids", {}).get(m, s.get("grid")) for m in methods}
    scale = s["rounds"] / PRESETS[args.preset]["rounds"]
    print(
        f"FedMRN preset {args.preset}: "
        + cost_line(grids, s["tune_seeds"], s["seeds"], {m: c * scale for m, c in s["cpu_per_run"].items()}, args.jobs),
        flush=True,
    )
    journal = open_journal(
        args,
        __file__,
        args.preset,
        {  # what changes a run beyond its (method, lr, seed)
            "settings": {
                k: v for k, v in s.items() if k not in ("grid", "grids", "tune_seeds", "seeds", "cpu_per_run")
            },
            "methods": METHODS,
            "semantics": RUN_SEMANTICS,
        },
    )
    t0 = time.perf_counter()
    cells, winners = tune(
        run, grids, s["tune_seeds"], s["seeds"], args.jobs, "best", lower_is_better=False, journal=journal, settings=s
    )
    wall = time.perf_counter() - t0
    journal.close()
    params = next(iter(cells.values()))[0].runs[0]["params"]
    print(
        f"\nFedMRN preset {args.preset}: Fashion-MNIST ({s['max_train']} train / {s['max_test']} test), "
        f"{s['devices']} devices, {s['per_round']} a round, Dirichlet 0.3, CNN4-GroupNorm {s['channels']} "
        f"({params:,} params), N(0, 0.01) init, {s['epochs']} local epochs, batch 64, {s['rounds']} rounds; "
        f"{s.get('engine', 'cohort')} engine; lr grids {grids} on seeds {s['tune_seeds']}, winners on seeds "
        f"{s['seeds']}; wall {wall:.0f} s ({args.jobs} jobs); {journal.summary()}"
    )
    print("\ntuning (mean best-round accuracy on the tuning seeds; lr: value):")
    for m, row in cells.items():
        print(f"  {m:<11} " + grid_line(row, "best", lambda v: f"{100 * v:.2f}"))
    print(f"\n{'method':<11}{'lr':>6}{'best acc %':>16}{'final acc %':>16}{'uplink bits/param':>19}   best per seed")
    for m, w in winners.items():
        c = w.cell
        print(
            f"{m:<11}{c.value:>6g}{100 * c.mean('best'):>10.2f} ±{100 * c.std('best'):>4.2f}"
            f"{100 * c.mean('final'):>10.2f} ±{100 * c.std('final'):>4.2f}{c.mean('bpp'):>19.3f}   "
            + " ".join(f"{100 * r['best']:.2f}" for r in c.runs)
            + edge_note(w)
        )


if __name__ == "__main__":
    main()
