"""Synchronous vs buffered asynchronous (FedBuff) hierarchical FedAvg: accuracy vs virtual time with stragglers.

fedtier sim, MNIST (``--max-train`` samples, iid), 200 devices in 10 cells, MLP 784-64-10, H = 10 local
steps, batch 16, lr 0.05; ``[clock]``: 10 steps/s per device times a seeded log-normal factor
(``device_speed_spread``, sigma 1 by default), 1 MB/s device links, 10 MB/s backhaul, 20 ms latency.
Sync: E = 1 edge round per cloud round, every device every round (a round waits for the slowest
device of every cell). Async: K = ``--buffer`` results per cell update, a push every cell update, a
cloud version every ``--cloud-buffer`` pushes, staleness weight 1/sqrt(1+s). Prints accuracy vs virtual
time for both and the virtual time async needs to reach sync's final accuracy (target: <= 0.5x).

    .venv/bin/python benchmarks/async.py [--quick] [--rounds 15] [--spread 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import run_simulation  # noqa: E402


def config(mode: str, rounds: int, a: argparse.Namespace) -> dict:
    algo = {"name": "fedavg", "edge_rounds": 1, "local_steps": 10, "batch_size": 16, "lr": 0.05, "mode": mode}
    if mode == "async":
        algo.update(
            async_buffer=a.buffer, async_push_every=1, async_cloud_buffer=a.cloud_buffer, max_staleness=a.max_staleness
        )
    return {
        "run": {"name": f"bench-async-{mode}", "seed": a.seed, "rounds": rounds},
        "topology": {"cells": a.cells, "devices_per_cell": a.devices // a.cells},
        "algorithm": algo,
        "model": {"name": "mlp", "hidden": [64]},
        "data": {"dataset": a.dataset, "partition": "iid", "max_train": a.max_train, "max_test": 2000},
        "runtime": {"device_deadline": 1e6, "eval_every": 1 if mode == "sync" else a.eval_every},
        "clock": {
            "device_steps_per_s": 10.0,
            "device_speed_spread": a.spread,
            "downlink_bytes_per_s": 1e6,
            "uplink_bytes_per_s": 1e6,
            "backhaul_bytes_per_s": 1e7,
            "latency_s": 0.02,
        },
    }


def curve(history: list[dict]) -> list[tuple[float, float]]:
    return [(h["clock_s"], h["accuracy"]) for h in history if "accuracy" in h]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 devices in 4 cells, 5 sync rounds")
    ap.add_argument("--rounds", type=int, default=15, help="sync cloud rounds")
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--cells", type=int, default=10)
    ap.add_argument("--spread", type=float, default=1.0, help="sigma of the log-normal device speed factor")
    ap.add_argument("--buffer", type=int, default=5, help="K: device results per cell update")
    ap.add_argument("--cloud-buffer", type=int, default=3, help="cell pushes per cloud version")
    ap.add_argument("--max-staleness", type=int, default=40)
    ap.add_argument(
        "--versions", type=int, default=0, help="async cloud versions (0: as many device results as sync used)"
    )
    ap.add_argument("--eval-every", type=int, default=10, help="async: evaluate every N cloud versions")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--max-train", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    if a.quick:
        a.devices, a.cells, a.rounds, a.max_train = 40, 4, 5, 8000
    t0 = time.perf_counter()
    sync = run_simulation(parse_config(config("sync", a.rounds, a)), write_output=False)
    sync_wall = time.perf_counter() - t0
    sc = curve(sync.history)
    target, sync_time = sc[-1][1], sc[-1][0]
    # async gets the device results sync used (rounds x devices), K x cloud buffer of them per version
    versions = a.versions or max(10, a.rounds * a.devices // (a.buffer * a.cloud_buffer))
    t1 = time.perf_counter()
    found: list[float] = []

    def stop_when_reached(record: dict) -> None:
        if record.get("accuracy", 0.0) >= target and not found:
            found.append(record["clock_s"])

    asy = run_simulation(parse_config(config("async", versions, a)), write_output=False, on_round=stop_when_reached)
    async_wall = time.perf_counter() - t1
    ac = curve(asy.history)
    print(
        f"{a.dataset}, {a.devices} devices in {a.cells} cells (iid, {a.max_train} samples), MLP 784-64-10, H=10, "
        f"lr 0.05; clock: 10 steps/s x log-normal(sigma {a.spread}); async K={a.buffer}, cloud buffer "
        f"{a.cloud_buffer}, {versions} versions"
    )
    print(
        f"\nsync ({a.rounds} rounds, {sync_wall:.0f} s wall)      async ({len(asy.history)} versions, "
        f"{async_wall:.0f} s wall)"
    )
    print(f"{'virtual s':>10} {'accuracy':>9}      {'virtual s':>10} {'accuracy':>9}")
    step = max(1, len(ac) // max(1, len(sc)))
    rows = max(len(sc), len(ac[::step]))
    for i in range(rows):
        left = f"{sc[i][0]:>10.1f} {sc[i][1]:>9.3f}" if i < len(sc) else " " * 20
        right = f"{ac[i * step][0]:>10.1f} {ac[i * step][1]:>9.3f}" if i * step < len(ac) else ""
        print(f"{left}      {right}")
    if found:
        print(
            f"\nsync's final accuracy {target:.3f} at {sync_time:.1f} virtual s; async reaches it at "
            f"{found[0]:.1f} s: ratio {found[0] / sync_time:.2f} (target <= 0.5)"
        )
    else:
        print(
            f"\nasync did not reach sync's final accuracy {target:.3f} within {ac[-1][0]:.1f} virtual s "
            f"(best {max(x for _, x in ac):.3f})"
        )


if __name__ == "__main__":
    main()
