"""FedMRN vs uplink codecs on Fashion-MNIST (non-IID, hierarchical: cells of devices).

Runs hierarchical FedAvg (dense, SignSGD, top-k, QSGD uplinks) and FedMRN / FedMRN-S through
``fedtier sim`` and prints final accuracy, best accuracy and the measured device -> cell bytes per
device-round (whole messages: envelope, metadata, data) with the bits per model parameter they mean.

Two presets (``--model``): ``cnn`` (default; closer to the paper: the small CNN, Dirichlet 0.1, 2 cells x
10 devices, 2 local epochs) and ``mlp`` (the earlier setup: MLP 784-200-10, Dirichlet 0.3, 2 x 5 devices,
1 local epoch). Every other option overrides the preset.

    /work/main/.venv/bin/python benchmarks/fedmrn.py              # defaults (cnn, 3 seeds, 2 jobs): see README
    /work/main/.venv/bin/python benchmarks/fedmrn.py --model mlp  # the earlier MLP table
    /work/main/.venv/bin/python benchmarks/fedmrn.py --rounds 3 --max-train 2000 --seeds 0   # smoke run
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols.config import parse_config  # noqa: E402
from sim.launcher import run_simulation  # noqa: E402

# preset -> shared settings; every key is also a command-line option
PRESETS: dict[str, dict] = {
    "cnn": {"channels": "16,32", "fc": 128, "hidden": 200, "cells": 2, "devices": 10, "partition": "dirichlet",
            "dirichlet": 0.1, "rounds": 15, "edge_rounds": 1, "local_epochs": 2.0, "max_train": 6000, "max_test": 2000},
    "mlp": {"channels": "16,32", "fc": 128, "hidden": 200, "cells": 2, "devices": 5, "partition": "dirichlet",
            "dirichlet": 0.3, "rounds": 30, "edge_rounds": 2, "local_epochs": 1.0, "max_train": 12000, "max_test": 0},
}

# preset -> method -> [algorithm] section (on top of the shared local-training keys).
# lr and alpha: the best of short sweeps on the same grid for every method (see benchmarks/README.md).
METHODS: dict[str, dict[str, dict]] = {
    "cnn": {
        "FedAvg": {"name": "fedavg", "lr": 0.2},
        "FedMRN": {"name": "fedmrn", "lr": 0.2, "alpha": 0.2},
        "FedMRN-S": {"name": "fedmrn", "lr": 0.4, "alpha": 0.05, "signed": True},
        "SignSGD": {"name": "fedavg", "lr": 0.1, "uplink": "signsgd"},
        "SignSGD scaled": {"name": "fedavg", "lr": 0.1, "uplink": "signsgd", "signsgd_mode": "scaled"},
        "FedAvg w. SM": {"name": "fedavg", "lr": 0.1, "uplink": "fedmrn", "mrn_alpha": 0.1},
        "Top-3%": {"name": "fedavg", "lr": 0.1, "uplink": "topk", "topk_fraction": 0.03},
    },
    "mlp": {
        "FedAvg": {"name": "fedavg", "lr": 0.1},
        "FedMRN": {"name": "fedmrn", "lr": 0.1, "alpha": 0.1},
        "FedMRN-S": {"name": "fedmrn", "lr": 0.1, "alpha": 0.05, "signed": True},
        "SignSGD": {"name": "fedavg", "lr": 0.1, "uplink": "signsgd"},
        "SignSGD scaled": {"name": "fedavg", "lr": 0.1, "uplink": "signsgd", "signsgd_mode": "scaled"},
        "Top-3%": {"name": "fedavg", "lr": 0.1, "uplink": "topk", "topk_fraction": 0.03},
        "QSGD s=1": {"name": "fedavg", "lr": 0.1, "uplink": "qsgd", "qsgd_levels": 1},
        "FedAvg w. SM": {"name": "fedavg", "lr": 0.1, "uplink": "fedmrn", "mrn_alpha": 0.1},
    },
}


def config(method: str, args: argparse.Namespace, overrides: dict, seed: int) -> dict:
    """The run configuration of one method and seed."""
    alg = {"edge_rounds": args.edge_rounds, "local_epochs": args.local_epochs, "batch_size": args.batch_size,
           **METHODS[args.model][method], **overrides.get(method, {}), **overrides.get("*", {})}
    model = {"name": args.model, "hidden": [args.hidden]} if args.model == "mlp" else {
        "name": "cnn", "channels": [int(c) for c in args.channels.split(",")], "fc": args.fc}
    data = {"dataset": args.dataset, "partition": args.partition, "max_train": args.max_train,
            "max_test": args.max_test}
    data.update({"alpha": args.dirichlet} if args.partition == "dirichlet" else
                {"shards_per_device": args.shards} if args.partition == "shards" else {})
    return {"run": {"name": "bench-fedmrn", "seed": seed, "rounds": args.rounds},
            "topology": {"cells": args.cells, "devices_per_cell": args.devices},
            "algorithm": alg, "model": model, "data": data}


def run(method: str, raw: dict) -> dict:
    """Run one configuration; accuracy, bytes and time of the run."""
    t0 = time.perf_counter()
    result = run_simulation(parse_config(raw), write_output=False)
    accs = [r["accuracy"] for r in result.history if "accuracy" in r]
    device_rounds = sum(len(r["answered"]) for r in result.cell_records)
    up = result.history[-1]["cumulative_bytes"]["device_to_cell"]
    n_params = sum(v.size for v in result.params.values())
    return {"method": method, "acc": accs[-1], "best": max(accs), "last5": sum(accs[-5:]) / len(accs[-5:]),
            "bytes": up / device_rounds, "bpp": 8 * up / device_rounds / n_params, "params": n_params,
            "s": time.perf_counter() - t0,
            "cell_to_cloud": result.history[-1]["cumulative_bytes"]["cell_to_cloud"] / len(result.history)}


def parse_overrides(items: list[str]) -> dict[str, dict]:
    """``[METHOD:]key=value`` items -> method (or ``*``) -> {key: value}."""
    out: dict[str, dict] = {}
    for item in items:
        target, _, kv = item.rpartition(":") if ":" in item.partition("=")[0] else ("*", "", item)
        k, _, v = kv.partition("=")
        value: object = v
        if v in ("true", "false"):
            value = v == "true"
        else:
            try:
                value = int(v) if v.lstrip("-").isdigit() else float(v)
            except ValueError:
                pass
        out.setdefault(target, {})[k] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=list(PRESETS), default="cnn", help="preset (see the module docstring)")
    ap.add_argument("--channels", help="cnn: conv channels c1,c2")
    ap.add_argument("--fc", type=int, help="cnn: hidden fully connected width")
    ap.add_argument("--hidden", type=int, help="mlp: hidden width")
    ap.add_argument("--cells", type=int)
    ap.add_argument("--devices", type=int, help="devices per cell")
    ap.add_argument("--partition", choices=["dirichlet", "shards", "iid"])
    ap.add_argument("--dirichlet", type=float, help="Dirichlet concentration")
    ap.add_argument("--shards", type=int, default=2, help="shards per device (--partition shards)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--edge-rounds", type=int)
    ap.add_argument("--local-epochs", type=float)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--max-train", type=int)
    ap.add_argument("--max-test", type=int, help="0: the whole test set")
    ap.add_argument("--seeds", default="0,1,2", help="run seeds (data split, init, sampling); means are printed")
    ap.add_argument("--methods", help="comma-separated subset of the preset's methods")
    ap.add_argument("--set", action="append", default=[],
                    help="algorithm override [METHOD:]key=value (all methods without METHOD:)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel (each single-threaded)")
    args = ap.parse_args()
    for k, v in PRESETS[args.model].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    default = [m for m in METHODS[args.model] if not (args.model == "cnn" and m == "Top-3%")]  # time budget
    methods = [m.strip() for m in (args.methods.split(",") if args.methods else default)]
    unknown = [m for m in methods if m not in METHODS[args.model]]
    if unknown:
        ap.error(f"unknown methods {unknown}; {args.model} has {', '.join(METHODS[args.model])}")
    overrides = parse_overrides(args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"{'method':<16}{'final acc':>10}{'last-5 acc':>11}{'best acc':>10}{'up B/dev-round':>16}{'bits/param':>12}"
          f"{'cell->cloud B/round':>21}{'time s':>8}", flush=True)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {m: [pool.submit(run, m, config(m, args, overrides, s)) for s in seeds] for m in methods}
        rows = []
        for method, fs in futures.items():
            runs = [f.result() for f in fs]
            r = {k: (sum(x[k] for x in runs) / len(runs) if k != "method" else runs[0][k]) for k in runs[0]}
            r["s"] = sum(x["s"] for x in runs)
            rows.append(r)
            seeds_txt = " ".join(f"{100 * x['acc']:.2f}" for x in runs)
            print(f"{r['method']:<16}{100 * r['acc']:>10.2f}{100 * r['last5']:>11.2f}{100 * r['best']:>10.2f}"
                  f"{r['bytes']:>16.0f}{r['bpp']:>12.3f}{r['cell_to_cloud']:>21.0f}{r['s']:>8.1f}"
                  f"   final per seed: {seeds_txt}", flush=True)
    print(f"model parameters: {rows[0]['params']:.0f}; accuracies: means over seeds {args.seeds}; device->cell bytes "
          f"are whole messages (envelope, metadata, data) as counted by the cells; wall {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
