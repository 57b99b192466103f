"""The cohort engine on a GPU (issue #33): three workloads, each side in its own process, in one run.

Workloads (MNIST, pixel/256, IID partition, MLP with ``torch.manual_seed(0)``-style zoo init, one torch
thread on the host, no run files written):

- ``standard``: ``benchmarks/overhead.py``'s: 100 devices, 10 a round (seeded), 1 epoch of batch 32
  (19 steps) at lr 0.05, MLP 784-200-200-10, evaluation every round;
- ``small``: overhead's small: 5 devices (all), 5 steps of batch 16 at lr 0.05, MLP 784-64-10,
  evaluation every 100 rounds;
- ``large``: 10 cells x 100 devices, every device every round, 60 samples each, 5 local epochs of
  batch 10 (30 steps) at lr 0.05, MLP 784-200-200-10, evaluation every round.

Sides: ``bare-cpu``/``bare-cuda`` (a plain sequential PyTorch loop, data on the device),
``device-cpu``/``device-cuda`` (the per-device engine), ``cohort-cpu``, ``cohort-cuda`` (cohort_size
64; its plain-SGD calls replayed as CUDA graphs, ``protocols/cohort_graphs.py``), ``cohort-cuda-eager`` (the
same with the graphs off: each kernel launched from Python), ``cohort-cuda-1000`` (cohort_size 1000), ``cohort-auto``
(``runtime.device = "auto"``: the engine's own choice, logged), and ``cohort-cpu-w2``, ``cohort-cuda-w4``,
``cohort-cuda-w8``, ``cohort-cuda-w12`` (cohort_size 64 in ``runtime.sim_workers`` = 2/4/8/12 worker
processes: each trains its share of a round's devices as cohorts on its own engine, the devices' task
decoding and result encoding with it; the cells and the cloud stay in the main process), and ``cohort-cpu-c2``,
``cohort-cpu-c4``, ``cohort-cuda-c4``, ``cohort-cuda-c10`` (``runtime.cell_processes`` = 2/4/10: the cells, with
their devices, their training and all their messages' host work, in processes of their own; the cloud in the main
process).
Where the cells sum their devices' results (``runtime.cell_sums``): a cohort side leaves it to ``auto`` (on the
engine's GPU for a CUDA side, on the host for a CPU side); ``-host`` sums on the host (``cohort-cuda-host``,
``cohort-cuda-w4-host``: the A/B of the cells' sums on the GPU), ``-engine`` on the engine's device even on the
CPU (``cohort-cpu-engine``: what torch on the CPU would cost).
A CUDA side is skipped (and said so) where torch sees no GPU.
Each workload's first ``--warmup`` rounds are not timed; rounds/s and device-steps/s count the timed
rounds' own wall time (the sum of their durations); ``cpu s/rd`` is the main process's CPU time a
timed round (the steadier figure on a busy machine; for a CUDA side, the host's share), ``tree cpu`` that of the
whole process tree (the main process and its sim workers: what the workers add). ``kernel s/rd`` is
the wall time a timed round spends inside the batched kernels (the cohort engine's ``CohortEngine.run``, the
per-device engine's ``TorchTrainer.sgd``, the cloud's evaluation; each ends in a device-to-host transfer, so
a GPU's queue is drained), ``host s/rd`` the rest of the round (decoding and framing messages, the roles'
Python, the cells' and the cloud's result handling): what a GPU cannot speed up; ``host cpu`` the same split
of the CPU time (``cpu s/rd`` less the kernels' CPU time: the steadier figure on a busy machine). Peak host memory
is the child's max RSS, peak device memory ``torch.cuda.max_memory_allocated``. The targets are
printed as ``RATIO`` lines of rounds/s (a ratio whose sides did not both run is left out).

``--breakdown`` also prints, per run, the wall and CPU seconds a round of each part of ``TIMED`` (the host
side's parts: where it goes). ``--cells N`` runs the large workload with N cells of its 100 devices.

Usage: python benchmarks/gpu.py [--workloads standard,small,large] [--sides cohort-cuda,...]
       [--rounds N] [--warmup N] [--repeat N] [--cells N] [--breakdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKLOADS: dict[str, dict] = {
    "standard": {
        "cells": 1,
        "devices": 100,
        "per_round": 10,
        "hidden": [200, 200],
        "epochs": 1,
        "steps": 0,
        "batch": 32,
        "lr": 0.05,
        "eval_every": 1,
        "rounds": 10,
        "sides": [
            "bare-cpu",
            "bare-cuda",
            "device-cpu",
            "cohort-cpu",
            "cohort-cuda",
            "cohort-cuda-eager",
            "cohort-auto",
        ],
    },
    "small": {
        "cells": 1,
        "devices": 5,
        "per_round": 5,
        "hidden": [64],
        "epochs": 0,
        "steps": 5,
        "batch": 16,
        "lr": 0.05,
        "eval_every": 100,
        "rounds": 300,
        "sides": ["cohort-cpu", "cohort-cuda", "cohort-auto"],
    },
    "large": {
        "cells": 10,
        "devices": 1000,
        "per_round": 1000,
        "hidden": [200, 200],
        "epochs": 5,
        "steps": 0,
        "batch": 10,
        "lr": 0.05,
        "eval_every": 1,
        "rounds": 2,
        "samples": 60,  # the devices' partitions: --cells 2 runs the same shape with 200 devices
        "sides": [
            "device-cpu",
            "cohort-cpu",
            "cohort-cpu-w2",
            "cohort-cpu-engine",
            "cohort-cuda",
            "cohort-cuda-host",
            "cohort-cuda-1000",
            "cohort-cuda-w4",
            "cohort-cuda-w4-host",
            "cohort-cuda-w8",
            "cohort-cuda-w12",
            "cohort-auto",
            "cohort-cpu-c2",
            "cohort-cpu-c4",
            "cohort-cuda-c4",
            "cohort-cuda-c10",
        ],
    },
}
SIDES = [
    "bare-cpu",
    "bare-cuda",
    "device-cpu",
    "device-cuda",
    "cohort-cpu",
    "cohort-cpu-engine",
    "cohort-cuda",
    "cohort-cuda-eager",
    "cohort-cuda-host",
    "cohort-cuda-1000",
    "cohort-auto",
    "cohort-cpu-w2",
    "cohort-cuda-w4",
    "cohort-cuda-w4-host",
    "cohort-cuda-w8",
    "cohort-cuda-w12",
    "cohort-cpu-c2",
    "cohort-cpu-c4",
    "cohort-cuda-c4",
    "cohort-cuda-c10",
]
# the targets (issue #33): (workload, numerator side, denominator side)
RATIOS = [
    ("large", "cohort-cuda", "device-cpu"),
    ("large", "cohort-cuda-1000", "device-cpu"),
    ("large", "cohort-cpu", "device-cpu"),
    ("large", "cohort-auto", "device-cpu"),
    ("large", "cohort-cuda-w4", "device-cpu"),
    ("large", "cohort-cuda-w8", "device-cpu"),
    ("large", "cohort-cuda-w12", "device-cpu"),
    ("large", "cohort-cuda-w8", "cohort-cuda"),
    ("large", "cohort-cpu-w2", "cohort-cpu"),
    ("large", "cohort-cuda", "cohort-cuda-host"),  # the cells' sums on the GPU vs on the host
    ("large", "cohort-cuda-w4", "cohort-cuda-w4-host"),
    ("large", "cohort-cpu-engine", "cohort-cpu"),  # ... and on torch's CPU device vs numpy
    ("large", "cohort-cuda-c4", "device-cpu"),  # the cells in 4 and 10 processes of their own
    ("large", "cohort-cuda-c10", "device-cpu"),
    ("large", "cohort-cuda-c10", "cohort-cuda"),
    ("large", "cohort-cuda-c4", "cohort-cuda-w4"),
    ("large", "cohort-cpu-c2", "cohort-cpu"),
    ("standard", "cohort-cuda", "bare-cpu"),
    ("standard", "cohort-auto", "bare-cpu"),
    ("standard", "cohort-cuda", "cohort-cuda-eager"),  # the plain-SGD calls as CUDA graphs vs launched one by one
    ("standard", "cohort-cpu", "device-cpu"),
    ("small", "cohort-auto", "cohort-cpu"),
    ("small", "cohort-cuda", "cohort-cpu"),
]


def samples_per_device(w: dict) -> int:
    return w.get("samples") or 60000 // w["devices"]


def with_cells(w: dict, cells: int) -> dict:
    """``w`` with ``cells`` cells of the same size (the large workload's shape, fewer devices: a quicker
    profile); ``w`` itself for 0."""
    if not cells:
        return w
    per_cell = w["devices"] // w["cells"]
    return {**w, "cells": cells, "devices": cells * per_cell, "per_round": min(w["per_round"], cells * per_cell)}


def steps_per_device(w: dict) -> int:
    n = samples_per_device(w)
    return w["steps"] or w["epochs"] * -(-n // w["batch"])


def label(side: str) -> str:
    """A side's name in the RATIO lines: ``cohort cuda 1000``, ``per-device cpu``."""
    return side.replace("device-", "per-device-").replace("-", " ").replace("per device", "per-device")


def uses_cuda(side: str) -> bool:
    return "cuda" in side


def cell_processes(side: str) -> int:
    """A side's ``runtime.cell_processes`` (its ``-cN``): ``cohort-cuda-c4`` is 4, ``cohort-cuda`` 0."""
    return next((int(p[1:]) for p in side.split("-")[2:] if p[:1] == "c" and p[1:].isdigit()), 0)


def cohort_side(side: str) -> tuple[str, int, int, str]:
    """A cohort side's torch device, cohort size, sim workers and ``runtime.cell_sums``: ``cohort-cuda-1000`` is
    (cuda, 1000, 0, auto), ``cohort-cuda-w4-host`` (cuda, 64, 4, host); its cell processes: :func:`cell_processes`."""
    _, device, *rest = side.split("-")
    size, workers, sums = 64, 0, "auto"
    for part in rest:
        if part in ("host", "engine"):
            sums = part
        elif part == "eager":  # (CUDA graphs off: child)
            continue
        elif part[:1] == "c" and part[1:].isdigit():
            continue
        elif part.startswith("w"):
            workers = int(part[1:])
        else:
            size = int(part)
    return device, size, workers, sums


def tree_cpu() -> float:
    """CPU seconds of this process and its live multiprocessing children (the sim workers), from /proc
    (Linux); this process's alone elsewhere."""
    import multiprocessing

    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for proc in multiprocessing.active_children():
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14, 15 of stat)
    return total


# ------------------------------------------------------------------------------ the sides (in a child)
def bare(w: dict, rounds: int, device: str, mark: Callable[[], None]) -> list[float]:
    """A plain sequential PyTorch FedAvg loop with the data on ``device``; each round's wall time (and
    ``mark()`` called at each round's end)."""
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    from sim.datasets import load_dataset

    dev = torch.device(device)
    ds = load_dataset("mnist")
    x, y = torch.from_numpy(ds.x_train.copy()).to(dev), torch.from_numpy(ds.y_train.copy()).to(dev)
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(y))
    n, devices, per_round, batch = samples_per_device(w), w["devices"], w["per_round"], w["batch"]
    shards = [torch.from_numpy(perm[i * n : (i + 1) * n]).to(dev) for i in range(devices)]
    torch.manual_seed(0)
    widths = [784, *w["hidden"]]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(widths[-1], 10)).to(dev)
    glob = [p.detach().clone() for p in model.parameters()]
    xt, yt = torch.from_numpy(ds.x_test.copy()).to(dev), torch.from_numpy(ds.y_test.copy()).to(dev)
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        chosen = rng.choice(devices, per_round, replace=False) if per_round < devices else range(devices)
        acc = [torch.zeros_like(p) for p in glob]
        for d in chosen:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
            opt = torch.optim.SGD(model.parameters(), lr=w["lr"])
            steps, s = steps_per_device(w), 0
            while s < steps:
                idx = shards[d][torch.randperm(n, device=dev)]
                for i in range(0, n, batch):
                    if s == steps:
                        break
                    b = idx[i : i + batch]
                    opt.zero_grad()
                    F.cross_entropy(model(x[b]), y[b]).backward()
                    opt.step()
                    s += 1
            with torch.no_grad():
                for a, p in zip(acc, model.parameters()):
                    a.add_(p, alpha=1 / len(chosen))
        glob = acc
        if (r + 1) % w["eval_every"] == 0 or r == rounds - 1:
            with torch.no_grad():
                for p, g in zip(model.parameters(), glob):
                    p.copy_(g)
                float((model(xt).argmax(1) == yt).float().mean())  # synchronises a GPU, as fedtier's does
        times.append(time.perf_counter() - t0)
        mark()
    return times


def fedtier(
    w: dict,
    rounds: int,
    engine: str,
    device: str,
    cohort_size: int,
    mark: Callable[[], None],
    workers: int = 0,
    cell_sums: str = "auto",
    cells_in: int = 0,
) -> list[float]:
    """``fedtier sim`` (in memory, every message encoded) on ``device``, with ``workers`` sim worker processes,
    the cells summing where ``cell_sums`` says and ``cells_in`` cell processes; each round's wall time (and
    ``mark()`` called at each round's end)."""
    from protocols.config import parse_config
    from sim.launcher import run_simulation

    algorithm = {
        "name": "fedavg",
        "edge_rounds": 1,
        "batch_size": w["batch"],
        "lr": w["lr"],
        **({"local_steps": w["steps"]} if w["steps"] else {"local_epochs": w["epochs"]}),
    }
    participation = (
        {"model": "uniform", "per_round": w["per_round"]} if w["per_round"] < w["devices"] else {"model": "always"}
    )
    cfg = parse_config(
        {
            "run": {"name": "gpu-bench", "seed": 0, "rounds": rounds, "output": "/tmp/fedtier-gpu-bench"},
            "topology": {"cells": w["cells"], "devices_per_cell": w["devices"] // w["cells"]},
            "algorithm": algorithm,
            "model": {"name": "mlp", "hidden": w["hidden"]},
            "data": {"dataset": "mnist", "partition": "iid", "max_train": w["devices"] * samples_per_device(w)},
            "participation": participation,
            "runtime": {
                "engine": engine,
                "device": device,
                "cohort_size": cohort_size,
                "sim_workers": workers,
                "cell_sums": cell_sums,
                "cell_processes": cells_in,
                "eval_every": w["eval_every"],
            },
        }
    )
    result = run_simulation(cfg, write_output=False, on_round=lambda _: mark())
    return [r["duration_s"] for r in result.history]


# what each figure times, inclusively: (module, qualified name) of the functions wrapped. "kernels": the batched
# kernels (the cohort engine's calls; the per-device engine's training and everyone's evaluation; the bare loop is not
# split: its kernel s/rd is 0). The rest (--breakdown) are host-side parts: frame and receive (every message's
# encoding, decoding, checks), the in-memory hub's routing (whom a message reaches), the device roles' copies (set/get
# parameters, the delta), the cells' and cloud's aggregation (and inside it their float64 sums, where
# runtime.cell_sums puts them), the engine's batch assembly (inside "kernels": stacking parameters, minibatch indices,
# per-device results), the cloud's evaluation (inside "kernels" too) and the sim workers' executor
TIMED: dict[str, list[tuple[str, str]]] = {
    "kernels": [
        ("protocols.cohort_trainer", "CohortEngine.run"),
        ("protocols.torch_trainer", "TorchTrainer.sgd"),
        ("protocols.torch_trainer", "TorchTrainer.evaluate"),
    ],
    "frame": [("protocols.wire.messenger", "Messenger.frame"), ("protocols.wire.messenger", "Messenger.frame_once")],
    "route": [("protocols.transport.memory", "MemoryHub._route")],  # the in-memory hub's publish: whom it reaches
    "receive": [("protocols.wire.messenger", "Messenger.receive")],
    "device copies": [
        ("protocols.params", "sub"),
        ("protocols.params", "sub_for_wire"),  # (a device's delta, made where its message will be)
        ("protocols.cohort_device", "CohortDeviceTrainer.set_params"),
        ("protocols.cohort_device", "CohortDeviceTrainer.get_params"),
        ("protocols.torch_trainer", "TorchTrainer.set_params"),
        ("protocols.torch_trainer", "TorchTrainer.get_params"),
    ],
    "aggregate": [("protocols.algorithms.fedavg", "aggregate")],
    "sums": [("protocols.params", "weighted_sum")],  # inside "aggregate": the float64 sums (host or device)
    "engine assembly": [
        ("protocols.cohort_trainer", "CohortEngine._stack"),
        ("protocols.cohort_trainer", "_minibatches"),
        ("protocols.cohort_trainer", "step_terms"),
        ("protocols.cohort_trainer", "_answer_sgd"),
    ],
    "evaluate": [("protocols.torch_trainer", "TorchTrainer.evaluate")],
    # sim workers (the -wN sides): the main process's side of handing tasks out and taking results in (the
    # results are decoded in the pipes' reader threads: their CPU time is any thread's while they ran)
    "executor": [
        ("sim.executors", "_Remote.submit"),
        ("sim.executors", "_Remote.flush"),
        ("sim.executors", "_Remote._reply"),
    ],
}


def time_parts(totals: dict[str, list[float]], names: list[str]) -> None:
    """Wrap the functions of ``TIMED[name]`` for each of ``names``: each call's wall and CPU time is added
    to ``totals[name]`` (a part's call inside another of the same part is counted once)."""
    import functools
    import importlib

    def timed(fn, name: str):
        inside = [False]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if inside[0]:
                return fn(*args, **kwargs)
            start, cpu = time.perf_counter(), time.process_time()
            inside[0] = True
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] = False
                totals[name][0] += time.perf_counter() - start
                totals[name][1] += time.process_time() - cpu

        return wrapper

    for name in names:
        totals[name] = [0.0, 0.0]
        for module, qualname in TIMED[name]:
            owner = importlib.import_module(module)
            *path, attr = qualname.split(".")
            for step in path:
                owner = getattr(owner, step)
            setattr(owner, attr, timed(getattr(owner, attr), name))


def child(side: str, workload: str, rounds: int, cells: int = 0, breakdown: bool = False) -> None:
    import logging

    import torch

    from protocols.safe_text import SafeFormatter

    torch.set_num_threads(1)
    if "eager" in side.split("-"):  # the A/B of the cohort engine's CUDA graphs (protocols/cohort_graphs.py)
        import protocols.cohort_graphs

        protocols.cohort_graphs.ENABLED = False
    if (uses_cuda(side) or side.endswith("auto")) and torch.cuda.is_available():
        # the CUDA context and the BLAS handle before the first round, so that a side whose first CUDA work
        # comes late (auto keeping a small cohort on the CPU, the cloud evaluating every 100 rounds) does not
        # time their creation inside its timed rounds
        (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum().item()
    said = logging.StreamHandler()  # the engines' device choices (auto), shown by the parent
    said.setFormatter(SafeFormatter("%(name)s: %(message)s"))
    logging.getLogger("fedtier.device").addHandler(said)
    logging.getLogger("fedtier.device").setLevel(logging.INFO)
    w = with_cells(WORKLOADS[workload], cells)
    totals: dict[str, list[float]] = {}  # part -> [wall s, CPU s] so far
    time_parts(totals, list(TIMED) if breakdown else ["kernels"])
    cpu = [time.process_time()]  # then at each round's end
    tree = [tree_cpu()]  # then at each round's end
    marks = [{k: list(v) for k, v in totals.items()}]  # then at each round's end

    def mark() -> None:
        cpu.append(time.process_time())
        tree.append(tree_cpu())
        marks.append({k: list(v) for k, v in totals.items()})

    if side.startswith("bare"):
        times = bare(w, rounds, side.split("-")[1], mark)
    elif side.startswith("device"):
        times = fedtier(w, rounds, "device", side.split("-")[1], 64, mark)
    else:
        device, size, workers, sums = cohort_side(side)
        times = fedtier(w, rounds, "cohort", device, size, mark, workers, sums, cell_processes(side))
    out = {
        "times": times,
        "cpu": cpu,
        "tree_cpu": tree,
        "parts": marks,
        "peak_host_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_device_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_initialized() else 0.0,
    }
    print("RESULT " + json.dumps(out))


# ------------------------------------------------------------------------------ the parent
def run_side(
    side: str,
    workload: str,
    rounds: int,
    timeout: float,
    cells: int = 0,
    breakdown: bool = False,
) -> dict | str:
    """The child's result, or why there is none."""
    cmd = [sys.executable, __file__, "--child", side, "--workload", workload, "--rounds", str(rounds)]
    cmd += (["--cells", str(cells)] if cells else []) + (["--breakdown"] if breakdown else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    for line in proc.stderr.splitlines():
        if "fedtier.device" in line or "chose" in line:  # the engine's device choice (auto), where the cells sum
            print(f"    [{workload} {side}] {line.strip()}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return f"failed (exit {proc.returncode}): " + (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return json.loads(lines[-1][len("RESULT ") :])


def measure(workload: str, sides: list[str], args: argparse.Namespace, cuda: bool) -> tuple[dict[str, dict], bool]:
    """Run ``workload``'s ``sides`` ``args.repeat`` times, alternating (side A, side B, A, B...: a busy
    machine's load falls on both alike), printing each run; the fastest run of each side, and whether one
    failed."""
    w = with_cells(WORKLOADS[workload], args.cells if workload == "large" else 0)
    timed = args.rounds or w["rounds"]
    steps = w["per_round"] * steps_per_device(w)
    print(
        f"\nworkload {workload}: {w['per_round']} devices x {steps_per_device(w)} steps a round in "
        f"{w['cells']} cell(s), MLP 784-{'-'.join(map(str, w['hidden']))}-10; {args.warmup} warm-up + "
        f"{timed} timed rounds"
    )
    print(
        f"  {'side':21}{'s/round':>10}{'rounds/s':>10}{'steps/s':>11}{'cpu s/rd':>10}{'kernel s/rd':>12}"
        f"{'host s/rd':>10}{'host cpu':>9}{'tree cpu':>9}{'host MB':>9}{'dev MB':>9}"
    )
    runnable = [s for s in sides if (cuda or not uses_cuda(s)) and cell_processes(s) <= w["cells"]]
    for side in sides:
        if side not in runnable:
            why = "no CUDA" if cell_processes(side) <= w["cells"] else f"{w['cells']} cells, fewer than its processes"
            print(f"  {side:21}skipped: {why}")
    best: dict[str, dict] = {}
    failed: set[str] = set()
    for _ in range(args.repeat):
        for side in [s for s in runnable if s not in failed]:
            cells = args.cells if workload == "large" else 0
            out = run_side(side, workload, args.warmup + timed, args.timeout, cells, args.breakdown)
            if isinstance(out, str):
                print(f"  {side:21}{out}")
                failed.add(side)
                continue
            loop = sum(out["times"][args.warmup :])
            out["round_s"], out["rounds_per_s"] = loop / timed, timed / loop
            out["round_cpu_s"] = (out["cpu"][-1] - out["cpu"][args.warmup]) / timed  # the main process's
            out["round_tree_cpu_s"] = (out["tree_cpu"][-1] - out["tree_cpu"][args.warmup]) / timed  # with workers
            first, last = out["parts"][args.warmup], out["parts"][-1]
            out["part_s"] = {k: [(b - a) / timed for a, b in zip(first[k], last[k])] for k in last}  # [wall, CPU]
            out["kernel_s"], kernel_cpu = out["part_s"]["kernels"]
            out["host_s"] = out["round_s"] - out["kernel_s"]
            out["host_cpu_s"] = out["round_cpu_s"] - kernel_cpu  # what a GPU cannot speed up
            out["steps_per_s"] = steps * timed / loop
            if side not in best or out["round_s"] < best[side]["round_s"]:
                best[side] = out
            print(
                f"  {side:21}{out['round_s']:10.4f}{out['rounds_per_s']:10.2f}{out['steps_per_s']:11.0f}"
                f"{out['round_cpu_s']:10.4f}{out['kernel_s']:12.4f}{out['host_s']:10.4f}{out['host_cpu_s']:9.4f}{out['round_tree_cpu_s']:9.3f}"
                f"{out['peak_host_mb']:9.0f}{out['peak_device_mb']:9.0f}"
            )
            if args.breakdown:
                print("    " + "; ".join(f"{k} {w:.4f} s ({c:.4f} CPU)" for k, (w, c) in out["part_s"].items()))
    return best, bool(failed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="standard,small,large", help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--sides", default="", help="comma-separated subset of: " + ", ".join(SIDES))
    ap.add_argument("--rounds", type=int, default=0, help="timed rounds (default: each workload's)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (torch and CUDA warm-up)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each side (alternating); the fastest counts")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a side may run")
    ap.add_argument("--cells", type=int, default=0, help="the large workload with this many cells of 100 devices")
    ap.add_argument(
        "--breakdown", action="store_true", help="also time the host side's parts (frame, receive...) a round"
    )
    ap.add_argument("--json", default="", help="also write the results to this file")
    ap.add_argument("--child", choices=SIDES)
    ap.add_argument("--workload", choices=list(WORKLOADS))
    args = ap.parse_args()
    if args.child:
        child(args.child, args.workload, args.rounds, args.cells, args.breakdown)
        return 0
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    import torch

    cuda = torch.cuda.is_available()
    print(
        f"torch {torch.__version__}, CUDA {'yes: ' + torch.cuda.get_device_name(0) if cuda else 'no'}; "
        f"{os.cpu_count()} CPUs; one torch thread on the host"
    )
    wanted = [s for s in args.sides.split(",") if s]
    unknown = [s for s in wanted if s not in SIDES]
    if unknown:
        ap.error(f"unknown sides {unknown}; choose from {SIDES}")
    report: dict[str, dict[str, dict]] = {}
    failed = False
    for workload in [x for x in args.workloads.split(",") if x]:
        if workload not in WORKLOADS:
            ap.error(f"unknown workload {workload!r}")
        sides = [s for s in WORKLOADS[workload]["sides"] if not wanted or s in wanted]
        report[workload], bad = measure(workload, sides, args, cuda)
        failed = failed or bad
    print()
    for workload, num, den in RATIOS:
        got = report.get(workload, {})
        if num in got and den in got:
            ratio = got[num]["rounds_per_s"] / got[den]["rounds_per_s"]
            on_cpu = got[den]["round_cpu_s"] / max(1e-9, got[num]["round_cpu_s"])
            print(f"RATIO {workload}: {label(num)} / {label(den)} = {ratio:.2f}x  (CPU time a round: {on_cpu:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
