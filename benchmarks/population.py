"""Simulated populations: ``fedtier sim`` with 10^4, 10^5 and 10^6 devices, building what is active.

Workload: 100 cells; the synthetic Gaussian mixture (20 features, 4 classes) sized from the config,
``data.n`` = 10 samples per device, IID; MLP 20-16-4; hierarchical FedAvg with E = 1 edge round of
H = 5 local steps (batch 10); ``participation.model = "uniform"`` with 1,000 devices a round (10 per
cell on average); 3 cloud rounds; central evaluation on 2,000 test samples after each round.

Each size runs in a fresh subprocess (so its peak RSS is its own). Printed per size: seconds to build
(``SimHierarchy``: data, partition, cloud, cells, population; wall and CPU seconds, the latter less
sensitive to a shared machine's load) and to run the 3 rounds (and each round), agents alive at the
end, peak RSS, RSS when built and after each round (it must not grow with the rounds), and the bytes
of the data itself (features, labels and the partition's index array); the load average before and after.
Targets (issue 12): 10^6 devices built in <= 20 s; peak RSS within 1.5x that of 10^4 plus the
data's extra bytes.
Usage: python benchmarks/population.py [--sizes 10000 100000 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CELLS = 100
ACTIVE_PER_CELL = 10
SAMPLES_PER_DEVICE = 10


def rss_mb() -> float:
    """This process's resident memory now (MB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def one(devices: int, rounds: int, out: str) -> dict:
    from protocols.config import parse_config
    from sim.launcher import SimHierarchy

    cfg = parse_config(
        {
            "run": {"name": "population", "seed": 0, "rounds": rounds, "output": out},
            "topology": {"cells": CELLS, "devices_per_cell": devices // CELLS},
            "algorithm": {"name": "fedavg", "edge_rounds": 1, "local_steps": 5, "batch_size": 10, "lr": 0.1},
            "model": {"name": "mlp", "hidden": [16]},
            "data": {"dataset": "synthetic", "partition": "iid", "n": SAMPLES_PER_DEVICE * devices, "n_test": 2000},
            "participation": {"model": "uniform", "per_round": ACTIVE_PER_CELL * CELLS},
            "runtime": {"device_deadline": 60.0},
        }
    )
    ends: list[tuple[float, float]] = []  # (time, RSS MB) as each round closes
    t0, c0 = time.perf_counter(), time.process_time()
    sim = SimHierarchy(cfg, on_round=lambda _record: ends.append((time.perf_counter(), rss_mb())))
    built, built_cpu = time.perf_counter() - t0, time.process_time() - c0
    built_rss = rss_mb()
    ds, parts = sim.prep.dataset, sim.prep.device_data.parts
    data_bytes = (
        ds.x_train.nbytes
        + ds.y_train.nbytes
        + ds.x_test.nbytes
        + ds.y_test.nbytes
        + sum(p.flat.nbytes + p.offsets.nbytes for p in parts[:1])
    )  # the cells' Parts share one flat array
    t1 = time.perf_counter()
    result = sim.run()
    starts = [t1] + [t for t, _ in ends[:-1]]
    return {
        "devices": devices,
        "build_s": round(built, 2),
        "build_cpu_s": round(built_cpu, 2),
        "run_s": round(time.perf_counter() - t1, 2),
        "round_s": [round(t - s, 2) for (t, _), s in zip(ends, starts)],
        "rss_built_mb": round(built_rss, 1),
        "rss_rounds_mb": [round(m, 1) for _, m in ends],
        "agents_alive": len(sim.agents.built()),
        "accuracy": result.final_accuracy,
        "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "data_mb": round(data_bytes / 2**20, 1),
        "aggregation_kb": round((Path(out) / "aggregation.jsonl").stat().st_size / 1024, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.rounds, args.out)))
        return
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    rows = []
    for n in args.sizes:
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(
                [sys.executable, __file__, "--one", str(n), "--rounds", str(args.rounds), "--out", tmp],
                capture_output=True,
                text=True,
                timeout=1800,
            )
        if proc.returncode != 0:
            print(f"{n:>9,} devices: failed\n{proc.stderr[-2000:]}")
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(
            f"{r['devices']:>9,} devices: build {r['build_s']:6.2f} s ({r['build_cpu_s']:.2f} CPU s), "
            f"{args.rounds} rounds {r['run_s']:6.2f} s, peak {r['peak_mb']:7.1f} MB (data {r['data_mb']:6.1f} MB), "
            f"{r['agents_alive']} agents alive, aggregation.jsonl {r['aggregation_kb']} KB, "
            f"accuracy {r['accuracy']:.3f}",
            flush=True,
        )
        print(
            f"{'':>19}s per round {', '.join(f'{t:.2f}' for t in r['round_s'])}; RSS built "
            f"{r['rss_built_mb']:.0f} MB, after each round {', '.join(f'{m:.0f}' for m in r['rss_rounds_mb'])} MB",
            flush=True,
        )
    if rows and rows[0]["devices"] == min(args.sizes):
        base = rows[0]
        for r in rows[1:]:
            bound = 1.5 * base["peak_mb"] + (r["data_mb"] - base["data_mb"])
            print(
                f"{r['devices']:>9,}: peak {r['peak_mb']:.0f} MB vs 1.5 x {base['peak_mb']:.0f} + "
                f"{r['data_mb'] - base['data_mb']:.0f} MB of extra data = {bound:.0f} MB: "
                f"{'met' if r['peak_mb'] <= bound else 'NOT met'} ({r['peak_mb'] / bound:.0%} of the bound); "
                f"build {r['build_s']:.1f} s"
                + (
                    f" (target <= 20 s: {'met' if r['build_s'] <= 20 else 'NOT met'})"
                    if r["devices"] >= 1_000_000
                    else ""
                )
            )
    for r in rows:
        growth = r["rss_rounds_mb"][-1] - r["rss_rounds_mb"][0] if r["rss_rounds_mb"] else 0.0
        print(f"{r['devices']:>9,}: RSS from the first round's end to the last {growth:+.0f} MB")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
