"""HIST vs hierarchical FedAvg: communication needed to reach a target accuracy (HIST paper, Fig. 3).

Fashion-MNIST, 12 devices with 2 label shards each (fully non-iid, 500 samples per device), N = 2, 3, 4
cells, MLP 784-300-10, plain SGD lr 0.05, batch 25, H = 20 steps (one local epoch), E = 5 edge rounds per
cloud round; same init, data split and minibatch seeds for both methods. Runs the real hierarchy in
memory (``run_simulation``): the bytes are the measured message bytes. Communication is reported as
the paper counts it: the per-device upload volume in full-model units (HIST adds E/N per round, HFedAvg
E), plus the measured bytes of all four tiers summed.

    /work/main/.venv/bin/python benchmarks/hist.py [--quick] [--seeds 1] [--targets 0.70 0.75]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import run_simulation  # noqa: E402


def config(alg: str, cells: int, rounds: int, seed: int, devices: int, dataset: str) -> dict:
    return {"run": {"name": f"bench-hist-{alg}-{cells}", "seed": seed, "rounds": rounds},
            "topology": {"cells": cells, "devices_per_cell": devices // cells},
            "algorithm": {"name": alg, "edge_rounds": 5, "local_steps": 20, "batch_size": 25, "lr": 0.05},
            "model": {"name": "mlp", "hidden": [300]},
            "data": {"dataset": dataset, "partition": "shards", "shards_per_device": 2,
                     "max_train": devices * 500, "max_test": 5000}}


def to_target(history: list[dict], target: float) -> tuple[int, float, int] | None:
    """(rounds, full-model units, bytes over all tiers) when the accuracy first reaches ``target``."""
    for i, rec in enumerate(history):
        if rec.get("accuracy", 0.0) >= target:
            return i + 1, rec["metrics"]["upload_units_total"], sum(rec["cumulative_bytes"].values())
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--cells", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--targets", type=float, nargs="+", default=[0.70, 0.75])
    ap.add_argument("--rounds", type=int, default=20, help="cloud rounds of HFedAvg; HIST gets 2x")
    ap.add_argument("--dataset", default="fmnist", choices=["fmnist", "mnist"])
    a = ap.parse_args()
    devices = 12
    rounds = 3 if a.quick else a.rounds
    seeds = 1 if a.quick else a.seeds
    t0 = time.perf_counter()
    print(f"{a.dataset}, {devices} devices x 2 label shards (non-iid), MLP 784-300-10, H=20, E=5, lr 0.05, "
          f"{seeds} seed(s); HFedAvg {rounds} rounds, HIST {2 * rounds} rounds")
    head = f"{'N':>2} {'method':<8}{'final acc':>10}"
    for t in a.targets:
        head += f"{'rounds→' + format(t, '.0%'):>12}{'units':>8}{'MB':>8}"
    print(head + "   (medians over seeds; units = per-device upload in full models)")
    summary = []
    for cells in a.cells:
        res = {}
        for alg, r in (("fedavg", rounds), ("hist", 2 * rounds)):
            runs = [run_simulation(parse_config(config(alg, cells, r, s, devices, a.dataset)), write_output=False)
                    for s in range(seeds)]
            res[alg] = runs
            line = f"{cells:>2} {'HFedAvg' if alg == 'fedavg' else 'HIST':<8}"
            line += f"{np.mean([x.final_accuracy for x in runs]):>10.4f}"
            for t in a.targets:
                hits = [to_target(x.history, t) for x in runs]
                if any(h is None for h in hits):
                    line += f"{'not reached':>28}"
                    summary.append((cells, alg, t, None))
                    continue
                rr, units, nbytes = (float(np.median([h[i] for h in hits])) for i in range(3))
                line += f"{rr:>12.1f}{units:>8.1f}{nbytes / 1e6:>8.1f}"
                summary.append((cells, alg, t, units))
            print(line, flush=True)
    print()
    for t in a.targets:
        for cells in a.cells:
            f = next(u for c, al, tt, u in summary if c == cells and al == "fedavg" and tt == t)
            h = next(u for c, al, tt, u in summary if c == cells and al == "hist" and tt == t)
            if f is None or h is None:
                verdict = "undecided (a method did not reach the target)" if h is not None or f is None else \
                    "FAILS (HIST did not reach the target)"
            else:
                verdict = f"{'HOLDS' if h < f else 'FAILS'}: HIST {h:.1f} vs HFedAvg {f:.1f} units (saves {1 - h / f:.0%})"
            print(f"target {t:.0%}, N={cells}: HIST needs less communication than HFedAvg: {verdict}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
