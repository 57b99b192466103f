"""FedMRN vs uplink codecs on Fashion-MNIST (Dirichlet non-IID, 2 cells x 5 devices, MLP).

Runs hierarchical FedAvg (dense, SignSGD, top-k, QSGD uplinks) and FedMRN / FedMRN-S through
``fedtier sim`` and prints final accuracy, best accuracy and the measured device -> cell bytes per
device-round (whole messages: envelope, metadata, data) with the bits per model parameter they mean.

    /work/main/.venv/bin/python benchmarks/fedmrn.py            # defaults (3 seeds): about 8 minutes on 2 cores
    /work/main/.venv/bin/python benchmarks/fedmrn.py --rounds 3 --max-train 3000   # smoke run
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import run_simulation  # noqa: E402

# method -> [algorithm] section (on top of the shared local-training keys)
METHODS: dict[str, dict] = {  # alpha and lr: the best of short sweeps (15 rounds; see benchmarks/README.md)
    "FedAvg": {"name": "fedavg", "lr": 0.1},
    "FedMRN": {"name": "fedmrn", "lr": 0.1, "alpha": 0.1},
    "FedMRN-S": {"name": "fedmrn", "lr": 0.1, "alpha": 0.05, "signed": True},
    "SignSGD": {"name": "fedavg", "lr": 0.1, "uplink": "signsgd"},
    "Top-3%": {"name": "fedavg", "lr": 0.1, "uplink": "topk", "topk_fraction": 0.03},
    "QSGD s=1": {"name": "fedavg", "lr": 0.1, "uplink": "qsgd", "qsgd_levels": 1},
    "FedAvg w. SM": {"name": "fedavg", "lr": 0.1, "uplink": "fedmrn", "mrn_alpha": 0.1},
}


def run(method: str, args: argparse.Namespace, overrides: dict, seed: int) -> dict:
    alg = {"edge_rounds": args.edge_rounds, "local_epochs": args.local_epochs, "batch_size": 32,
           **METHODS[method], **overrides}
    cfg = parse_config({
        "run": {"name": "bench-fedmrn", "seed": seed, "rounds": args.rounds},
        "topology": {"cells": 2, "devices_per_cell": 5},
        "algorithm": alg,
        "model": {"name": "mlp", "hidden": [args.hidden]},
        "data": {"dataset": args.dataset, "partition": "dirichlet", "alpha": args.dirichlet,
                 "max_train": args.max_train, "max_test": args.max_test},
    })
    t0 = time.perf_counter()
    result = run_simulation(cfg, write_output=False)
    accs = [r["accuracy"] for r in result.history if "accuracy" in r]
    device_rounds = sum(len(r["answered"]) for r in result.cell_records)
    up = result.history[-1]["cumulative_bytes"]["device_to_cell"]
    n_params = sum(v.size for v in result.params.values())
    return {"method": method, "acc": accs[-1], "best": max(accs), "last5": sum(accs[-5:]) / len(accs[-5:]), "bytes": up / device_rounds,
            "bpp": 8 * up / device_rounds / n_params, "params": n_params, "s": time.perf_counter() - t0,
            "cell_to_cloud": result.history[-1]["cumulative_bytes"]["cell_to_cloud"] / len(result.history)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--edge-rounds", type=int, default=2)
    ap.add_argument("--local-epochs", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=200)
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--dirichlet", type=float, default=0.3)
    ap.add_argument("--max-train", type=int, default=12000)
    ap.add_argument("--max-test", type=int, default=0)
    ap.add_argument("--seeds", default="0,1,2", help="run seeds (data split, init, sampling); means are printed")
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--set", action="append", default=[], help="algorithm override key=value (all methods)")
    args = ap.parse_args()
    overrides = {}
    for item in args.set:
        k, _, v = item.partition("=")
        overrides[k] = float(v) if v.replace(".", "", 1).replace("e-", "", 1).isdigit() else v
    rows = []
    print(f"{'method':<14}{'final acc':>10}{'last-5 acc':>11}{'best acc':>10}{'up B/dev-round':>16}{'bits/param':>12}"
          f"{'cell->cloud B/round':>21}{'time s':>8}", flush=True)
    for method in args.methods.split(","):
        runs = [run(method.strip(), args, overrides, int(s)) for s in args.seeds.split(",")]
        r = {k: (sum(x[k] for x in runs) / len(runs) if k != "method" else runs[0][k]) for k in runs[0]}
        r["s"] = sum(x["s"] for x in runs)
        rows.append(r)
        print(f"{r['method']:<14}{100 * r['acc']:>10.2f}{100 * r['last5']:>11.2f}{100 * r['best']:>10.2f}{r['bytes']:>16.0f}{r['bpp']:>12.3f}"
              f"{r['cell_to_cloud']:>21.0f}{r['s']:>8.1f}", flush=True)
    print(f"model parameters: {rows[0]['params']:.0f}; accuracies: means over seeds {args.seeds}; device->cell bytes "
          "are whole messages (envelope, metadata, data) as counted by the cells")


if __name__ == "__main__":
    main()
