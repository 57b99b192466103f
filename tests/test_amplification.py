"""Amplified cloud updates (Wang & Ji) and the periodic participation they are made for."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.algorithms.fedavg import FedAvg
from protocols.algorithms.server_opt import ServerOptimizer, ServerParams
from protocols.config import parse_config
from sim.launcher import run_simulation
from sim.participation import CyclicGroups, make_participation

DEVS = [f"d{i:02d}" for i in range(20)]


def _toy(gamma: float, eta: float, rounds: int = 15) -> float:
    """Spec 8a (App. B.1): three quadratics, one client per round in turn, I = 1, P = 3."""
    z = np.array([[-1.0, 0.0], [1.0, 0.0], [0.0, np.sqrt(3.0)]])
    opt = ServerOptimizer(ServerParams(name="fedavg", local_steps=1, amplify_eta=eta, amplify_period=3))
    x = {"x": np.array([1.0, 2.0])}
    for t in range(rounds):
        delta = {"x": -gamma * (x["x"] - z[t % 3])}
        x, _ = opt.step(t, x, delta)
    return float(np.linalg.norm(x["x"] - np.array([0.0, np.sqrt(3.0) / 3])))


def test_toy_matches_the_spec_table():
    assert _toy(0.05, 1.0) == pytest.approx(0.824, abs=1e-3)
    assert _toy(0.05, 10.0) == pytest.approx(0.011, abs=1e-3)
    assert _toy(0.05, 5.0) == pytest.approx(0.038, abs=1e-3)
    assert _toy(0.5, 1.0) == pytest.approx(0.437, abs=1e-3)


def test_interval_end_is_anchor_plus_eta_u_and_warmup_is_plain():
    opt = ServerOptimizer(
        ServerParams(name="fedavg", local_steps=1, amplify_eta=4.0, amplify_period=3, amplify_start=2)
    )
    g = np.random.default_rng(0)
    x = {"w": g.standard_normal(5).astype(np.float32)}
    history, deltas, flags = [x], [], []
    for t in range(8):
        deltas.append({"w": g.standard_normal(5).astype(np.float32)})
        x, amplified = opt.step(t, x, deltas[-1])
        history.append(x)
        flags.append(amplified)
    assert flags == [False, False, False, False, True, False, False, True]  # intervals [2, 5) and [5, 8)
    for t in (0, 1, 2, 3, 5, 6):  # plain FedAvg steps (warm-up and inside intervals)
        assert history[t + 1]["w"].tobytes() == (history[t]["w"] + deltas[t]["w"]).tobytes()
    plain = history[4]["w"].astype(np.float64) + deltas[4]["w"]  # x_5 before amplification
    anchor = history[2]["w"].astype(np.float64)  # x_{t0}, t0 = amplify_start = 2
    np.testing.assert_allclose(history[5]["w"], anchor + 4.0 * (plain - anchor), rtol=1e-6)
    assert opt.t0 == 8 and opt.anchor["w"].tobytes() == history[8]["w"].tobytes()


def _cfg(**algo) -> dict:
    return {
        "run": {"name": "amp", "seed": 3, "rounds": 6},
        "topology": {"cells": 2, "devices_per_cell": 4},
        "algorithm": {"name": "fedavg", "edge_rounds": 1, "local_steps": 5, "batch_size": 16, "lr": 0.05, **algo},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"dataset": "digits", "partition": "shards", "shards_per_device": 2},
        "participation": {"model": "cyclic", "groups": 2, "per_round": 2},
    }


def test_eta_one_is_fedavg_bit_for_bit():
    plain = run_simulation(parse_config(_cfg()), write_output=False)
    one = run_simulation(parse_config(_cfg(amplify_eta=1.0, amplify_period=2)), write_output=False)
    assert all(plain.params[k].tobytes() == one.params[k].tobytes() for k in plain.params)
    amp = run_simulation(parse_config(_cfg(amplify_eta=3.0, amplify_period=2)), write_output=False)
    assert any(plain.params[k].tobytes() != amp.params[k].tobytes() for k in plain.params)
    assert [bool(r["metrics"].get("amplified")) for r in amp.history] == [False, True] * 3


def test_amplified_run_is_bit_identical_after_resume(tmp_path):
    cfg = _cfg(amplify_eta=3.0, amplify_period=4)
    cfg["run"]["output"] = str(tmp_path / "{name}")
    full = run_simulation(parse_config(cfg), write_output=False)
    cfg["run"]["rounds"] = 3  # stop inside the second interval ...
    run_simulation(parse_config(cfg))
    cfg["run"]["rounds"] = 6  # ... and resume from the checkpoint (anchor and t0 restored)
    resumed = run_simulation(parse_config(cfg), resume=True)
    assert all(full.params[k].tobytes() == resumed.params[k].tobytes() for k in full.params)


def test_amplification_composes_with_hist():
    cfg = _cfg(amplify_eta=2.0, amplify_period=3)
    cfg["algorithm"]["name"] = "hist"
    res = run_simulation(parse_config(cfg), write_output=False)
    assert [bool(r["metrics"].get("amplified")) for r in res.history] == [False, False, True] * 2


def test_cyclic_blocks_with_regularized_selection_equal_weight_per_cycle():
    # 4 groups of 5 devices, each available for 10 rounds (cycle 40); 1 device a round by permutation passes of 5
    m = CyclicGroups(DEVS, 4, seed=1, period=10, per_round=1, selection="permutation")
    masks = np.stack([m.mask(r) for r in range(m.cycle * 6)])
    assert m.cycle == 40 and all(masks.sum(1) == 1)
    stint_starts = [r for r in range(masks.shape[0] - m.cycle + 1) if (r + m.offset) % 5 == 0]
    for t0 in stint_starts:  # any window of one cycle starting on a pass boundary: every device twice
        assert np.all(masks[t0 : t0 + m.cycle].sum(0) == 2)
    # without sub-selection every window of one cycle is regularized, whatever its start
    full = CyclicGroups(DEVS, 4, seed=1, period=10)
    fm = np.stack([full.mask(r) for r in range(200)])
    assert all(np.all(fm[t : t + 40].sum(0) == 10) for t in range(160))
    # the first group gets a random remainder of its period (random offset over the whole cycle)
    offsets = {CyclicGroups(DEVS, 4, seed=s, period=10).offset for s in range(30)}
    assert len(offsets) > 5 and max(offsets) < 40
    assert all(full.expected_rate(d) == pytest.approx(0.25) for d in DEVS)


def test_cyclic_factory_and_config_keys():
    m = make_participation(
        {"model": "cyclic", "groups": 2, "period": 3, "per_round": 2, "selection": "permutation"}, DEVS, 0
    )
    assert isinstance(m, CyclicGroups) and m.cycle == 6
    with pytest.raises(ValueError, match="selection"):
        CyclicGroups(DEVS, 2, selection="roundrobin")


def test_cell_level_participation_plans_only_available_cells():
    cfg = _cfg()
    cfg["topology"]["cells"] = 3
    cfg["participation"] = {"model": "cyclic", "groups": 3, "level": "cell", "random_offset": False}
    res = run_simulation(parse_config(cfg), write_output=False)
    planned = [r["cells_planned"] for r in res.history]
    assert all(len(p) == 1 for p in planned) and planned[:3] == planned[3:]  # one cell a round, periodic
    assert sorted(p[0] for p in planned[:3]) == ["c0", "c1", "c2"]
    # every device of the planned cell takes part (the device tier is not thinned)
    assert all(r["devices"] == {r["cells_planned"][0]: 4} for r in res.history)


def test_fedavg_params_keep_amplification_keys():
    p = FedAvg.Params(name="fedavg", local_steps=1, amplify_eta=10, amplify_period=500)
    assert p.amplify_eta == 10 and p.amplify_period == 500 and p.amplify_start == 0


@pytest.mark.parametrize("name", ["hist", "amplified"])
def test_example_configs_validate(name):
    from pathlib import Path

    from protocols.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / f"{name}.toml")
    assert cfg.train.name in ("hist", "fedavg")


def test_wait_minibatch_is_evaluated_at_the_same_rounds_as_the_others():
    # benchmarks/amplification.py: wait-minibatch's model moves once a cycle; it is evaluated at the same rounds as
    # the other methods (the model in place over the whole window), an unchanged model repeating its figures
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.amplification import Federation
    from protocols.algorithms.base import ModelSpec
    from protocols.cohort_trainer import CohortEngine
    from protocols.trainer import LocalData

    fed = object.__new__(Federation)  # a tiny federation: 4 devices, cycle 4, no data set to load
    g = np.random.default_rng(0)
    fed.ids, fed.cycle, fed.seed, fed.engine = [f"d{i}" for i in range(4)], 4, 0, CohortEngine()
    fed.spec = ModelSpec(name="mlp", input_shape=(4,), num_classes=3, hidden=(5,))
    fed.data = {d: LocalData(g.normal(size=(8, 4)).astype(np.float32), g.integers(0, 3, 8)) for d in fed.ids}
    passes: list[float] = []

    def evaluate(model):
        passes.append(float(sum(np.abs(v).sum() for v in model.values())))
        return passes[-1], 0.5

    fed.evaluate = evaluate
    alg = FedAvg(FedAvg.Params(name="fedavg", local_steps=2, batch_size=4, lr=0.5), fed.spec, 0)
    evals, _ = fed.run(alg, alg.initial_params(), 0, 12, wait_for_all=True, eval_every=1)
    assert [e[0] for e in evals] == list(range(1, 13))  # every round, as the other methods' schedule
    assert len(passes) == 4 and len(set(passes)) == 4  # one pass per model: the start, after rounds 4, 8 and 12
    losses = [e[1] for e in evals]
    assert losses[:3] == [passes[0]] * 3 and losses[3:7] == [passes[1]] * 4 and losses[11] == passes[3]
