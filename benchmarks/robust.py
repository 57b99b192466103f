"""Robust aggregation under Byzantine devices: final accuracy per cell aggregator and attacker share.

fedtier sim, digits (scikit-learn), 2 cells x 10 devices (iid), MLP 64-32-10, H = 20 local steps, lr 0.2,
batch 16, 8 cloud rounds, E = 1; ``[attack]``: in every cell floor(share x 10) devices, drawn with the seed,
send ``factor x delta`` (scale, factor 10) or ``-factor x delta`` (sign_flip, factor 4). The cloud averages
the cells (``cloud_aggregator = "mean"``); each cell uses the aggregator of the row. Same seeds, data
split and init for every cell of the table.

    .venv/bin/python benchmarks/robust.py [--quick] [--shares 0 0.1 0.2 0.3] [--seeds 1] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

AGGREGATORS = ["mean", "median", "trimmed_mean", "krum", "multikrum"]
ATTACKS = {"scale": 10.0, "sign_flip": 4.0}


def config(agg: str, kind: str, share: float, seed: int, rounds: int) -> dict:
    return {
        "run": {"name": f"bench-robust-{agg}-{kind}-{share}", "seed": seed, "rounds": rounds},
        "topology": {"cells": 2, "devices_per_cell": 10},
        "algorithm": {
            "name": "fedavg",
            "local_steps": 20,
            "batch_size": 16,
            "lr": 0.2,
            "cell_aggregator": agg,
            **({"trim_beta": 0.3} if agg == "trimmed_mean" else {}),
            **({"krum_byzantine": 0.3} if agg in ("krum", "multikrum") else {}),
        },
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"dataset": "digits", "partition": "iid"},
        "attack": {"kind": kind, "fraction": share, "factor": ATTACKS[kind]},
    }


def run_one(args: tuple[str, str, float, int, int]) -> tuple[tuple[str, str, float, int], float]:
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    agg, kind, share, seed, rounds = args
    result = run_simulation(parse_config(config(agg, kind, share, seed, rounds)), write_output=False)
    return (agg, kind, share, seed), float(result.final_accuracy or 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 rounds, shares 0 and 0.2")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    rounds, shares = (3, [0.0, 0.2]) if a.quick else (a.rounds, a.shares)
    jobs = [
        (agg, kind, share, seed, rounds)
        for kind in ATTACKS
        for agg in AGGREGATORS
        for share in shares
        for seed in range(a.seeds)
        if not (share == 0 and kind != "scale")
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        acc = dict(pool.map(run_one, jobs))
    print(
        f"digits, 2 cells x 10 devices (iid), MLP 64-32-10, H=20, lr 0.2, {rounds} rounds, {a.seeds} seed(s); "
        "trim_beta = krum_byzantine = 0.3; final accuracy (mean over seeds)"
    )
    for kind, factor in ATTACKS.items():
        print(f"\nattack {kind} (factor {factor:g}); columns: Byzantine share of each cell's devices")
        print(f"{'aggregator':<14}" + "".join(f"{s:>8.0%}" for s in shares))
        for agg in AGGREGATORS:
            row = []
            for share in shares:
                k = "scale" if share == 0 else kind
                vals = [acc[(agg, k, share, s)] for s in range(a.seeds)]
                row.append(sum(vals) / len(vals))
            print(f"{agg:<14}" + "".join(f"{v:>8.3f}" for v in row))
    print(f"\n{len(jobs)} runs in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
