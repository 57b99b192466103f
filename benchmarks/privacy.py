"""Differential privacy: final accuracy vs epsilon for local and cell-level DP (``[privacy] dp``).

fedtier sim with the cohort engine, MNIST, 10 cells x 100 devices (iid, 60 samples each), every device
taking part in a cloud round with probability q = 0.5 (``participation = bernoulli``), hierarchical FedAvg
with E = 1, H = 5 local steps, batch 16, lr 0.1, logistic regression 784-10, clip C = 0.5, 15 cloud rounds,
delta = 1e-5. For each target epsilon the accountant picks the smallest noise multiplier z that spends it
in the run's rounds (``target_epsilon``); "inf" is clipping alone (z = 0), "off" no DP at all. Who takes
part is drawn from ``run.seed`` and named in records, so nothing is amplified by the sampling (q = 1) and
every mode is accounted under replacement (2C). Modes: ``cell`` (the cell noises its devices' sum),
``cell+secagg`` (distributed DP: each device adds 1/m of the noise, secure aggregation unmasks only sums of
at least m = dp_min_survivors; ``secagg_bound`` set to clip + 6 sigma, the least the config accepts) and
``local``. For each, the epsilon the run records against the cloud, against the cell and against the
other devices ("none": no guarantee against that party).

    .venv/bin/python benchmarks/privacy.py [--quick] [--seeds 2] [--jobs 2] [--eps 1 3 8 inf]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODES = ["cell", "cell+secagg", "local"]
CLIP = 0.5


def config(mode: str, eps: float | None, seed: int, rounds: int, cells: int, per_cell: int) -> dict:
    """``eps``: a target epsilon, ``inf`` (clip only) or None (no DP)."""
    privacy: dict = {}
    if eps is not None:
        privacy = {
            "dp": mode.split("+")[0],
            "clip": CLIP,
            "delta": 1e-5,
            **({"noise_multiplier": 0.0} if math.isinf(eps) else {"target_epsilon": eps}),
        }
        if mode.endswith("+secagg"):
            privacy |= {"secure_aggregation": True, "secagg_bound": 1e6}  # set to the least accepted below
    return {
        "run": {"name": f"bench-privacy-{mode.replace('+', '-')}-{eps}", "seed": seed, "rounds": rounds},
        "topology": {"cells": cells, "devices_per_cell": per_cell},
        "algorithm": {"name": "fedavg", "local_steps": 5, "batch_size": 16, "lr": 0.1},
        "model": {"name": "logreg"},
        "data": {"dataset": "mnist", "partition": "iid", "max_train": 60 * cells * per_cell},
        "participation": {"model": "bernoulli", "prob": 0.5},
        "runtime": {"engine": "cohort", "cohort_size": 128, "eval_every": rounds},
        "privacy": privacy,
    }


def run_one(args: tuple) -> tuple[tuple, dict]:
    from protocols.config import parse_config
    from sim.launcher import run_simulation, set_torch_threads

    set_torch_threads(1)
    mode, eps, seed, rounds, cells, per_cell = args
    data = config(mode, eps, seed, rounds, cells, per_cell)
    cfg = parse_config(data)
    z = cfg.dp_accountant().noise_multiplier if cfg.privacy.dp != "off" else None
    if cfg.privacy.secure_aggregation:  # the least bound that keeps the noise: clip + 6 sigma of a device's
        m = cfg.dp_noise_shares() or 1
        data["privacy"]["secagg_bound"] = (CLIP + 6 * (z or 0.0) * CLIP / math.sqrt(m)) * 1.0001
        cfg = parse_config(data)
    t0 = time.perf_counter()
    result = run_simulation(cfg, write_output=False)
    return (mode, eps, seed), {
        "accuracy": float(result.final_accuracy or 0.0),
        "z": z,
        "epsilon": result.history[-1].get("epsilon"),
        "by_party": result.history[-1].get("epsilon_by_party"),
        "wall_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 cells x 50 devices, 5 rounds, one seed")
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 3.0, 8.0, math.inf])
    ap.add_argument("--seeds", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cells", type=int, default=10)
    ap.add_argument("--per-cell", type=int, default=100)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    rounds, cells, per_cell, seeds = (5, 2, 50, 1) if a.quick else (a.rounds, a.cells, a.per_cell, a.seeds)
    columns: list[float | None] = [*a.eps, None]
    jobs = [
        (mode, eps, seed, rounds, cells, per_cell)
        for mode in MODES
        for eps in columns
        for seed in range(seeds)
        if not (eps is None and mode != MODES[0])
    ]
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=a.jobs) as pool:
        out = dict(pool.map(run_one, jobs))
    print(
        f"MNIST, {cells} cells x {per_cell} devices (iid), Bernoulli(0.5) participation, logistic regression, "
        f"E = 1, H = 5, lr 0.1, C = 0.5, "
        f"{rounds} rounds, delta 1e-5, {seeds} seed(s), cohort engine; final test accuracy (mean, min-max)"
    )
    label = lambda e: "off" if e is None else ("inf" if math.isinf(e) else f"{e:g}")  # noqa: E731
    print(f"{'dp':<12}" + "".join(f"{'eps ' + label(e):>22}" for e in columns))
    for mode in MODES:
        row, zs = [], []
        for eps in columns:
            key = MODES[0] if eps is None else mode
            vals = [out[(key, eps, s)]["accuracy"] for s in range(seeds)]
            row.append(f"{sum(vals) / len(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
            z = out[(key, eps, 0)]["z"]
            zs.append("-" if z is None else f"{z:.3g}")
        print(f"{mode:<12}" + "".join(f"{v:>22}" for v in row))
        print(f"{'  z':<12}" + "".join(f"{v:>22}" for v in zs))
        for party in ("cloud", "cell", "devices"):
            cells_ = []
            for eps in columns:
                by = out[(MODES[0] if eps is None else mode, eps, 0)]["by_party"]
                v = None if by is None else by.get(party)
                cells_.append("-" if by is None else ("none" if v is None else f"{v:.3g}"))
            print(f"{'  eps ' + party:<12}" + "".join(f"{v:>22}" for v in cells_))
    walls = [v["wall_s"] for v in out.values()]
    print(
        f"\n{len(jobs)} runs in {time.perf_counter() - t0:.0f} s ({min(walls):.0f}-{max(walls):.0f} s each, "
        f"{a.jobs} at a time)"
    )


if __name__ == "__main__":
    main()
