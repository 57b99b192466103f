"""Synchronous vs buffered asynchronous (FedBuff) hierarchical FedAvg: accuracy vs virtual time with stragglers.

fedtier sim, MNIST (``--max-train`` samples, iid), 200 devices in 10 cells, MLP 784-64-10, H = 10 local
steps, batch 16, lr 0.05; ``[clock]``: 10 steps/s per device times a seeded log-normal factor
(``device_speed_spread``, sigma 1 by default), 1 MB/s device links, 10 MB/s backhaul, 20 ms latency.

Sync gets the same tuning effort as async: E = 1 edge round per cloud round, every device planned every round,
over a grid of device deadlines (``runtime.device_deadline``, virtual seconds) and quorums (``runtime.quorum``,
the fraction of a cell's devices it waits for): the usual fixes for stragglers, which drop the slow devices'
results. The untuned setting (no deadline, quorum 1: a round waits for the slowest device of every cell) runs
``--rounds`` rounds; its final accuracy is the target and its virtual time T the budget of every other setting.
Each setting prints its rounds, its virtual time to the target and its accuracy at T. Async: K = ``--buffer``
results per cell update, a push every cell update, a cloud version every ``--cloud-buffer`` pushes, staleness
weight 1/sqrt(1+s). The headline is async's time to the target over the best sync setting's (and over the
untuned one's).

    .venv/bin/python benchmarks/async.py [--quick] [--rounds 15] [--spread 1.0] [--deadlines 6,3,2] [--quorums 1,0.75]

``--cell-processes N`` instead times the async setting alone (``--versions``, default 40) in one process and with
``runtime.cell_processes = N``, alternated ``--repeat`` times: the main process's CPU a cloud version (between the
first version and the last: start-up apart), the wall time, and whether the two final models are the same bits.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import SimHierarchy  # noqa: E402

DEADLINES = [0.0, 6.0, 3.0, 2.0]  # virtual s a cell waits for its devices (0: no deadline); median device ~1.4 s
QUORUMS = [1.0, 0.9, 0.75, 0.5]


def config(mode: str, rounds: int, a: argparse.Namespace, deadline: float = 0.0, quorum: float = 1.0) -> dict:
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
        "runtime": {
            "device_deadline": deadline or 1e6,
            "quorum": quorum,
            "eval_every": 1 if mode == "sync" else a.eval_every,
        },
        "clock": {
            "device_steps_per_s": 10.0,
            "device_speed_spread": a.spread,
            "downlink_bytes_per_s": 1e6,
            "uplink_bytes_per_s": 1e6,
            "backhaul_bytes_per_s": 1e7,
            "latency_s": 0.02,
        },
    }


def time_to(points: list[tuple[float, float]], target: float) -> float | None:
    """The first virtual time at which the accuracy reached ``target`` (None: never)."""
    return next((t for t, acc in points if acc >= target), None)


def at_time(points: list[tuple[float, float]], budget: float) -> float:
    """The accuracy of the last evaluation at or before virtual time ``budget``."""
    before = [acc for t, acc in points if t <= budget + 1e-9]
    return before[-1] if before else float("nan")


def timed_run(
    a: argparse.Namespace,
    mode: str,
    rounds: int,
    deadline: float = 0.0,
    quorum: float = 1.0,
    budget: float = 0.0,
    target: float | None = None,
) -> dict:
    """One setting: ``rounds`` rounds (async: cloud versions), or fewer when its virtual time passes ``budget``
    (> 0) or, with ``target``, once the accuracy reached it."""
    sim = SimHierarchy(parse_config(config(mode, rounds, a, deadline, quorum)), write_output=False)
    points: list[tuple[float, float]] = []

    done = [0]  # rounds (async: cloud versions) completed

    def on_round(rec: dict) -> None:
        done[0] += 1
        if "accuracy" in rec:
            points.append((rec["clock_s"], rec["accuracy"]))
        if budget and rec["clock_s"] >= budget:
            sim.cloud.request_stop("time budget")
        elif target is not None and points and points[-1][1] >= target:
            sim.cloud.request_stop("reached the target")

    sim.cloud.on_round = on_round
    t0 = time.perf_counter()
    sim.run()
    return {
        "deadline": deadline,
        "quorum": quorum,
        "points": points,
        "rounds": done[0],
        "wall": time.perf_counter() - t0,
    }


def split_cpu(a: argparse.Namespace) -> None:
    """``--cell-processes``: the async setting in one process vs in ``a.cell_processes`` cell processes, alternated."""
    import numpy as np

    versions = a.versions or 40
    finals: dict[int, list[bytes]] = {}
    for _ in range(a.repeat):
        for n in (0, a.cell_processes):
            cfg = config("async", versions, a)
            cfg["runtime"]["cell_processes"] = n
            sim = SimHierarchy(parse_config(cfg), write_output=False)
            cpu: list[float] = []
            sim.cloud.on_round = lambda _rec, cpu=cpu: cpu.append(time.process_time())
            t0 = time.perf_counter()
            result = sim.run()
            wall = time.perf_counter() - t0
            per = (cpu[-1] - cpu[0]) / (len(cpu) - 1)
            finals.setdefault(n, []).append(b"".join(np.ascontiguousarray(v).tobytes() for v in result.params.values()))
            print(
                f"cell_processes {n}: {len(cpu)} versions, main-process CPU {per * 1000:.1f} ms a version, "
                f"{wall:.1f} s wall, final accuracy {result.final_accuracy:.4f}",
                flush=True,
            )
    same = len({f for runs in finals.values() for f in runs}) == 1
    print(f"final models the same bits in every run: {'yes' if same else 'NO'}")


def _fmt(t: float | None) -> str:
    return f"{t:.1f}" if t is not None else "never"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 devices in 4 cells, 5 sync rounds")
    ap.add_argument("--rounds", type=int, default=15, help="rounds of the untuned sync setting (the target's)")
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--cells", type=int, default=10)
    ap.add_argument("--spread", type=float, default=1.0, help="sigma of the log-normal device speed factor")
    ap.add_argument("--deadlines", default=",".join(f"{d:g}" for d in DEADLINES), help="sync grid, 0: none")
    ap.add_argument("--quorums", default=",".join(f"{q:g}" for q in QUORUMS), help="sync grid")
    ap.add_argument("--max-rounds", type=int, default=0, help="cap of a tuned sync setting (0: 20 x --rounds)")
    ap.add_argument(
        "--to-target",
        action="store_true",
        help="stop each setting at the target (cheaper; its final accuracy is then the one at that round) "
        "instead of at the untuned setting's virtual time T",
    )
    ap.add_argument("--buffer", type=int, default=5, help="K: device results per cell update")
    ap.add_argument("--cloud-buffer", type=int, default=3, help="cell pushes per cloud version")
    ap.add_argument("--max-staleness", type=int, default=40)
    ap.add_argument(
        "--versions", type=int, default=0, help="async cloud versions cap (0: 20x the device results untuned sync used)"
    )
    ap.add_argument("--eval-every", type=int, default=2, help="async: evaluate every N cloud versions")
    ap.add_argument("--dataset", default="mnist")
    ap.add_argument("--max-train", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cell-processes", type=int, default=0, help="time async alone: 1 process vs N cell processes")
    ap.add_argument("--repeat", type=int, default=3, help="--cell-processes: alternations")
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    if a.cell_processes:
        split_cpu(a)
        return
    if a.quick:
        a.devices, a.cells, a.rounds, a.max_train = 40, 4, 5, 8000
    deadlines = [float(x) for x in a.deadlines.split(",")]
    quorums = [float(x) for x in a.quorums.split(",")]
    t0 = time.perf_counter()
    base = timed_run(a, "sync", a.rounds)
    target, budget = base["points"][-1][1], base["points"][-1][0]
    print(
        f"{a.dataset}, {a.devices} devices in {a.cells} cells (iid, {a.max_train} samples), MLP 784-64-10, H=10, "
        f"lr 0.05; clock: 10 steps/s x log-normal(sigma {a.spread}); untuned sync: {a.rounds} rounds, final "
        f"accuracy {target:.3f} (the target) at {budget:.1f} virtual s (the budget T)",
        flush=True,
    )
    stop_at = target if a.to_target else None
    runs = [base]
    for d in deadlines:
        for q in quorums:
            if d or q < 1:
                runs.append(timed_run(a, "sync", a.max_rounds or 20 * a.rounds, d, q, budget, stop_at))
                r = runs[-1]
                print(
                    f"  sync deadline {d or 'none'} quorum {q:g}: {r['rounds']} rounds, to target "
                    f"{_fmt(time_to(r['points'], target))} s, accuracy at T {at_time(r['points'], budget):.3f} "
                    f"({r['wall']:.0f} s wall)",
                    flush=True,
                )
    sync_wall = time.perf_counter() - t0
    # async runs to the same budget T (or the target); its version cap: 20x the device results the untuned sync used
    versions = a.versions or max(10, 20 * a.rounds * a.devices // (a.buffer * a.cloud_buffer))
    asy = timed_run(a, "async", versions, budget=budget, target=stop_at)
    async_wall, ac = asy["wall"], asy["points"]
    print(
        f"\nsync grid: deadlines {deadlines} (0: none) x quorums {quorums}, {len(runs)} settings, {sync_wall:.0f} s "
        f"wall; async K={a.buffer}, cloud buffer {a.cloud_buffer}, {versions} versions, {async_wall:.0f} s wall"
    )
    at_t = f"accuracy at T = {budget:.1f} s" + (" (or at the stop)" if a.to_target else "")
    print(f"\n| setting | rounds | virtual s to {target:.3f} | {at_t} | final accuracy |")
    print("|---|---|---|---|---|")
    rows = []
    for r in runs:
        p = r["points"]
        name = f"sync, deadline {r['deadline'] or 'none'}, quorum {r['quorum']:g}"
        rows.append((name, time_to(p, target)))
        print(f"| {name} | {r['rounds']} | {_fmt(rows[-1][1])} | {at_time(p, budget):.3f} | {p[-1][1]:.3f} |")
    t_async = time_to(ac, target)
    print(
        f"| async (FedBuff) | {asy['rounds']} versions | {_fmt(t_async)} | {at_time(ac, budget):.3f} | "
        f"{ac[-1][1]:.3f} |"
    )
    reached = [(t, i) for i, (_, t) in enumerate(rows) if t is not None]
    best_t, i = min(reached)
    edge = [
        what
        for what, v, grid in (("deadline", runs[i]["deadline"], deadlines), ("quorum", runs[i]["quorum"], quorums))
        if v and len(grid) > 1 and v == min(x for x in grid if x)
    ]
    print(
        f"\nbest sync: {rows[i][0]}, {best_t:.1f} virtual s to {target:.3f}"
        + (f" (EDGE: the grid's smallest {' and '.join(edge)}; widen it)" if edge else "")
    )
    if t_async is None:
        print(f"async did not reach {target:.3f} within {ac[-1][0]:.1f} virtual s (best {max(x for _, x in ac):.3f})")
    else:
        print(
            f"async reaches {target:.3f} at {t_async:.1f} virtual s: ratio {t_async / best_t:.2f} against the best "
            f"sync setting ({t_async / budget:.2f} against the untuned one)"
        )


if __name__ == "__main__":
    main()
