"""The cohort engine against the per-device engine for every algorithm, rounds per second.

MNIST (20,000 training samples, IID), 2 cells x 10 devices, every device in every round, MLP
784-64-10, one edge round per cloud round, batch 16; FedAvg, HIST, FedALIGN (20% priority devices,
epsilon 0.5) and FedMRN with 10 local steps, DeComFL with K = 2 steps of P = 10 perturbations.
The two engines alternate twice per algorithm and the faster run of each counts; rounds/s counts the
rounds' own time (data loading excluded); the final accuracy of both is printed (it agrees to float
rounding). ``--model cnn4``: the FedMRN paper preset's CNN4 (widths 16-32-64-128, GroupNorm) instead of the
MLP, 1 cell x 10 devices, batch 64. Usage: python benchmarks/cohort_algorithms.py [--rounds 20] [--model mlp|cnn4]
[ALGORITHM ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALGORITHMS = {
    "fedavg": {"name": "fedavg", "local_steps": 10},
    "hist": {"name": "hist", "local_steps": 10},
    "fedalign": {"name": "fedalign", "local_steps": 10, "priority_fraction": 0.2, "epsilon": 0.5},
    "fedmrn": {"name": "fedmrn", "local_steps": 10},
    "decomfl": {"name": "decomfl", "local_steps": 2, "perturbations": 10, "lr": 0.02, "mu": 1e-3},
}


def main() -> None:
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--model", choices=["mlp", "cnn4"], default="mlp")
    ap.add_argument("algorithms", nargs="*", default=list(ALGORITHMS), choices=[[], *ALGORITHMS])
    args = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    print(f"{'algorithm':10}{'device r/s':>12}{'cohort r/s':>12}{'ratio':>8}{'acc device':>12}{'acc cohort':>12}")
    for name in args.algorithms:
        best: dict[str, float] = {}
        acc: dict[str, float] = {}
        for engine in ("device", "cohort", "device", "cohort"):
            cfg = parse_config(
                {
                    "run": {"name": "cohort-algorithms", "seed": 0, "rounds": args.rounds},
                    "topology": {"cells": 2 if args.model == "mlp" else 1, "devices_per_cell": 10},
                    "algorithm": {
                        "edge_rounds": 1,
                        "batch_size": 16 if args.model == "mlp" else 64,
                        "lr": 0.05,
                        **ALGORITHMS[name],
                    },
                    "model": {"name": "mlp", "hidden": [64]}
                    if args.model == "mlp"
                    else {"name": "cnn4", "channels": [16, 32, 64, 128], "init_std": 0.01},
                    "data": {"dataset": "mnist", "partition": "iid", "max_train": 20000},
                    "runtime": {"engine": engine, "eval_every": args.rounds},
                }
            )
            result = run_simulation(cfg, write_output=False)
            rate = args.rounds / sum(r["duration_s"] for r in result.history)
            best[engine] = max(best.get(engine, 0.0), rate)
            acc[engine] = result.final_accuracy or 0.0
        print(
            f"{name:10}{best['device']:12.2f}{best['cohort']:12.2f}{best['cohort'] / best['device']:8.2f}"
            f"{acc['device']:12.4f}{acc['cohort']:12.4f}"
        )


if __name__ == "__main__":
    main()
