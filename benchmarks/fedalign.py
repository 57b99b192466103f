"""FedALIGN vs its two baselines on label-skewed Fashion-MNIST (spec fedalign.md, sec. 3-4, Fig. 1).

Setup (paper's FMNIST recipe, scaled to the hierarchy): N = cells x devices_per_cell devices, each with two
single-class shards of ``--shard`` samples drawn with replacement from its class (spec pitfall 8). Two
priority devices sit in different cells and hold classes {0, 1} and {2, 3}; every other device draws two
distinct classes at random, so some share only priority labels ("aligned"), some one ("half") and the rest
none ("misaligned"). Logistic regression, lr 0.1, E = 5 SGD steps of batch 32, 10 % warm-up iterations.
Test set: the Fashion-MNIST test split resampled with replacement to the priority label mix.

Methods: priority-only (epsilon = 0), all devices (epsilon = inf), FedALIGN (epsilon, loss criterion).
Prints the priority test accuracy over iterations, the final accuracy (mean of the last 10 iterations)
and the admission rate of aligned / half / misaligned devices after warm-up.

    python benchmarks/fedalign.py                  # defaults (3 seeds, 200 iterations)
    python benchmarks/fedalign.py --rounds 30 --seeds 1 --devices-per-cell 5   # quick look
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from protocols.seeding import rng  # noqa: E402
from protocols.trainer import LocalData  # noqa: E402
from sim.datasets import load_dataset  # noqa: E402
from sim.hierarchy import make_evaluator  # noqa: E402
from sim.launcher import SimHierarchy  # noqa: E402

PRIORITY_CLASSES = {"c0-d0": (0, 1), "c1-d0": (2, 3)}


def device_classes(devices: list[str], classes: int, seed: int, mix: str) -> dict[str, tuple[int, int]]:
    """Priority devices get their fixed pairs. ``mix = "random"``: every other device two distinct random
    classes (the paper's shards). ``mix = "planted"``: a fifth of the free devices are aligned (a priority
    device's pair, alternating), a fifth half aligned (one priority class, one other), the rest misaligned
    (two non-priority classes); which device gets which is a seeded shuffle."""
    prio = sorted({c for p in PRIORITY_CLASSES.values() for c in p})
    other = [c for c in range(classes) if c not in prio]
    free = [d for d in devices if d not in PRIORITY_CLASSES]
    order = rng(seed, "bench.fedalign.order").permutation(len(free))
    out = dict(PRIORITY_CLASSES)
    pairs = sorted(PRIORITY_CLASSES.values())
    for rank, i in enumerate(order):
        d = free[i]
        g = rng(seed, None, None, d, "bench.fedalign.classes")
        if mix == "random":
            a, b = g.choice(classes, size=2, replace=False)
        elif rank < len(free) // 5:
            a, b = pairs[rank % len(pairs)]
        elif rank < 2 * (len(free) // 5):
            a, b = g.choice(prio), g.choice(other)
        else:
            a, b = g.choice(other, size=2, replace=False)
        out[d] = (int(a), int(b))
    return out


def alignment(pair: tuple[int, int]) -> str:
    prio = {c for p in PRIORITY_CLASSES.values() for c in p}
    inside = sum(c in prio for c in pair)
    return ("misaligned", "half", "aligned")[inside]


def shards(y: np.ndarray, pair: tuple[int, int], size: int, seed: int, device: str) -> np.ndarray:
    g = rng(seed, None, None, device, "bench.fedalign.shards")
    return np.concatenate([g.choice(np.flatnonzero(y == c), size=size, replace=True) for c in pair])


def priority_test_set(ds, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The test split resampled with replacement to the priority devices' label mix (equal shards)."""
    labels = [c for p in PRIORITY_CLASSES.values() for c in p]
    g = rng(seed, "bench.fedalign.test")
    idx = np.concatenate([g.choice(np.flatnonzero(ds.y_test == c), size=size // len(labels), replace=True)
                          for c in labels])
    return ds.x_test[idx], ds.y_test[idx]


def run(method: str, eps: float, args: argparse.Namespace, seed: int) -> dict:
    warmup = max(1, round(0.1 * args.rounds))
    matching = 0 < eps < math.inf
    cloud_rounds = warmup + (args.rounds - warmup) * (2 if matching else 1)
    cfg = parse_config({
        "run": {"name": f"bench-fedalign-{method}", "seed": seed, "rounds": cloud_rounds},
        "topology": {"cells": args.cells, "devices_per_cell": args.devices_per_cell},
        "algorithm": {"name": "fedalign", "priority": sorted(PRIORITY_CLASSES), "epsilon": eps,
                      "warmup_rounds": warmup, "local_steps": 5, "batch_size": 32, "lr": 0.1},
        "model": {"name": "logreg"},
        "data": {"dataset": "fmnist", "partition": "iid", "max_train": 1000 * args.cells * args.devices_per_cell,
                 "max_test": 100},
    })
    ds = load_dataset("fmnist")
    h = SimHierarchy(cfg, write_output=False)
    pairs = device_classes(cfg.topology.all_devices(), ds.num_classes, seed, args.mix)
    for d, agent in h.agents.items():  # the benchmark's label-skewed shards replace the config's partition
        idx = shards(ds.y_train, pairs[d], args.shard, seed, d)
        agent.data = LocalData(ds.x_train[idx], ds.y_train[idx])
    h.cloud.evaluator = make_evaluator(h.prep.spec, *priority_test_set(ds, args.test_size, seed))
    t0 = time.perf_counter()
    result = h.run()
    acc = [r["accuracy"] for r in result.history if r["metrics"]["phase"] != "priority"]  # one per iteration
    tried = {k: 0 for k in ("aligned", "half", "misaligned")}
    admitted = dict.fromkeys(tried, 0)
    for rec in result.cell_records:
        for d, a in rec.get("metrics", {}).get("admission", {}).items():
            if rec["metrics"]["phase"] == "free" or (rec["metrics"]["phase"] == "all"):
                kind = alignment(pairs[d])
                tried[kind] += 1
                admitted[kind] += bool(a["admitted"])
    counts = {k: sum(alignment(pairs[d]) == k for d in pairs if d not in PRIORITY_CLASSES) for k in tried}
    return {"acc": acc, "rate": {k: admitted[k] / tried[k] if tried[k] else float("nan") for k in tried},
            "counts": counts, "wall": time.perf_counter() - t0,
            "down_bytes": result.history[-1]["cumulative_bytes"]["cell_to_device"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200, help="iterations (FedALIGN: 2 cloud rounds each)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--eps", type=float, default=0.2)
    ap.add_argument("--cells", type=int, default=3)
    ap.add_argument("--devices-per-cell", type=int, default=20)
    ap.add_argument("--shard", type=int, default=500, help="samples per single-class shard")
    ap.add_argument("--test-size", type=int, default=2000)
    ap.add_argument("--mix", choices=("planted", "random"), default="planted",
                    help="free devices' classes: planted aligned/half/misaligned groups, or random pairs")
    args = ap.parse_args()
    methods = {"priority-only": 0.0, "all": math.inf, "fedalign": args.eps}
    res: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in range(args.seeds):
        for m, eps in methods.items():
            res[m].append(run(m, eps, args, seed))
            r = res[m][-1]
            print(f"seed {seed} {m:14s} final {np.mean(r['acc'][-10:]):.3f}  wall {r['wall']:.0f}s", flush=True)
    warm = max(1, round(0.1 * args.rounds))
    marks = sorted({warm, warm + 5, args.rounds // 2, args.rounds - 1} | {min(args.rounds - 1, 2 * warm)})
    print(f"\nFashion-MNIST, {args.cells} cells x {args.devices_per_cell} devices, 2 priority devices, eps "
          f"{args.eps}, {args.rounds} iterations ({warm} warm-up), {args.seeds} seed(s); priority test accuracy")
    print(f"{'method':14s} " + " ".join(f"{'it ' + str(i + 1):>8s}" for i in marks) + f" {'final':>14s}"
          + f" {'adm aligned':>12s} {'adm half':>9s} {'adm misal.':>11s} {'dev MB':>7s}")
    for m in methods:
        curves = np.array([r["acc"] for r in res[m]])
        final = curves[:, -10:].mean(axis=1)
        rates = {k: [r["rate"][k] for r in res[m] if not math.isnan(r["rate"][k])]
                 for k in ("aligned", "half", "misaligned")}
        rate = {k: f"{np.mean(v):.2f}" if v else "-" for k, v in rates.items()}
        mb = np.mean([r["down_bytes"] for r in res[m]]) / 1e6
        print(f"{m:14s} " + " ".join(f"{curves[:, i].mean():8.3f}" for i in marks)
              + f" {final.mean():7.3f} ± {final.std():.3f}"
              + f" {rate['aligned']:>12s} {rate['half']:>9s} {rate['misaligned']:>11s} {mb:7.1f}")
    counts = res["fedalign"][0]["counts"]
    print(f"\nfree devices (seed 0): {counts['aligned']} aligned, {counts['half']} half, "
          f"{counts['misaligned']} misaligned; admission rate = admitted / (devices x post-warm-up iterations)")
    f = np.array([np.mean(r["acc"][-10:]) for r in res["fedalign"]])
    for base in ("priority-only", "all"):
        b = np.array([np.mean(r["acc"][-10:]) for r in res[base]])
        print(f"paired gain fedalign - {base}: " + " ".join(f"{x:+.3f}" for x in f - b))


if __name__ == "__main__":
    main()
