"""Framework overhead: the standard FedAvg workload through ``fedtier sim`` vs a bare PyTorch loop.

Workload: MNIST 60k/10k (pixel/256), 100 devices with an IID split of 600 samples, MLP
784-200-200-10 (torch.manual_seed(0) init), 30 rounds, 10 devices per round sampled with a fixed
seed, 1 local epoch of batch-32 SGD at lr 0.05 (19 steps), weighted averaging, central test
evaluation after every round, one torch thread. fedtier runs it as one cell with one edge round
per cloud round (plain FedAvg), with every message encoded and decoded as on the wire.

Each side runs in its own subprocess, so peak memory (max RSS) is measured separately; the sides
alternate ``--repeat`` times and the fastest run of each counts (a busy machine only slows runs).
``--workers N`` adds a third side: fedtier with ``runtime.sim_workers = N`` (devices trained in N
worker processes; the same final model), and its speed-up over the bare loop and the sequential sim.
CPU seconds include the worker processes; peak MB is the main process's.
Usage: python benchmarks/overhead.py [--rounds 30] [--repeat 3] [--workers 2 [--backend processes|ray]]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def bare(rounds: int) -> dict:
    t0 = time.perf_counter()  # both sides are timed from before their imports (torch's ~1 s too)
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from sim.datasets import load_dataset

    torch.set_num_threads(1)
    ds = load_dataset("mnist")
    x, y = torch.from_numpy(ds.x_train.copy()), torch.from_numpy(ds.y_train.copy())
    xt, yt = torch.from_numpy(ds.x_test.copy()), torch.from_numpy(ds.y_test.copy())
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(y))
    shards = [torch.from_numpy(perm[i * 600:(i + 1) * 600]) for i in range(100)]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                          nn.Linear(200, 10))
    glob = [p.detach().clone() for p in model.parameters()]
    acc, times = 0.0, []
    for _ in range(rounds):
        t_round = time.perf_counter()
        chosen = rng.choice(100, 10, replace=False)
        acc_params = [torch.zeros_like(p) for p in glob]
        for d in chosen:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            idx = shards[d][torch.randperm(600)]
            for s in range(0, 600, 32):
                b = idx[s:s + 32]
                opt.zero_grad()
                F.cross_entropy(model(x[b]), y[b]).backward()
                opt.step()
            with torch.no_grad():
                for a, p in zip(acc_params, model.parameters()):
                    a.add_(p, alpha=600 / 6000)
        glob = acc_params
        with torch.no_grad():
            for p, g in zip(model.parameters(), glob):
                p.copy_(g)
            acc = float((model(xt).argmax(1) == yt).float().mean())
        times.append(time.perf_counter() - t_round)
    return {"wall_s": time.perf_counter() - t0, "accuracy": acc, "round_s": statistics.median(times)}


def fedtier(rounds: int, workers: int = 0, backend: str = "processes") -> dict:
    t0 = time.perf_counter()
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    cfg = parse_config({
        "run": {"name": "overhead", "seed": 0, "rounds": rounds, "output": "/tmp/fedtier-overhead"},
        "topology": {"cells": 1, "devices_per_cell": 100},
        "algorithm": {"name": "fedavg", "edge_rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "model": {"name": "mlp", "hidden": [200, 200]},
        "data": {"dataset": "mnist", "partition": "iid"},
        "participation": {"model": "uniform", "per_round": 10},
        "runtime": {"sim_workers": workers, "sim_backend": backend},
    })
    result = run_simulation(cfg)
    return {"wall_s": time.perf_counter() - t0, "accuracy": result.final_accuracy,
            "round_s": statistics.median(r["duration_s"] for r in result.history)}


def child(which: str, rounds: int, workers: int, backend: str) -> None:
    out = bare(rounds) if which == "bare" else fedtier(rounds, workers if which == "parallel" else 0, backend)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the sim's worker processes (joined)
    out["peak_rss_mb"] = usage.ru_maxrss / 1024
    out["cpu_s"] = usage.ru_utime + usage.ru_stime + kids.ru_utime + kids.ru_stime  # less sensitive to a busy machine
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", type=int, default=0, help="also run fedtier with this many sim workers")
    ap.add_argument("--backend", choices=["processes", "ray"], default="processes", help="sim workers' backend")
    ap.add_argument("--child", choices=["bare", "fedtier", "parallel"])
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rounds, args.workers, args.backend)
        return
    sides = ("bare", "fedtier", "parallel") if args.workers > 0 else ("bare", "fedtier")
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.repeat):
        for which in sides:
            cmd = [sys.executable, __file__, "--child", which, "--rounds", str(args.rounds),
                   "--workers", str(args.workers), "--backend", args.backend]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            runs[which].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    res = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    print(f"best of {args.repeat} alternating runs; wall times seen: "
          + "; ".join(f"{k} " + ", ".join(f"{r['wall_s']:.2f}" for r in v) for k, v in runs.items()))
    cpu = {k: min(r["cpu_s"] for r in v) for k, v in runs.items()}
    print(f"{'':12}{'wall s':>10}{'cpu s':>10}{'peak MB':>10}{'accuracy':>10}{'s/round':>10}")
    for which in sides:
        r = res[which]
        name = which if which != "parallel" else f"{args.workers} {'actors' if args.backend == 'ray' else 'workers'}"
        print(f"{name:12}{r['wall_s']:10.2f}{cpu[which]:10.2f}{r['peak_rss_mb']:10.0f}{r['accuracy']:10.4f}"
              f"{r['round_s']:10.3f}")
    print(f"{'ratio':12}{res['fedtier']['wall_s'] / res['bare']['wall_s']:10.3f}{cpu['fedtier'] / cpu['bare']:10.3f}"
          f"{res['fedtier']['peak_rss_mb'] / res['bare']['peak_rss_mb']:10.3f}"
          f"{res['fedtier']['accuracy'] - res['bare']['accuracy']:+10.4f}")
    if args.workers > 0:
        p = res["parallel"]
        print(f"speed-up with {args.workers} workers: {res['bare']['wall_s'] / p['wall_s']:.3f}x the bare loop, "
              f"{res['fedtier']['wall_s'] / p['wall_s']:.3f}x the sequential sim (wall); per round (median, "
              f"startup excluded) {res['fedtier']['round_s'] / p['round_s']:.3f}x the sequential sim; accuracy "
              f"{'identical' if p['accuracy'] == res['fedtier']['accuracy'] else 'DIFFERS'} to the sequential sim")


if __name__ == "__main__":
    main()
