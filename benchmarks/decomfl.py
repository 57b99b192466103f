"""DeComFL vs FedAvg on MNIST over a 2-cell hierarchy: accuracy vs cumulative bytes per device.

Both run through ``fedtier sim`` (2 cells x 5 devices, IID, 4 of the 10 devices take part each round,
MLP). Bytes are whole messages as the runtimes count them (envelope, metadata, data), cell <-> device,
summed over both directions and averaged over the 10 devices. FedAvg uses the same K = 1 local step per
round as DeComFL (the paper's and the spec's comparison; ``--fedavg-steps`` changes it). DeComFL runs for
two model sizes; its per-device bytes must be identical, FedAvg's grow with the model.

    /work/main/.venv/bin/python benchmarks/decomfl.py              # defaults: ~10 minutes on 2 cores
    /work/main/.venv/bin/python benchmarks/decomfl.py --rounds 60 --fedavg-rounds 20 --max-train 5000  # smoke
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import run_simulation  # noqa: E402

DEVICES = 10


def run(name: str, algorithm: dict[str, Any], hidden: int, rounds: int, eval_every: int,
        args: argparse.Namespace) -> dict[str, Any]:
    cfg = parse_config({
        "run": {"name": "bench-decomfl", "seed": args.seed, "rounds": rounds},
        "topology": {"cells": 2, "devices_per_cell": DEVICES // 2},
        "algorithm": algorithm,
        "model": {"name": "mlp", "hidden": [hidden]},
        "data": {"dataset": "mnist", "partition": "iid", "max_train": args.max_train, "max_test": args.max_test},
        "participation": {"model": "uniform", "per_round": args.per_round},
        "runtime": {"eval_every": eval_every},
    })
    t0 = time.perf_counter()
    result = run_simulation(cfg, write_output=False)
    curve = []  # (round, accuracy, mean bytes per device so far)
    for r in result.history:
        if "accuracy" in r:
            b = r["cumulative_bytes"]
            curve.append((r["round"] + 1, r["accuracy"], (b["cell_to_device"] + b["device_to_cell"]) / DEVICES))
    traffic = result.device_traffic
    return {"name": name, "hidden": hidden, "params": sum(v.size for v in result.params.values()),
            "curve": curve, "traffic": traffic, "s": time.perf_counter() - t0,
            "per_device": sum(t["bytes_in"] + t["bytes_out"] for t in traffic.values()) / DEVICES}


def bytes_to_reach(curve: list[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    for rnd, acc, b in curve:
        if acc >= target:
            return rnd, b
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1000, help="DeComFL rounds")
    ap.add_argument("--fedavg-rounds", type=int, default=100)
    ap.add_argument("--fedavg-steps", type=int, default=1, help="FedAvg local steps per round (K)")
    ap.add_argument("--hidden", type=int, nargs=2, default=[32, 128], help="two MLP widths")
    ap.add_argument("--perturbations", type=int, default=10)
    ap.add_argument("--lr", type=float, default=2e-2, help="DeComFL eta")
    ap.add_argument("--direction", default="rademacher", choices=["rademacher", "gaussian"],
                    help="DeComFL directions (rademacher: 6x cheaper to generate in numpy)")
    ap.add_argument("--fedavg-many-steps", type=int, default=20,
                    help="also run FedAvg with this many local steps on the larger model (0: skip)")
    ap.add_argument("--per-round", type=int, default=4)
    ap.add_argument("--max-train", type=int, default=20000)
    ap.add_argument("--max-test", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the curves here")
    args = ap.parse_args()

    zo = {"name": "decomfl", "local_steps": 1, "perturbations": args.perturbations, "lr": args.lr, "mu": 1e-3,
          "batch_size": 64, "direction": args.direction}
    fo = {"name": "fedavg", "local_steps": args.fedavg_steps, "lr": 0.1, "batch_size": 64}
    runs = []
    for h in args.hidden:
        runs.append(run(f"DeComFL h={h}", zo, h, args.rounds, max(1, args.rounds // 20), args))
        print(f"  {runs[-1]['name']}: {runs[-1]['s']:.0f} s", file=sys.stderr, flush=True)
    for h in args.hidden:
        runs.append(run(f"FedAvg h={h}", fo, h, args.fedavg_rounds, max(1, args.fedavg_rounds // 50), args))
        print(f"  {runs[-1]['name']}: {runs[-1]['s']:.0f} s", file=sys.stderr, flush=True)
    if args.fedavg_many_steps:
        h, many = args.hidden[1], {**fo, "local_steps": args.fedavg_many_steps}
        runs.append(run(f"FedAvg K={args.fedavg_many_steps} h={h}", many, h, 20, 1, args))

    print(f"\nMNIST ({args.max_train} train / {args.max_test} test), 2 cells x 5 devices, {args.per_round} "
          f"devices a round, DeComFL K=1 P={args.perturbations} lr={args.lr} {args.direction}, "
          f"FedAvg K={args.fedavg_steps} lr=0.1")
    print(f"{'run':<21}{'params':>9}{'rounds':>8}{'final acc':>11}{'best acc':>10}{'KB/device':>12}{'time s':>8}")
    for r in runs:
        rounds, acc, _ = r["curve"][-1]
        print(f"{r['name']:<21}{r['params']:>9,}{rounds:>8}{acc:>11.4f}{max(a for _, a, _ in r['curve']):>10.4f}"
              f"{r['per_device'] / 1e3:>12.1f}{r['s']:>8.0f}")

    zo_small, zo_large, fo_small, fo_large = runs[:4]
    same = zo_small["traffic"] == zo_large["traffic"]
    print(f"\nDeComFL bytes per device identical for {zo_small['params']:,} and {zo_large['params']:,} params: "
          f"{same} ({zo_small['per_device']:,.0f} vs {zo_large['per_device']:,.0f} B mean per device)")

    print(f"\n{'target acc':>10}  {'FedAvg run':>16}  {'DeComFL round / KB':>20}  {'FedAvg round / KB':>20}  {'ratio':>8}")
    pairs = [(zo_small, fo_small), (zo_large, fo_large)] + [(zo_large, r) for r in runs[4:]]
    for zo_run, fo_run in pairs:
        best = max(a for _, a, _ in zo_run["curve"])
        for target in sorted({round(best - 0.05, 2), round(best - 0.02, 2)}):
            z, f = bytes_to_reach(zo_run["curve"], target), bytes_to_reach(fo_run["curve"], target)
            zs = f"{z[0]:>6} / {z[1] / 1e3:>9.1f}" if z else "not reached"
            fs = f"{f[0]:>6} / {f[1] / 1e3:>9.1f}" if f else "not reached"
            ratio = f"{f[1] / z[1]:>7.0f}x" if z and f else "-"
            print(f"{target:>10.2f}  {fo_run['name']:>16}  {zs:>20}  {fs:>20}  {ratio:>8}")
    if args.json:
        args.json.write_text(json.dumps([{k: v for k, v in r.items() if k != "traffic"} for r in runs], indent=1))


if __name__ == "__main__":
    main()
