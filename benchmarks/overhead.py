"""Framework overhead: the standard FedAvg workload through ``fedtier sim`` vs a bare PyTorch loop.

Workload ``standard``: MNIST 60k/10k (pixel/256), 100 devices with an IID split of 600 samples, MLP
784-200-200-10 (torch.manual_seed(0) init), 30 rounds, 10 devices per round sampled with a fixed
seed, 1 local epoch of batch-32 SGD at lr 0.05 (19 steps), weighted averaging, central test
evaluation after every round, one torch thread. fedtier runs it as one cell with one edge round
per cloud round (plain FedAvg), with every message encoded and decoded as on the wire.
Workload ``small`` (``--workload small``): MLP 784-64-10, 5 devices (IID, 12,000 samples each), all
of them in every round, 5 local steps of batch 16 at lr 0.05, 2,000 rounds, central evaluation every
100 rounds (and after the last); the sims write no run files there (the per-device and cohort
sides alike: a checkpoint fsync'ed every round would add the same fixed cost to both).

Sides: ``bare`` (a plain sequential PyTorch loop), ``fedtier`` (the per-device sim engine),
``cohort`` (``runtime.engine = "cohort"``: each round's devices trained as one batched model).
Each side runs in its own subprocess, so peak memory (max RSS) is measured separately; the sides
alternate ``--repeat`` times and the fastest run of each counts (a busy machine only slows runs).
Rounds/s and device-steps/s count the rounds' own time (the sum of the per-round wall times:
imports, data loading and worker start excluded); wall s is the whole process; cpu ms/rd is the main
process's CPU time per round after the first (the steadier figure on a busy machine; workers' excluded).
``--cohort-threads N`` (N > 1) adds a side: the cohort engine with ``runtime.cohort_threads = N`` (its
batched products and the cloud's evaluation on N torch threads, one process).
``--workers N`` adds a side: fedtier with ``runtime.sim_workers = N`` (devices trained in N
worker processes; the same final model), and its speed-up over the bare loop and the sequential sim;
with the ``cohort`` side, also ``cohort`` with N workers (each trains its share of a round as cohorts
on one thread; ``cohort_threads = N``, so the cloud's evaluation, while the workers wait, uses N threads).
CPU seconds include the worker processes; peak MB is the main process's.
Usage: python benchmarks/overhead.py [--workload standard|small] [--rounds N] [--repeat 3]
       [--sides bare,fedtier,cohort] [--cohort-threads 2] [--workers 2 [--backend processes|ray]]
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


WORKLOADS: dict[str, dict] = {
    "standard": {
        "devices": 100,
        "per_round": 10,
        "hidden": [200, 200],
        "steps": 0,
        "batch": 32,
        "lr": 0.05,
        "rounds": 30,
        "eval_every": 1,
    },
    "small": {
        "devices": 5,
        "per_round": 5,
        "hidden": [64],
        "steps": 5,
        "batch": 16,
        "lr": 0.05,
        "rounds": 2000,
        "eval_every": 100,
        "write_output": False,
    },
}


def steps_per_device(w: dict) -> int:
    n = 60000 // w["devices"]
    return w["steps"] or -(-n // w["batch"])  # one epoch when steps is 0


def bare(w: dict, rounds: int) -> dict:
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
    n, devices, per_round, batch = len(y) // w["devices"], w["devices"], w["per_round"], w["batch"]
    shards = [torch.from_numpy(perm[i * n : (i + 1) * n]) for i in range(devices)]
    steps = steps_per_device(w)
    torch.manual_seed(0)
    widths = [784, *w["hidden"]]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 10))
    glob = [p.detach().clone() for p in model.parameters()]
    acc, times, cpu = 0.0, [], []
    for r in range(rounds):
        t_round = time.perf_counter()
        chosen = rng.choice(devices, per_round, replace=False) if per_round < devices else range(devices)
        acc_params = [torch.zeros_like(p) for p in glob]
        for d in chosen:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=w["lr"])
            idx = shards[d][torch.randperm(n)]
            for s in range(0, min(n, steps * batch), batch):
                b = idx[s : s + batch]
                opt.zero_grad()
                F.cross_entropy(model(x[b]), y[b]).backward()
                opt.step()
            with torch.no_grad():
                for a, p in zip(acc_params, model.parameters()):
                    a.add_(p, alpha=1 / per_round)
        glob = acc_params
        if (r + 1) % w["eval_every"] == 0 or r == rounds - 1:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
                acc = float((model(xt).argmax(1) == yt).float().mean())
        times.append(time.perf_counter() - t_round)
        cpu.append(time.process_time())
    return {
        "wall_s": time.perf_counter() - t0,
        "accuracy": acc,
        "round_s": statistics.median(times),
        "loop_s": sum(times),
        "round_cpu_s": (cpu[-1] - cpu[0]) / max(1, len(cpu) - 1),
    }


def fedtier(
    w: dict, rounds: int, engine: str = "device", workers: int = 0, backend: str = "processes", cohort_threads: int = 1
) -> dict:
    t0 = time.perf_counter()
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    algorithm = {
        "name": "fedavg",
        "edge_rounds": 1,
        "batch_size": w["batch"],
        "lr": w["lr"],
        **({"local_steps": w["steps"]} if w["steps"] else {"local_epochs": 1}),
    }
    participation = (
        {"model": "uniform", "per_round": w["per_round"]} if w["per_round"] < w["devices"] else {"model": "always"}
    )
    cfg = parse_config(
        {
            "run": {"name": "overhead", "seed": 0, "rounds": rounds, "output": "/tmp/fedtier-overhead"},
            "topology": {"cells": 1, "devices_per_cell": w["devices"]},
            "algorithm": algorithm,
            "model": {"name": "mlp", "hidden": w["hidden"]},
            "data": {"dataset": "mnist", "partition": "iid"},
            "participation": participation,
            "runtime": {
                "sim_workers": workers,
                "sim_backend": backend,
                "engine": engine,
                "eval_every": w["eval_every"],
                "cohort_threads": cohort_threads,
            },
        }
    )
    cpu: list[float] = []  # this process's CPU time at each round's end (workers' excluded)
    result = run_simulation(
        cfg, write_output=w.get("write_output", True), on_round=lambda _: cpu.append(time.process_time())
    )
    times = [r["duration_s"] for r in result.history]
    return {
        "wall_s": time.perf_counter() - t0,
        "accuracy": result.final_accuracy,
        "round_s": statistics.median(times),
        "loop_s": sum(times),
        "round_cpu_s": (cpu[-1] - cpu[0]) / max(1, len(cpu) - 1),
    }


def child(which: str, workload: str, rounds: int, workers: int, backend: str, cohort_threads: int) -> None:
    w = WORKLOADS[workload]
    if which == "bare":
        out = bare(w, rounds)
    else:
        threads = {"cohort-threads": cohort_threads, "cohort-parallel": workers}.get(which, 1)
        out = fedtier(
            w,
            rounds,
            "cohort" if which.startswith("cohort") else "device",
            workers if which in ("parallel", "cohort-parallel") else 0,
            backend,
            threads,
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)  # the sim's worker processes (joined)
    out["peak_rss_mb"] = usage.ru_maxrss / 1024
    out["cpu_s"] = usage.ru_utime + usage.ru_stime + kids.ru_utime + kids.ru_stime  # less sensitive to a busy machine
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=list(WORKLOADS), default="standard")
    ap.add_argument("--rounds", type=int, default=0, help="cloud rounds (default: the workload's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sides", default="bare,fedtier,cohort", help="comma-separated: bare, fedtier, cohort")
    ap.add_argument("--workers", type=int, default=0, help="also run fedtier with this many sim workers")
    ap.add_argument("--backend", choices=["processes", "ray"], default="processes", help="sim workers' backend")
    ap.add_argument(
        "--cohort-threads", type=int, default=1, help="N > 1: also the cohort engine with runtime.cohort_threads = N"
    )
    ap.add_argument("--child", choices=["bare", "fedtier", "cohort", "cohort-threads", "parallel", "cohort-parallel"])
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    rounds = args.rounds or w["rounds"]
    if args.child:
        child(args.child, args.workload, rounds, args.workers, args.backend, args.cohort_threads)
        return
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    sides = [s for s in args.sides.split(",") if s]
    if args.cohort_threads > 1 and "cohort" in sides:
        sides.append("cohort-threads")
    if args.workers > 0:
        sides += ["parallel"] + (["cohort-parallel"] if "cohort" in sides else [])
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.repeat):
        for which in sides:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                which,
                "--workload",
                args.workload,
                "--rounds",
                str(rounds),
                "--workers",
                str(args.workers),
                "--backend",
                args.backend,
                "--cohort-threads",
                str(args.cohort_threads),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            runs[which].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    res = {k: min(v, key=lambda r: r["wall_s"]) for k, v in runs.items()}
    step_count = rounds * w["per_round"] * steps_per_device(w)
    print(
        f"workload {args.workload}, {rounds} rounds, {w['per_round']} devices x {steps_per_device(w)} steps per "
        f"round; best of {args.repeat} alternating runs; wall times seen: "
        + "; ".join(f"{k} " + ", ".join(f"{r['wall_s']:.2f}" for r in v) for k, v in runs.items())
    )
    cpu = {k: min(r["cpu_s"] for r in v) for k, v in runs.items()}
    print(
        f"{'':12}{'wall s':>10}{'cpu s':>10}{'peak MB':>10}{'accuracy':>10}{'s/round':>10}{'rounds/s':>10}"
        f"{'steps/s':>10}{'cpu ms/rd':>10}"
    )
    for which in sides:
        r = res[which]
        name = {
            "parallel": f"{args.workers} {'actors' if args.backend == 'ray' else 'workers'}",
            "cohort-threads": f"cohort {args.cohort_threads}t",
            "cohort-parallel": f"cohort+{args.workers}w",
        }.get(which, which)
        print(
            f"{name:12}{r['wall_s']:10.2f}{cpu[which]:10.2f}{r['peak_rss_mb']:10.0f}{r['accuracy']:10.4f}"
            f"{r['round_s']:10.4f}{rounds / r['loop_s']:10.1f}{step_count / r['loop_s']:10.0f}"
            f"{r['round_cpu_s'] * 1e3:10.2f}"
        )
    if "bare" in res and "fedtier" in res:
        print(
            f"{'fedtier/bare':12}{res['fedtier']['wall_s'] / res['bare']['wall_s']:10.3f}"
            f"{cpu['fedtier'] / cpu['bare']:10.3f}{res['fedtier']['peak_rss_mb'] / res['bare']['peak_rss_mb']:10.3f}"
            f"{res['fedtier']['accuracy'] - res['bare']['accuracy']:+10.4f}"
        )
    if "cohort" in res:
        c = res["cohort"]
        if "bare" in res:
            b = res["bare"]
            print(
                f"cohort engine: {b['wall_s'] / c['wall_s']:.3f}x faster than the bare loop (wall), "
                f"{b['loop_s'] / c['loop_s']:.3f}x (rounds only); "
                f"peak memory {c['peak_rss_mb'] / b['peak_rss_mb']:.3f}x"
                f" the bare loop's"
            )
        if "fedtier" in res:
            f = res["fedtier"]
            print(
                f"cohort engine: {f['loop_s'] / c['loop_s']:.3f}x the per-device sim's rounds/s, "
                f"{f['wall_s'] / c['wall_s']:.3f}x its wall time; accuracy {c['accuracy'] - f['accuracy']:+.4f}"
            )
    for side, label, one in (
        ("cohort-threads", f"{args.cohort_threads} threads", "one-thread"),
        ("cohort-parallel", f"{args.workers} workers", "one-process"),
    ):
        if side in res:
            c, f = res[side], res.get("fedtier")
            print(
                f"cohort engine with {label}: "
                + (
                    f"{res['bare']['wall_s'] / c['wall_s']:.3f}x faster than the bare loop (wall), "
                    f"{res['bare']['loop_s'] / c['loop_s']:.3f}x (rounds only); "
                    if "bare" in res
                    else ""
                )
                + (f"{f['loop_s'] / c['loop_s']:.3f}x the per-device sim's rounds/s; " if f else "")
                + f"{res['cohort']['loop_s'] / c['loop_s']:.3f}x the {one} cohort engine's rounds/s"
            )
    if args.workers > 0 and "bare" in res and "fedtier" in res:
        p = res["parallel"]
        print(
            f"speed-up with {args.workers} workers: {res['bare']['wall_s'] / p['wall_s']:.3f}x the bare loop, "
            f"{res['fedtier']['wall_s'] / p['wall_s']:.3f}x the sequential sim (wall); per round (median, "
            f"startup excluded) {res['fedtier']['round_s'] / p['round_s']:.3f}x the sequential sim; accuracy "
            f"{'identical' if p['accuracy'] == res['fedtier']['accuracy'] else 'DIFFERS'} to the sequential sim"
        )


if __name__ == "__main__":
    main()
