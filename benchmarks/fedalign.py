"""FedALIGN vs priority-only and all-device FedAvg (FedALIGN paper, Figs. 1-2; spec fedalign.md).

The paper's metric: test accuracy of the global model on the priority devices' distribution ("final" = mean
of the last 10 iterations), for FedALIGN, FedAvg over the priority devices only (epsilon = 0) and FedAvg over
all devices (epsilon = inf, the same 10 % warm-up). Every method gets the same tuning: each learning rate of
the grid on every seed; the rate with the best mean final accuracy wins, and a winner on the edge of the grid is
flagged. Runs the real hierarchy in memory with the cohort engine (FedALIGN's matching iterations take two
cloud rounds; the benchmark counts iterations).

Scenarios:

- ``shards`` (Fig. 1, the paper's FMNIST recipe): 60 devices (3 cells x 20), each with two single-class shards
  of 500 samples drawn with replacement from a random class (spec pitfall 8); 2 priority devices, random
  devices with random shards like everyone else; logistic regression, E = 5 SGD steps of batch 32, epsilon =
  0.2 on the loss, 200 iterations (20 warm-up). Test set: the Fashion-MNIST test split resampled with
  replacement to the priority devices' label mix.
- ``synth-low|medium|high`` (Fig. 2): Synth(1,1) of FedProx, 10 priority devices (each its own W_k, b_k, v_k;
  200 samples each) and 10 free devices whose 200 samples come from the priority distribution, corrupted at a
  device level L_j = (j/9)^(1/skew), j = 0..9 (skew 0.5 / 1.5 / 5 for low / medium / high noise): a
  fraction L_j/2 of the labels shifted y -> y+1 and a fraction L_j/2 of the points replaced by N(0, I) points
  with uniform labels (the paper's corruption formulas are not published; this is the spec's choice).
  Logistic regression 60 -> 10, epsilon 0.2 (0.4 for high noise), 2 cells x 10 devices, 200 iterations.
  Test set: 100 held-out samples per priority device.
- ``planted`` (a labelled extra, not the paper's recipe): the shards scenario with the priority devices' class
  pairs fixed to {0,1} and {2,3} and a fifth of the free devices planted with exactly those pairs.

Presets: ``paper`` = shards + the three synth levels + planted, 200 iterations, 5 seeds, lr grid
0.01-3.0 (the paper uses 0.1 for every method); ``quick`` = shards + synth-medium, 40 iterations (4 warm-up),
3 seeds, lr grid 0.03-3.0 (FedALIGN's shards winner sat at 1.0 on 0.03-1.0). Runs go to ``--jobs`` processes.

    python benchmarks/fedalign.py --preset quick
    python benchmarks/fedalign.py --preset paper [--scenarios shards] [--seeds 3]   # a documented subset
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tuning import add_journal_args, grid_line, open_journal, pick, sweep  # noqa: E402
from protocols.config import parse_config  # noqa: E402
from protocols.seeding import rng  # noqa: E402
from protocols.trainer import LocalData  # noqa: E402
from sim.datasets import Dataset, load_dataset  # noqa: E402
from sim.hierarchy import prepare_given  # noqa: E402
from sim.launcher import SimHierarchy  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    "paper": dict(
        scenarios=["shards", "synth-low", "synth-medium", "synth-high", "planted"],
        iterations=200,
        seeds=5,
        lrs=[0.01, 0.03, 0.1, 0.3, 1.0, 3.0],
    ),
    "quick": dict(scenarios=["shards", "synth-medium"], iterations=40, seeds=3, lrs=[0.03, 0.1, 0.3, 1.0, 3.0]),
}
SKEW = {"synth-low": (0.5, 0.2), "synth-medium": (1.5, 0.2), "synth-high": (5.0, 0.4)}  # skew, epsilon
METHODS = {"priority-only": 0.0, "all": math.inf, "fedalign": None}  # None: the scenario's epsilon
MEDIAN = "fedalign-median"  # --median: FedALIGN with algorithm.priority_statistic = "median"
PLANTED = {"c0-d0": (0, 1), "c1-d0": (2, 3)}
SHARD, FMNIST_TEST = 500, 2000


# ------------------------------------------------------------------------------------------ scenarios
def shard_scenario(devices: list[str], seed: int, planted: bool) -> tuple[dict[str, LocalData], Any, list[str]]:
    """Every device two single-class shards of 500 samples (with replacement); returns data, test set, priority."""
    ds = load_dataset("fmnist")
    if planted:
        prio, pairs = sorted(PLANTED), dict(PLANTED)
    else:
        prio = sorted(rng(seed, "bench.fedalign.priority").choice(devices, size=2, replace=False).tolist())
        pairs = {}
    free = [d for d in devices if d not in prio]
    prio_classes = sorted({c for d in prio for c in pairs.get(d, ())})
    other = [c for c in range(ds.num_classes) if c not in prio_classes]
    for rank, i in enumerate(rng(seed, "bench.fedalign.order").permutation(len(free))):
        d = free[i]
        g = rng(seed, None, None, d, "bench.fedalign.classes")
        if planted and rank < len(free) // 5:  # aligned: exactly a priority device's pair
            pairs[d] = PLANTED[prio[rank % 2]]
        elif planted and rank < 2 * (len(free) // 5):  # half aligned: one priority class, one other
            pairs[d] = (int(g.choice(prio_classes)), int(g.choice(other)))
        elif planted:  # misaligned
            pairs[d] = tuple(int(c) for c in g.choice(other, size=2, replace=False))
        else:  # the paper's recipe: two random classes
            pairs[d] = tuple(int(c) for c in g.choice(ds.num_classes, size=2, replace=False))
    for d in prio:  # random priority devices draw their shards like everyone else
        if d not in pairs:
            g = rng(seed, None, None, d, "bench.fedalign.classes")
            pairs[d] = tuple(int(c) for c in g.choice(ds.num_classes, size=2, replace=False))
    data = {}
    for d in devices:
        g = rng(seed, None, None, d, "bench.fedalign.shards")
        idx = np.concatenate([g.choice(np.flatnonzero(ds.y_train == c), size=SHARD, replace=True) for c in pairs[d]])
        data[d] = LocalData(ds.x_train[idx], ds.y_train[idx])
    labels = [c for d in prio for c in pairs[d]]  # the priority label mix (equal shards)
    g = rng(seed, "bench.fedalign.test")
    idx = np.concatenate(
        [g.choice(np.flatnonzero(ds.y_test == c), size=FMNIST_TEST // len(labels), replace=True) for c in labels]
    )
    return data, (ds.x_test[idx], ds.y_test[idx]), prio


def synth_scenario(
    devices: list[str], seed: int, skew: float, n: int = 200, n_test: int = 100
) -> tuple[dict[str, LocalData], Any, list[str]]:
    """Synth(1,1): priority devices d0..d4 of each cell, free devices d5..d9 corrupted at level (j/9)^(1/skew)."""
    dim, classes = 60, 10
    prio = [d for d in devices if int(d.split("-d")[1]) < 5]
    free = [d for d in devices if d not in prio]
    cov = np.arange(1, dim + 1) ** -1.2
    models = []
    data: dict[str, LocalData] = {}
    test_x, test_y = [], []

    def draw(g: np.random.Generator, model: tuple, m: int) -> tuple[np.ndarray, np.ndarray]:
        W, b, v = model
        x = (v + g.standard_normal((m, dim)) * np.sqrt(cov)).astype(np.float32)
        return x, np.argmax(x @ W.T + b, axis=1).astype(np.int64)

    for d in prio:
        g = rng(seed, None, None, d, "bench.fedalign.synth")
        u, B = g.normal(0, 1), g.normal(0, 1)
        model = (g.normal(u, 1, (classes, dim)), g.normal(u, 1, classes), g.normal(B, 1, dim))
        models.append(model)
        x, y = draw(g, model, n + n_test)
        data[d] = LocalData(x[:n], y[:n])
        test_x.append(x[n:])
        test_y.append(y[n:])
    # free device j (interleaved over the cells, so both cells hold clean and noisy ones)
    order = sorted(free, key=lambda d: (int(d.split("-d")[1]), d))
    for j, d in enumerate(order):
        g = rng(seed, None, None, d, "bench.fedalign.synth.free")
        level = (j / max(1, len(order) - 1)) ** (1 / skew)
        owners = g.integers(0, len(models), n)
        xs, ys = zip(*(draw(g, models[k], 1) for k in owners))
        x, y = np.concatenate(xs), np.concatenate(ys)
        pick = g.permutation(n)
        flip, junk = pick[: int(level / 2 * n)], pick[int(level / 2 * n) : 2 * int(level / 2 * n)]
        y[flip] = (y[flip] + 1) % classes
        x[junk] = g.standard_normal((len(junk), dim)).astype(np.float32)
        y[junk] = g.integers(0, classes, len(junk))
        data[d] = LocalData(x, y)
    return data, (np.concatenate(test_x), np.concatenate(test_y)), prio


# ------------------------------------------------------------------------------------------ one run
def run_key(key: str, lr: float, seed: int, iterations: int) -> dict:
    """``run`` for a sweep cell named ``scenario/method``."""
    scenario, method = key.split("/")
    return run(scenario, method, lr, seed, iterations)


def run(scenario: str, method: str, lr: float, seed: int, iterations: int) -> dict:
    synth = scenario.startswith("synth")
    cells, per_cell = (2, 10) if synth else (3, 20)
    devices = [f"c{c}-d{i}" for c in range(cells) for i in range(per_cell)]
    if synth:
        data, test, prio = synth_scenario(devices, seed, SKEW[scenario][0])
        eps_alg = SKEW[scenario][1]
    else:
        data, test, prio = shard_scenario(devices, seed, planted=scenario == "planted")
        eps_alg = 0.2
    eps = eps_alg if METHODS.get(method) is None else METHODS[method]
    warmup = max(1, round(0.1 * iterations))
    rounds = warmup + (iterations - warmup) * (2 if 0 < eps < math.inf else 1)
    order = list(data)
    x_all = np.concatenate([data[d].x for d in order])
    y_all = np.concatenate([data[d].y for d in order])
    ends = np.cumsum([len(data[d]) for d in order])
    parts = {d: np.arange(end - len(data[d]), end) for d, end in zip(order, ends)}
    ds = Dataset(x_all, y_all, test[0], test[1], (x_all.shape[1],), 10, scenario)
    cfg = parse_config(
        {
            "run": {"name": f"bench-fedalign-{scenario}-{method}", "seed": seed, "rounds": rounds},
            "topology": {"cells": cells, "devices_per_cell": per_cell},
            "algorithm": {
                "name": "fedalign",
                "priority": prio,
                "epsilon": eps,
                "warmup_rounds": warmup,
                "local_steps": 5,
                "batch_size": 32,
                "lr": lr,
                **({"priority_statistic": "median"} if method == MEDIAN else {}),
            },
            "model": {"name": "logreg"},
            "runtime": {"engine": "cohort"},
        }
    )  # the data: the scenario's, given to the simulation below
    h = SimHierarchy(cfg, write_output=False, prepared=prepare_given(cfg, ds, parts))
    t0 = time.perf_counter()
    result = h.run()
    acc = [float(r["accuracy"]) for r in result.history if r["metrics"]["phase"] != "priority"]  # one per iteration
    admitted = tried = 0
    for rec in result.cell_records:
        for a in rec.get("metrics", {}).get("admission", {}).values():
            tried += 1
            admitted += bool(a["admitted"])
    return {
        "acc": acc,
        "final": float(np.mean(acc[-10:])),
        "admit": admitted / tried if tried else float("nan"),
        "wall": time.perf_counter() - t0,
        "rounds": rounds,
    }


def median_line(mean: list, median: list) -> str:
    """FedALIGN's median F against its mean F: paired per-seed differences of the final accuracy at each lr of the
    grid, and how many runs ended bit for bit equal (the same accuracy curve)."""
    parts, equal, total = [], 0, 0
    for a, b in zip(mean, median):
        d = np.array([rb["final"] - ra["final"] for ra, rb in zip(a.runs, b.runs)])
        equal += sum(ra["acc"] == rb["acc"] for ra, rb in zip(a.runs, b.runs))
        total += len(d)
        adm = np.nanmean([r["admit"] for r in b.runs]) - np.nanmean([r["admit"] for r in a.runs])
        parts.append(f"lr {a.value:g}: {d.mean():+.4f} [{d.min():+.4f},{d.max():+.4f}] admitted {adm:+.3f}")
    return f"median - mean F: {'; '.join(parts)}; identical curves {equal}/{total} runs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    ap.add_argument("--scenarios", nargs="+", choices=["shards", "planted", *SKEW])
    ap.add_argument("--seeds", type=int)
    ap.add_argument("--iterations", type=int)
    ap.add_argument("--lrs", type=float, nargs="+")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each single-threaded)")
    ap.add_argument(
        "--median",
        action="store_true",
        help=f"also run {MEDIAN} (FedALIGN with priority_statistic = 'median') on the same grid and seeds",
    )
    add_journal_args(ap)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    p = dict(PRESETS[a.preset])
    for key in ("scenarios", "seeds", "iterations", "lrs"):
        if getattr(a, key) is not None:
            p[key] = getattr(a, key)
    t0 = time.perf_counter()
    print(
        f"preset {a.preset}: scenarios {p['scenarios']}, {p['iterations']} iterations (10 % warm-up), seeds "
        f"0..{p['seeds'] - 1}, lr grid {p['lrs']}, logistic regression, E = 5 steps of batch 32, cohort engine",
        flush=True,
    )
    methods = [*METHODS, *([MEDIAN] if a.median else [])]
    keys = {f"{sc}/{m}": p["lrs"] for sc in p["scenarios"] for m in methods}
    journal = open_journal(a, __file__, a.preset, {"iterations": p["iterations"], "skew": SKEW, "methods": METHODS})
    cells = sweep(run_key, keys, list(range(p["seeds"])), a.jobs, journal=journal, iterations=p["iterations"])
    journal.close()
    rows = []
    for scenario in p["scenarios"]:
        best: dict[str, tuple[float, list[dict]]] = {}
        for method in METHODS:
            row = cells[f"{scenario}/{method}"]
            print(f"  {scenario:<13}{method:<14}" + grid_line(row, "final", lambda v: f"{v:.3f}"), flush=True)
            w = pick({method: row}, "final", lower_is_better=False)[method]
            best[method] = (w.cell.value, w.cell.runs)
        if a.median:
            print(
                f"  {scenario:<13}{MEDIAN:<14}"
                + grid_line(cells[f"{scenario}/{MEDIAN}"], "final", lambda v: f"{v:.3f}")
            )
            print("  " + median_line(cells[f"{scenario}/fedalign"], cells[f"{scenario}/{MEDIAN}"]), flush=True)
        rows.append((scenario, best))
    print(
        "\npriority test accuracy, final = mean of the last 10 iterations, at each method's best lr "
        "(mean ± std over seeds; 'edge': the best lr is at the end of the grid)"
    )
    print(
        f"{'scenario':<14}"
        + "".join(f"{m + ' (lr)':>26}" for m in METHODS)
        + f"{'admitted':>10}{'Δ vs prio-only':>25}{'Δ vs all':>25}"
    )
    for scenario, best in rows:
        line = f"{scenario:<14}"
        for m in METHODS:
            lr, runs = best[m]
            f = [r["final"] for r in runs]
            edge = "*" if lr in (min(p["lrs"]), max(p["lrs"])) else " "
            line += f"{f'{np.mean(f):.3f} ± {np.std(f):.3f} ({lr:g}{edge})':>26}"
        line += f"{np.nanmean([r['admit'] for r in best['fedalign'][1]]):>10.2f}"
        mine = np.array([r["final"] for r in best["fedalign"][1]])
        for base in ("priority-only", "all"):
            d = mine - np.array([r["final"] for r in best[base][1]])
            line += f"{f'{d.mean():+.3f} [{d.min():+.3f}, {d.max():+.3f}]':>25}"
        print(line)
    print(
        "(* = edge of the grid; admitted = admitted / probed free devices after warm-up; Δ = paired per-seed "
        "differences, mean [min, max])"
    )
    for scenario, best in rows:
        mine = np.array([r["final"] for r in best["fedalign"][1]])
        for base in ("priority-only", "all"):
            d = mine - np.array([r["final"] for r in best[base][1]])
            se = d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("inf")
            verdict = "beats" if d.mean() > 2 * se else "loses to" if d.mean() < -2 * se else "ties with"
            print(f"{scenario}: FedALIGN {verdict} {base} ({d.mean():+.3f}, 2 s.e. {2 * se:.3f})")
    print(f"total {time.perf_counter() - t0:.0f} s; {journal.summary()}")


if __name__ == "__main__":
    main()
