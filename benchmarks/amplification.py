"""Amplified FedAvg (Wang & Ji) under periodic group availability: does amplification beat plain FedAvg?

(a) Spec 8b: synthetic quadratics, 5 groups x 10 clients, each group available 20 rounds (cycle 100),
    S = 5 by regularized selection, I = 5 noisy gradient steps, T = 2000 rounds, 3 seeds; best gamma on a
    grid for FedAvg (eta = 1) and for amplified FedAvg (eta = 10, P = 100). Metric: mean f - f* over the
    last 500 rounds. Uses fedtier's ServerOptimizer and CyclicGroups.
(b) Fashion-MNIST (or MNIST), 50 devices with one majority label each (95 % of their samples, 5 % spread
    i.i.d.), groups = label pairs available K rounds each in turn (cycle P = 5K), S devices per round by
    regularized selection, MLP 784-64-10, I = 5 steps of batch 16. A FedAvg warm-up at gamma0, then plain
    FedAvg, amplified FedAvg (eta = 10, P = cycle) at small gamma, and wait-for-all (every device trains once
    from the same model each cycle; one averaged update per cycle). Runs fedtier's FedAvg roles directly
    (no transport). Evaluated at interval ends (every P rounds) for every method.

    /work/main/.venv/bin/python benchmarks/amplification.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocols import params as P  # noqa: E402
from protocols.algorithms.base import DeviceContext, ModelSpec  # noqa: E402
from protocols.algorithms.fedavg import FedAvg  # noqa: E402
from protocols.algorithms.server_opt import ServerParams, ServerOptimizer  # noqa: E402
from protocols.seeding import rng  # noqa: E402
from protocols.trainer import LocalData  # noqa: E402
from protocols.wire.payload import Payload  # noqa: E402
from sim.participation import CyclicGroups  # noqa: E402


# ------------------------------------------------------------------------------------------ (a) synthetic
def quadratic_run(gamma: float, eta: float, period: int, seed: int, rounds: int = 2000) -> np.ndarray:
    """f(x_t) - f* per round for the spec 8b problem."""
    d, groups, per_group, k, s, steps = 20, 5, 10, 20, 5, 5
    devices = [f"n{i}" for i in range(groups * per_group)]
    avail = CyclicGroups(devices, groups, seed=seed, period=k, per_round=s, selection="permutation")
    g = rng(seed, "quadratic")
    centers = g.standard_normal((groups, d))
    z = centers[avail.group_of] + 0.1 * g.standard_normal((len(devices), d))
    x_star = z.mean(0)
    x = {"x": x_star + 3 * g.standard_normal(d)}
    opt = ServerOptimizer(ServerParams(name="fedavg", local_steps=steps, amplify_eta=eta, amplify_period=period))
    gap = np.empty(rounds)
    for t in range(rounds):
        idx = np.array(sorted(avail.index[dv] for dv in avail.participants(t)))
        noise = rng(seed, t, "noise").standard_normal((steps, len(idx), d))
        y = np.repeat(x["x"][None], len(idx), 0)
        for i in range(steps):
            y -= gamma * ((y - z[idx]) + 0.5 * noise[i])
        x, _ = opt.step(t, x, {"x": (y - x["x"]).mean(0)})
        gap[t] = 0.5 * float(np.sum((x["x"] - x_star) ** 2))  # f - f* for unit quadratics
        if not np.isfinite(gap[t]) or gap[t] > 1e8:
            gap[t:] = np.inf
            break
    return gap


def part_a(seeds: int, rounds: int) -> None:
    grid = [3e-3, 1e-3, 6e-4, 3e-4, 2e-4, 1e-4, 3e-5]
    print(f"\n(a) synthetic periodic groups (spec 8b): mean f-f* over the last {rounds // 4} of {rounds} rounds, "
          f"{seeds} seeds")
    print(f"{'method':<28}" + "".join(f"{g:>10.0e}" for g in grid))
    best = {}
    for name, eta, period in (("FedAvg (eta=1)", 1.0, 0), ("amplified eta=10, P=100", 10.0, 100),
                              ("amplified eta=10, P=20", 10.0, 20)):
        row = []
        for gamma in grid:
            tails = [quadratic_run(gamma, eta, period, s, rounds)[-rounds // 4:].mean() for s in range(seeds)]
            row.append(float(np.mean(tails)))
        best[name] = min(zip(row, grid))
        print(f"{name:<28}" + "".join(f"{v:>10.2e}" if np.isfinite(v) else f"{'diverged':>10}" for v in row))
    for name, (value, gamma) in best.items():
        print(f"  best {name:<26} f-f* = {value:.2e} at gamma = {gamma:g}")
    fed, amp = best["FedAvg (eta=1)"][0], best["amplified eta=10, P=100"][0]
    print(f"  claim (amplified, P = cycle, beats best-tuned FedAvg): {'HOLDS' if amp < fed else 'FAILS'} "
          f"({fed / amp:.1f}x lower f-f*)")


# ------------------------------------------------------------------------------------------ (b) real data
def majority_split(y: np.ndarray, label_of: np.ndarray, per_device: int, similarity: float, seed: int
                   ) -> list[np.ndarray]:
    """Per device: (1 - similarity) of its samples from its majority label, the rest i.i.d. from everything."""
    g = rng(seed, "majority-split")
    pools = {c: list(g.permutation(np.flatnonzero(y == c))) for c in np.unique(y)}
    rest = list(g.permutation(len(y)))
    used: set[int] = set()
    parts = []
    n_major = int(round(per_device * (1 - similarity)))
    for lab in label_of:
        own = [pools[lab].pop() for _ in range(n_major)]
        used.update(own)
        other = []
        while len(other) < per_device - n_major:
            i = rest.pop()
            if i not in used:
                other.append(i)
                used.add(i)
        parts.append(np.array(own + other))
    return parts


class Federation:
    """50 devices, cyclic label-pair groups, FedAvg roles driven in-process (one cell, E = 1)."""

    def __init__(self, dataset: str, devices: int, per_device: int, k: int, s: int, seed: int) -> None:
        from protocols.torch_trainer import TorchTrainer
        from sim.datasets import load_dataset

        ds = load_dataset(dataset)
        self.ids = [f"d{i:02d}" for i in range(devices)]
        self.avail = CyclicGroups(self.ids, 5, seed=seed, period=k, per_round=s, selection="permutation")
        order = np.argsort(self.avail.group_of, kind="stable")  # within a group: half label 2g, half 2g+1
        label_of = np.empty(devices, dtype=np.int64)
        for g in range(5):
            members = order[self.avail.group_of[order] == g]
            label_of[members] = 2 * g + (np.arange(len(members)) % 2)
        parts = majority_split(ds.y_train, label_of, per_device, 0.05, seed)
        self.data = {d: LocalData(ds.x_train[p], ds.y_train[p]) for d, p in zip(self.ids, parts)}
        self.spec = ModelSpec(name="mlp", input_shape=(784,), num_classes=10, hidden=(64,))
        self.trainer = TorchTrainer.from_spec("mlp", (784,), 10, hidden=(64,))
        self.x_test, self.y_test = ds.x_test[:5000], ds.y_test[:5000]
        sel = rng(seed, "train-eval").choice(ds.num_train, 5000, replace=False)
        self.x_tr, self.y_tr = ds.x_train[sel], ds.y_train[sel]
        self.seed, self.cycle = seed, self.avail.cycle

    def algorithm(self, lr: float, eta: float = 1.0, period: int = 0) -> FedAvg:
        params = FedAvg.Params(name="fedavg", local_steps=5, batch_size=16, lr=lr, amplify_eta=eta,
                               amplify_period=period)
        return FedAvg(params, self.spec, self.seed)

    def evaluate(self, model) -> tuple[float, float]:
        self.trainer.set_params(model)
        train_loss, _ = self.trainer.evaluate(self.x_tr, self.y_tr)
        _, test_acc = self.trainer.evaluate(self.x_test, self.y_test)
        return train_loss, test_acc

    def run(self, alg: FedAvg, start: dict, first: int, rounds: int, wait_for_all: bool = False
            ) -> tuple[list[tuple[int, float, float]], dict]:
        """Rounds [first, first + rounds): evaluations (round, train loss, test acc) at every interval end
        (multiples of the cycle), and the final model."""
        cloud, cell, device = alg.cloud(), alg.cell("c0"), alg.device("any")
        cloud.model = P.copy(start)
        evals = []
        for t in range(first, first + rounds):
            if wait_for_all:  # one update per cycle: every device once from the same model
                if (t + 1) % self.cycle:
                    continue
                who = self.ids
            else:
                who = sorted(self.avail.participants(t))
            task = cloud.plan(t, ["c0"])["c0"]
            cell.begin(t, task)
            results: dict[str, Payload] = {}
            for d, dtask in cell.plan(0, who).items():
                ctx = DeviceContext(self.seed, t, 0, "c0", d)
                results[d] = device.train(dtask, self.data[d], self.trainer, ctx)
            cell.aggregate(0, results)
            cloud.aggregate(t, {"c0": cell.report()})
            if (t + 1) % self.cycle == 0:
                evals.append((t + 1, *self.evaluate(cloud.model)))
        return evals, cloud.model



def part_b(dataset: str, warmup: int, rounds: int, k: int, s: int, gamma0: float, seed: int = 0) -> None:
    t0 = time.perf_counter()
    fed = Federation(dataset, 50, 300, k, s, seed)
    print(f"\n(b) {dataset}: 50 devices (one majority label, 5% i.i.d.), 5 label-pair groups x {k} rounds "
          f"(cycle P = {fed.cycle}), S = {s}, MLP 784-64-10, I = 5, batch 16; warm-up {warmup} rounds of FedAvg "
          f"at gamma0 = {gamma0}, then {rounds} rounds ({rounds // fed.cycle} cycles); seed {seed}")
    init = fed.algorithm(gamma0).initial_params()
    warm, cloud_model = fed.run(fed.algorithm(gamma0), init, 0, warmup)
    print(f"  after warm-up: train loss {warm[-1][1]:.4f}, test acc {warm[-1][2]:.4f} "
          f"({time.perf_counter() - t0:.0f} s)")
    settings = [*(("FedAvg", gamma0 / f, 1.0, 0, False) for f in (1, 10, 100)),
                *(("amplified eta=10", gamma0 / f, 10.0, fed.cycle, False) for f in (100, 300, 1000)),
                ("wait-for-all", gamma0, 1.0, 0, True)]
    tail = max(1, (rounds // fed.cycle) // 3)
    print(f"  {'method':<18}{'gamma':>9}{'train loss':>12}{'test acc':>10}{'final loss':>12}{'final acc':>10}"
          f"   (means over the last {tail} interval ends)")
    for name, lr, eta, period, wait in settings:
        ev, _ = fed.run(fed.algorithm(lr, eta, period), cloud_model, warmup, rounds, wait_for_all=wait)
        loss = np.mean([e[1] for e in ev[-tail:]])
        acc = np.mean([e[2] for e in ev[-tail:]])
        print(f"  {name:<18}{lr:>9.0e}{loss:>12.4f}{acc:>10.4f}{ev[-1][1]:>12.4f}{ev[-1][2]:>10.4f}", flush=True)
    print(f"  ({time.perf_counter() - t0:.0f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny settings (a smoke test)")
    ap.add_argument("--dataset", default="fmnist", choices=["fmnist", "mnist"])
    ap.add_argument("--part", default="ab", help="a, b or ab")
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--k", type=int, default=20, help="rounds each group stays available (cycle = 5k)")
    ap.add_argument("--s", type=int, default=5, help="devices per round")
    ap.add_argument("--gamma0", type=float, default=0.05)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if "a" in a.part:
        part_a(1 if a.quick else 3, 400 if a.quick else 2000)
    if "b" in a.part:
        part_b(a.dataset, 100 if a.quick else a.warmup, 200 if a.quick else a.rounds, a.k, a.s, a.gamma0)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
