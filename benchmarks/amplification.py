"""Amplified FedAvg (Wang & Ji) under periodic group availability: does amplification beat plain FedAvg?

(a) Spec 8b: synthetic quadratics, 5 groups x 10 clients, each group available 20 rounds (cycle 100),
    S = 5 by regularized selection, I = 5 noisy gradient steps, T = 2000 rounds, 3 seeds; best gamma on a
    grid for FedAvg (eta = 1) and for amplified FedAvg (eta = 10, P = 100). Metric: mean f - f* over the
    last 500 rounds. Uses fedtier's ServerOptimizer and CyclicGroups.
(b) The paper's experiment E1 on Fashion-MNIST (or MNIST): 250 devices with one majority label each (95 % of
    their samples, 5 % i.i.d.), 5 label-pair groups each available 100 consecutive rounds (cycle 500, random
    offset), S = 10 a round by regularized selection, I = 5 local steps of batch 16, MLP 784-64-10 (the paper:
    a CNN). A FedAvg warm-up at gamma0 = 0.1 (the paper's), then on the same gamma grid (x gamma0) and seeds:
    plain FedAvg, amplified FedAvg (eta = 10, P = 500 = the cycle) and wait-minibatch (every device trains
    once from the same model per cycle, one averaged update per cycle). Metric, the paper's: training loss
    averaged over the last 10 % of the rounds. fedtier's FedAvg roles, each round's devices trained as one
    cohort (the cohort engine's batched SGD).

    python benchmarks/amplification.py --preset quick   # <= 15 min on 2 cores
    python benchmarks/amplification.py --preset paper   # see benchmarks/README.md
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
from protocols.algorithms.server_opt import ServerOptimizer, ServerParams  # noqa: E402
from protocols.seeding import rng  # noqa: E402
from protocols.trainer import LocalData  # noqa: E402
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
    print(
        f"\n(a) synthetic periodic groups (spec 8b): mean f-f* over the last {rounds // 4} of {rounds} rounds, "
        f"{seeds} seeds"
    )
    print(f"{'method':<28}" + "".join(f"{g:>10.0e}" for g in grid))
    best = {}
    for name, eta, period in (
        ("FedAvg (eta=1)", 1.0, 0),
        ("amplified eta=10, P=100", 10.0, 100),
        ("amplified eta=10, P=20", 10.0, 20),
    ):
        row = []
        for gamma in grid:
            tails = [quadratic_run(gamma, eta, period, s, rounds)[-rounds // 4 :].mean() for s in range(seeds)]
            row.append(float(np.mean(tails)))
        best[name] = min(zip(row, grid))
        print(f"{name:<28}" + "".join(f"{v:>10.2e}" if np.isfinite(v) else f"{'diverged':>10}" for v in row))
    for name, (value, gamma) in best.items():
        print(f"  best {name:<26} f-f* = {value:.2e} at gamma = {gamma:g}")
    fed, amp = best["FedAvg (eta=1)"][0], best["amplified eta=10, P=100"][0]
    print(
        f"  claim (amplified, P = cycle, beats best-tuned FedAvg): {'HOLDS' if amp < fed else 'FAILS'} "
        f"({fed / amp:.1f}x lower f-f*)"
    )


# ------------------------------------------------------------------------------------------ (b) real data
def majority_split(
    y: np.ndarray, label_of: np.ndarray, per_device: int, similarity: float, seed: int
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
    """N devices (one majority label each), 5 label-pair groups available ``k`` rounds in turn, S a round by
    regularized selection; fedtier's FedAvg roles (one cell, E = 1) with each round's devices trained as one
    cohort (``edge_agent.cohort.run_cohort``: the cohort engine's batched SGD, roles unchanged)."""

    def __init__(self, dataset: str, devices: int, k: int, s: int, seed: int, hidden: int = 64) -> None:
        from protocols.cohort_trainer import CohortEngine
        from sim.datasets import load_dataset

        ds = load_dataset(dataset)
        self.ids = [f"d{i:03d}" for i in range(devices)]
        self.avail = CyclicGroups(self.ids, 5, seed=seed, period=k, per_round=s, selection="permutation")
        order = np.argsort(self.avail.group_of, kind="stable")  # within a group: half label 2g, half 2g+1
        label_of = np.empty(devices, dtype=np.int64)
        for g in range(5):
            members = order[self.avail.group_of[order] == g]
            label_of[members] = 2 * g + (np.arange(len(members)) % 2)
        per_device = ds.num_train // devices
        parts = majority_split(ds.y_train, label_of, per_device, 0.05, seed)
        self.data = {d: LocalData(ds.x_train[p], ds.y_train[p]) for d, p in zip(self.ids, parts)}
        self.spec = ModelSpec(name="mlp", input_shape=(784,), num_classes=10, hidden=(hidden,))
        self.engine = CohortEngine()
        sel = rng(seed, "train-eval").choice(ds.num_train, 5000, replace=False)
        self.x_tr, self.y_tr = ds.x_train[sel], ds.y_train[sel]
        self.x_test, self.y_test = ds.x_test[:5000], ds.y_test[:5000]
        self.seed, self.cycle, self.per_device = seed, self.avail.cycle, per_device

    def algorithm(self, lr: float, eta: float = 1.0, period: int = 0) -> FedAvg:
        params = FedAvg.Params(
            name="fedavg", local_steps=5, batch_size=16, lr=lr, amplify_eta=eta, amplify_period=period
        )
        return FedAvg(params, self.spec, self.seed)

    def evaluate(self, model) -> tuple[float, float]:
        from protocols.cohort_trainer import Request

        reqs = [
            Request("evaluate", self.spec, model, self.x_tr, self.y_tr),
            Request("evaluate", self.spec, model, self.x_test, self.y_test),
        ]
        self.engine.run(reqs)
        self.engine.forget_data()
        return reqs[0].result[0], reqs[1].result[1]

    def run(
        self, alg: FedAvg, start: dict, first: int, rounds: int, wait_for_all: bool = False, eval_every: int = 0
    ) -> tuple[list[tuple[int, float, float]], dict]:
        """Rounds [first, first + rounds): evaluations (round, train loss, test acc) of the model in place every
        ``eval_every`` rounds (default: every cycle), and the final model. Wait-for-all (the paper's
        wait-minibatch): every device trains once from the same model and the cloud averages all of them once per
        cycle; an evaluation of a model unchanged since the last one repeats that one's figures (no new pass)."""
        from edge_agent.cohort import run_cohort

        cloud, cell, device = alg.cloud(), alg.cell("c0"), alg.device("any")
        cloud.model = P.copy(start)
        evals: list[tuple[int, float, float]] = []
        every = eval_every or self.cycle
        changed = True  # the model moved since the last evaluation
        for t in range(first, first + rounds):
            if wait_for_all and (t + 1) % self.cycle:
                who: list[str] = []
            else:
                who = self.ids if wait_for_all else sorted(self.avail.participants(t))
            if who:
                task = cloud.plan(t, ["c0"])["c0"]
                cell.begin(t, task)
                plan = cell.plan(0, who)
                jobs = [
                    lambda tr, d=d, dt=dt, t=t: device.train(
                        dt, self.data[d], tr, DeviceContext(self.seed, t, 0, "c0", d)
                    )
                    for d, dt in plan.items()
                ]
                outcomes = run_cohort(self.engine, self.spec, jobs, list(plan))
                self.engine.forget_data()
                cell.aggregate(0, {d: res for d, (res, _) in zip(plan, outcomes) if res is not None})
                cloud.aggregate(t, {"c0": cell.report()})
                changed = True
            if (t + 1 - first) % every == 0 or (t + 1 == first + rounds and not evals):
                loss, acc = self.evaluate(cloud.model) if changed or not evals else evals[-1][1:]
                changed = False
                evals.append((t + 1, loss if np.isfinite(loss) else np.inf, acc))
                if not loss < DIVERGED:  # collapsed (NaN or far above a uniform guess's 2.3): stop, it counts as inf
                    evals.append((first + rounds, np.inf, acc))
                    break
        return evals, cloud.model


# ------------------------------------------------------------------------------------------ presets
# phase-2 grid (x gamma0) for every method: the paper's {1, 0.1, 0.01, 0.001, 0.0001} (its Table D.1 winners: FedAvg and
# amplified 1e-4, wait-minibatch 1), widened by 3 at the top and 1e-5 at the bottom so that no winner sits at an edge
FACTORS = [3.0, 1.0, 0.1, 0.01, 0.001, 0.0001, 0.00001]
PRESETS = {
    # the paper: N = 250, S = 10, 100-round stints (cycle 500), I = 5, batch 16, warm-up 2000 rounds at gamma0 = 0.1,
    # 300k rounds, 10 seeds, its CNN; here an MLP and a 5000-round phase 2 (10 cycles)
    "paper": {
        "devices": 250,
        "s": 10,
        "k": 100,
        "warmup": 2000,
        "rounds": 5000,
        "seeds": [0, 1, 2],
        "factors": FACTORS,
        "wait_factors": FACTORS,
    },
    # quick: 20-round stints (cycle 100) so that the last 10 % of 1000 rounds is still one whole cycle
    "quick": {
        "devices": 250,
        "s": 10,
        "k": 20,
        "warmup": 500,
        "rounds": 1000,
        "seeds": [0, 1, 2],
        "factors": FACTORS,
        "wait_factors": FACTORS,
    },
}
DIVERGED = 100.0  # a training loss above this (or NaN) ends a run as diverged
# bumped when what a journal line measures changes (window 2: wait-minibatch's loss averaged over the last 10 % at
# the others' evaluation rounds; window 1 took its one evaluation after the window's last update)
RUN_SEMANTICS = {"window": 2}
GAMMA0 = 0.1  # the paper's Fashion-MNIST warm-up step (best of its grid)


def _fed(dataset: str, s: dict, seed: int) -> Federation:
    return Federation(dataset, s["devices"], s["k"], s["s"], seed)


def warm_up(seed: int, dataset: str, s: dict) -> dict:
    """Phase 1 of ``seed``: FedAvg at gamma0 from the initial model (every phase-2 run of the seed starts here)."""
    fed = _fed(dataset, s, seed)
    init = fed.algorithm(GAMMA0).initial_params()
    _, model = fed.run(fed.algorithm(GAMMA0), init, 0, s["warmup"])
    return model


def phase2(method: str, lr: float, seed: int, dataset: str, s: dict, prepared: dict) -> dict:
    """One phase-2 run from the seed's warm-up model ``prepared``; the paper's metric: training loss averaged over
    the last 10 % of the rounds, every method's model in place evaluated at the same rounds (every 1 % of the
    rounds: wait-minibatch's model, which moves once a cycle, counts over the window as the others' do)."""
    t0, c0 = time.perf_counter(), time.process_time()
    fed = _fed(dataset, s, seed)
    wait = method == "wait-minibatch"
    alg = fed.algorithm(lr, 10.0, fed.cycle) if method == "amplified" else fed.algorithm(lr)
    every = max(1, s["rounds"] // 100)
    ev, _ = fed.run(alg, prepared, s["warmup"], s["rounds"], wait_for_all=wait, eval_every=every)
    tail = [e for e in ev if e[0] > s["warmup"] + s["rounds"] * 0.9] or ev[-1:]
    loss = float(np.mean([e[1] for e in tail]))
    return {
        "loss": loss if np.isfinite(loss) else float("inf"),
        "acc": float(np.mean([e[2] for e in tail])),
        "final_loss": float(ev[-1][1]),
        "s": time.perf_counter() - t0,
        "cpu": time.process_time() - c0,
    }


def part_b(
    dataset: str,
    preset: str,
    jobs: int,
    seeds: list[int] | None = None,
    factors: list[float] | None = None,
    methods: list[str] | None = None,
    journal_args: argparse.Namespace | None = None,
) -> None:
    from benchmarks.tuning import edge_note, grid_line, open_journal, pick, sweep

    s = dict(PRESETS[preset], **({"seeds": seeds} if seeds else {}))
    if factors:  # a part of the grid (e.g. to extend a finished run's grid by one value)
        s["factors"] = s["wait_factors"] = factors
    grids = {"FedAvg": s["factors"], "amplified": s["factors"], "wait-minibatch": s["wait_factors"]}
    grids = {m: [GAMMA0 * f for f in g] for m, g in grids.items() if not methods or m in methods}
    run_settings = {k: v for k, v in s.items() if k not in ("seeds", "factors", "wait_factors")}
    journal = open_journal(
        journal_args or argparse.Namespace(journal=None, fresh=False),
        __file__,
        preset,
        {"dataset": dataset, "settings": run_settings, "gamma0": GAMMA0, "diverged": DIVERGED, **RUN_SEMANTICS},
    )
    t0 = time.perf_counter()
    # interleaved, smallest gamma first (the drift-limited end the claim is about): an interrupted run still covers
    # every method; each seed's warm-up runs once, and only if one of its phase-2 runs is still to do
    cells = sweep(
        phase2,
        grids,
        s["seeds"],
        jobs,
        journal=journal,
        order=lambda n: range(n - 1, -1, -1),
        prepare=warm_up,
        dataset=dataset,
        s=run_settings,
    )
    journal.close()
    wall = time.perf_counter() - t0
    print(
        f"\n(b) preset {preset}: {dataset}, {s['devices']} devices (one majority label, 5 % other labels), 5 "
        f"label-pair groups available {s['k']} rounds each (cycle {5 * s['k']}, random offset), S = {s['s']} by "
        f"regularized selection, MLP 784-64-10, I = 5, batch 16; warm-up {s['warmup']} rounds of FedAvg at "
        f"gamma0 = {GAMMA0}, then {s['rounds']} rounds; amplified: eta = 10, P = {5 * s['k']}; metric: training loss "
        f"(5000 training samples) averaged over the last 10 % of the rounds; seeds {s['seeds']}; wall {wall:.0f} s "
        f"({jobs} jobs); {journal.summary()}"
    )
    print("  tuning (gamma: mean loss):")
    for m, row in cells.items():
        print(f"    {m:<15} " + grid_line(row, "loss", lambda v: f"{v:.4f}"))
    print(f"  {'method':<15}{'gamma':>9}{'train loss':>12}{'test acc':>10}   loss per seed")
    best = pick(cells, "loss", lower_is_better=True)
    for m, w in best.items():
        print(
            f"  {m:<15}{w.cell.value:>9.0e}{w.cell.mean('loss'):>12.4f}{w.cell.mean('acc'):>10.4f}   "
            + " ".join(f"{r['loss']:.4f}" for r in w.cell.runs)
            + edge_note(w)
        )
    if "amplified" not in best or "FedAvg" not in best:
        return
    amp, fed = best["amplified"].cell.mean("loss"), best["FedAvg"].cell.mean("loss")
    print(
        f"  claim (amplified beats the best-tuned FedAvg on the last-10% training loss): "
        f"{'HOLDS' if amp < fed else 'FAILS'} ({amp:.4f} vs {fed:.4f})"
    )
    order = sorted(best, key=lambda m: best[m].cell.mean("loss"))
    print(
        f"  order (lowest loss first): {' < '.join(order)}; the paper's (Fig. 1): amplified < wait-minibatch < FedAvg"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="quick")
    ap.add_argument("--dataset", default="fmnist", choices=["fmnist", "mnist"])
    ap.add_argument("--part", default="ab", help="a, b or ab")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel in part (b) (each single-threaded)")
    ap.add_argument("--seeds", help="comma-separated seeds for part (b) (default: the preset's)")
    ap.add_argument(
        "--factors",
        help="comma-separated gamma factors (x gamma0) for every method of part (b) (default: the preset's grid)",
    )
    ap.add_argument("--methods", help="comma-separated subset of FedAvg, amplified, wait-minibatch for part (b)")
    from benchmarks.tuning import add_journal_args

    add_journal_args(ap)
    a = ap.parse_args()
    from benchmarks.calibration import calibration_line

    print(calibration_line(), flush=True)  # how fast this machine is, beside the figures below
    import torch

    torch.set_num_threads(1)
    from benchmarks.tuning import cpu_seconds

    t0, c0 = time.perf_counter(), cpu_seconds()
    if "a" in a.part:
        part_a(3, 2000)
    if "b" in a.part:
        part_b(
            a.dataset,
            a.preset,
            a.jobs,
            [int(x) for x in a.seeds.split(",")] if a.seeds else None,
            [float(x) for x in a.factors.split(",")] if a.factors else None,
            a.methods.split(",") if a.methods else None,
            a,
        )
    print(f"\ntotal: wall {time.perf_counter() - t0:.0f} s, CPU {cpu_seconds() - c0:.0f} s")


if __name__ == "__main__":
    main()
