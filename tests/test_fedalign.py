"""FedALIGN: baselines bit for bit, two-sided admission, probes before training, the paper's weights."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.algorithms.base import DeviceContext, ModelSpec, Rejected
from protocols.algorithms.fedalign import FedAlign, FedAlignCell, FedAlignCloud, Schedule, opts_in
from protocols.config import ConfigError, parse_config
from protocols.wire.payload import Payload
from sim.launcher import run_simulation

PRIORITY = ["c0-d1", "c1-d0"]


def base_config(**algorithm) -> dict:
    alg = {"name": "fedalign", "priority": PRIORITY, "local_steps": 3, "lr": 0.1, "epsilon": 0.5, **algorithm}
    return {
        "run": {"name": "fa", "rounds": 4, "seed": 3},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "algorithm": alg,
        "model": {"name": "logreg"},
        "data": {"dataset": "digits", "partition": "shards", "shards_per_device": 2, "max_train": 600},
    }


def fedavg_config(cfg: dict, probs: list[float] | None) -> dict:
    out = {**cfg, "algorithm": {"name": "fedavg", "local_steps": 3, "lr": 0.1}}
    if probs is not None:
        out["participation"] = {"model": "bernoulli", "probs": probs}
    return out


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


def params(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"w": (r.standard_normal((4, 3)) * scale).astype(np.float32), "b": r.standard_normal(3).astype(np.float32)}


def test_epsilon_zero_is_fedavg_on_the_priority_devices_bit_for_bit():
    cfg = base_config(epsilon=0.0)
    a = run_simulation(parse_config(cfg), write_output=False)
    devices = parse_config(cfg).topology.all_devices()
    b = run_simulation(
        parse_config(fedavg_config(cfg, [1.0 if d in PRIORITY else 0.0 for d in devices])), write_output=False
    )
    assert same(a.params, b.params)
    c = run_simulation(parse_config(fedavg_config(cfg, None)), write_output=False)
    assert not same(a.params, c.params)  # the comparison can fail
    assert all(r["metrics"]["phase"] == "solo" for r in a.history)
    assert all(r["planned"] in ([PRIORITY[0]], [PRIORITY[1]]) for r in a.cell_records)


def test_epsilon_inf_is_fedavg_on_all_devices_bit_for_bit():
    cfg = base_config(epsilon=math.inf)
    a = run_simulation(parse_config(cfg), write_output=False)
    b = run_simulation(parse_config(fedavg_config(cfg, None)), write_output=False)
    assert same(a.params, b.params)
    assert [r["metrics"]["phase"] for r in a.history] == ["all"] * 4
    assert all(not rec["metrics"]["refused"] for rec in a.cell_records)


def test_toml_inf_and_config_errors(tmp_path):
    from protocols.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('[algorithm]\nname = "fedalign"\npriority = ["c0-d0"]\nepsilon = inf\n')
    cfg = load_config(path)
    assert math.isinf(cfg.train.epsilon)
    assert "epsilon = inf" in cfg.to_toml()
    spec = ModelSpec(name="logreg", input_shape=(64,))
    with pytest.raises(ConfigError, match=r"algorithm.priority: 'c9-d0'"):
        parse_config(base_config(priority=["c0-d0", "c9-d0"])).build_algorithm(spec)
    with pytest.raises(ConfigError, match="exactly one of priority"):
        parse_config(base_config(priority=[]))
    with pytest.raises(ConfigError, match="exactly one of priority"):
        parse_config(base_config(priority_fraction=0.5))
    with pytest.raises(ConfigError, match="edge_rounds"):
        parse_config(base_config(edge_rounds=2))
    a = parse_config(base_config(priority=[], priority_fraction=0.34)).build_algorithm(spec)
    b = parse_config(base_config(priority=[], priority_fraction=0.34)).build_algorithm(spec)
    assert a.priority == b.priority and len(a.priority) == 2  # floor(0.34 * 6), drawn with run.seed


def test_schedule_warmup_two_phase_matching_and_epsilon_drop():
    p = parse_config(base_config(warmup_rounds=2, epsilon=0.3, epsilon_later=0.0, epsilon_drop_round=4)).train
    s = Schedule(p)
    assert [s.at(r) for r in range(8)] == [
        (0, "solo"),
        (1, "solo"),
        (2, "priority"),
        (2, "free"),
        (3, "priority"),
        (3, "free"),
        (4, "solo"),
        (5, "solo"),
    ]
    assert [s.epsilon(i) for i in range(6)] == [0.0, 0.0, 0.3, 0.3, 0.0, 0.0]


def test_the_schedule_in_closed_form_is_the_round_by_round_one_and_sizes_nothing_by_its_iterations():
    """Every regime mix (warm-up, drop, epsilon 0 / finite / infinite before and after) against the schedule built
    round by round, as it was; and a warm-up of 1e12 iterations checked at once (1e7 took 6.7 s: a list of every
    round's phase, up to the last regime, built to check the run's phases; 1e9 would have filled memory)."""
    import itertools
    import time
    from types import SimpleNamespace

    for warmup, drop, eps, later in itertools.product(range(4), range(5), (0.0, 0.3, math.inf), (0.0, 0.3, math.inf)):
        p = SimpleNamespace(warmup_rounds=warmup, epsilon_drop_round=drop, epsilon=eps, epsilon_later=later)
        s, rounds = Schedule(p), []  # type: ignore[arg-type]
        for it in range(12):
            rounds += [(it, ph) for ph in s.phases(it)]
        assert [s.at(r) for r in range(len(rounds))] == rounds, (warmup, drop, eps, later)
        for n in range(len(rounds) // 2):  # the last regime's phases all come within the first 12 iterations
            assert s.reachable_phases(n) == {ph for _, ph in rounds[:n]}, (warmup, drop, eps, later, n)
        assert s.reachable_phases() == {ph for _, ph in rounds}
    start = time.monotonic()
    cfg = parse_config(base_config(warmup_rounds=10**12, epsilon_drop_round=10**12 + 5))
    cfg.build_algorithm(cfg.model_spec((64,), 10))
    assert Schedule(cfg.train).at(10**12 + 7) == (10**12 + 3, "free")  # type: ignore[arg-type]
    assert time.monotonic() - start < 1.0


def test_admission_is_two_sided_and_aggregation_follows_the_paper():
    train = parse_config(base_config(epsilon=0.2)).train
    w = params(0)
    cloud = FedAlignCloud(train, w)
    cloud.schedule = Schedule(train)
    # phase priority: one priority device per cell, probe losses 1.0 and 1.4 with 100 / 300 samples -> F = 1.3
    cells = {c: FedAlignCell(train, c, frozenset({"p0", "p1"})) for c in ("c0", "c1")}
    tasks = cloud.plan(0, ["c0", "c1"])
    assert tasks["c0"].meta["phase"] == "priority"
    prio = {"p0": (params(1, 0.1), 100, 1.0), "p1": (params(2, 0.1), 300, 1.4)}
    for c, d in (("c0", "p0"), ("c1", "p1")):
        cells[c].begin(0, tasks[c])
        assert list(cells[c].plan(0, [d, "f" + c])) == [d]  # free devices wait for the free phase
        delta, n, loss = prio[d]
        r = Payload({"weight": n, "probe_loss": loss, "probe_accuracy": 0.5, "trained": True}, delta)
        cells[c].check(d, r)
        cells[c].aggregate(0, {d: r})
    reports = {c: cells[c].report() for c in cells}
    for c, r in reports.items():
        cloud.check(c, r)
    metrics = cloud.aggregate(0, reports)
    assert metrics["priority_loss"] == pytest.approx(1.3)
    assert same(cloud.global_params(), w)  # held until the free phase
    # phase free: F = 1.3, eps = 0.2. Loss 1.0 opts in (1.0 <= 1.5) but the cell refuses it (|gap| 0.3);
    # 1.45 is admitted; 1.6 declines at the device.
    tasks = cloud.plan(1, ["c0", "c1"])
    assert tasks["c0"].meta["F"] == pytest.approx(1.3) and tasks["c0"].meta["epsilon"] == 0.2
    assert opts_in("loss", 1.0, 1.3, 0.2) and opts_in("loss", 1.45, 1.3, 0.2) and not opts_in("loss", 1.6, 1.3, 0.2)
    assert opts_in("accuracy", 0.9, 0.7, 0.1) and not opts_in("accuracy", 0.55, 0.7, 0.1)  # mirrored for accuracy
    assert not opts_in("loss", 0.1, None, 0.2) and opts_in("loss", 9.0, None, None)  # F unknown / eps = inf
    cell = cells["c0"]
    cell.begin(1, tasks["c0"])
    free = ["low", "match", "high"]
    plan = cell.plan(0, ["p0", *free])
    assert sorted(plan) == sorted(free) and plan["low"].meta["role"] == "free"
    results = {
        "low": Payload({"weight": 200, "probe_loss": 1.0, "probe_accuracy": 0.7, "trained": True}, params(3, 0.1)),
        "match": Payload({"weight": 200, "probe_loss": 1.45, "probe_accuracy": 0.5, "trained": True}, params(4, 0.1)),
        "high": Payload({"weight": 200, "probe_loss": 1.6, "probe_accuracy": 0.4, "trained": False}, {}),
    }
    for d, r in results.items():
        cell.check(d, r)
    log = cell.aggregate(0, results)
    assert log["admitted"] == ["match"] and log["refused"] == ["high", "low"]
    assert log["admission"]["low"]["by"] == "cell" and log["admission"]["high"]["by"] == "device"
    assert log["admission"]["low"]["gap"] == pytest.approx(-0.3)
    cells["c1"].begin(1, tasks["c1"])
    cells["c1"].plan(0, [])
    cells["c1"].aggregate(0, {})
    reports = {"c0": cell.report(), "c1": cells["c1"].report()}
    assert reports["c0"].meta["admitted"] == 1 and reports["c0"].meta["refused"] == 2
    for c, r in reports.items():
        cloud.check(c, r)
    metrics = cloud.aggregate(1, reports)
    assert metrics["admitted"] == 1 and metrics["refused"] == 2
    # paper, eq. (15/16): p_k = D_k / sum_P D_i, Z = 1 + sum_admitted p_k
    p = {"p0": 100 / 400, "p1": 300 / 400, "match": 200 / 400}
    z = 1 + p["match"]
    for k in w:
        upd = (
            p["p0"] * prio["p0"][0][k].astype(np.float64)
            + p["p1"] * prio["p1"][0][k]
            + p["match"] * params(4, 0.1)[k].astype(np.float64)
        ) / z
        np.testing.assert_allclose(cloud.global_params()[k], w[k] + upd, rtol=1e-5, atol=1e-6)


def test_cloud_checkpoint_keeps_the_held_priority_updates():
    train = parse_config(base_config()).train
    cloud = FedAlignCloud(train, params(0))
    cloud.plan(0, ["c0"])
    rep = Payload(
        {
            "phase": "priority",
            "weight": 5,
            "prio_weight": 5.0,
            "prio_loss": 5.0,
            "prio_accuracy": 2.0,
            "admitted": 0,
            "refused": 0,
        },
        params(1, 0.1),
    )
    cloud.aggregate(0, {"c0": rep})
    other = FedAlignCloud(train, params(9))
    other.load_state(cloud.state())
    assert other.F == 1.0 and same(other.held["c0"].tensors, rep.tensors) and same(other.model, cloud.model)


@pytest.mark.parametrize(
    "meta, tensors, match",
    [
        ({"weight": 5, "probe_loss": float("nan"), "probe_accuracy": 0.5, "trained": True}, True, "probe_loss"),
        ({"weight": 5, "probe_loss": 1.0, "probe_accuracy": 1.5, "trained": True}, True, "probe_accuracy"),
        ({"weight": 5, "probe_loss": 1.0, "probe_accuracy": 0.5, "trained": False}, True, "no tensors"),
        ({"weight": 5, "probe_loss": 1.0, "probe_accuracy": 0.5, "trained": "yes"}, False, "trained"),
        ({"weight": 5, "probe_loss": 1.0, "probe_accuracy": 0.5, "trained": False}, False, "trained"),  # priority
    ],
)
def test_bad_results_are_rejected(meta, tensors, match):
    train = parse_config(base_config()).train
    cell = FedAlignCell(train, "c0", frozenset({"p"}))
    cell.begin(0, Payload({"phase": "all", "iteration": 0, "criterion": "loss", "epsilon": None}, params(0)))
    cell.plan(0, ["p", "f"])
    device = "p" if match == "trained" and meta["trained"] is False else "f"
    with pytest.raises(Rejected, match=match):
        cell.check(device, Payload(meta, params(1) if tensors else {}))
    with pytest.raises(Rejected, match="not planned"):
        cell.check("x", Payload(meta, {}))


def test_devices_probe_the_received_model_before_training():
    from protocols.torch_trainer import TorchTrainer
    from protocols.trainer import LocalData
    from sim.datasets import load_dataset

    ds = load_dataset("digits")
    spec = ModelSpec(name="logreg", input_shape=ds.input_shape)
    alg = FedAlign(parse_config(base_config(local_steps=5)).train, spec, seed=0)
    trainer = TorchTrainer.from_spec("logreg", ds.input_shape, 10)
    w = alg.initial_params()
    data = LocalData(ds.x_train[:150], ds.y_train[:150])
    ctx = DeviceContext(0, 0, 0, "c0", "c0-d0")
    trainer.set_params(w)
    loss, acc = trainer.evaluate(data.x, data.y)
    trainer.set_params({k: v + 1 for k, v in w.items()})  # stale trainer state
    r = alg.device("c0-d0").train(Payload({"role": "priority"}, w), data, trainer, ctx)
    assert r.meta["probe_loss"] == loss and r.meta["probe_accuracy"] == acc and r.meta["trained"]
    trained = {k: w[k] + r.tensors[k] for k in w}
    trainer.set_params(trained)
    assert trainer.evaluate(data.x, data.y)[0] < loss  # training happened after the probe
    task = {"role": "free", "criterion": "loss", "epsilon": 0.1}
    declined = alg.device("c0-d0").train(Payload({**task, "F": loss - 0.2}, w), data, trainer, ctx)
    assert declined.meta == {"weight": 150, "probe_loss": loss, "probe_accuracy": acc, "trained": False}
    assert declined.tensors == {}
    joined = alg.device("c0-d0").train(Payload({**task, "F": loss - 0.05}, w), data, trainer, ctx)
    assert joined.meta["trained"] and same(joined.tensors, r.tensors)  # same batches as a priority device


def test_run_logs_admissions_and_is_deterministic():
    cfg = parse_config({**base_config(epsilon=1.0, warmup_rounds=1), "run": {"name": "fa", "rounds": 5, "seed": 3}})
    a = run_simulation(cfg, write_output=False)
    b = run_simulation(cfg, write_output=False)
    assert same(a.params, b.params)
    assert [(r["metrics"]["iteration"], r["metrics"]["phase"]) for r in a.history] == [
        (0, "solo"),
        (1, "priority"),
        (1, "free"),
        (2, "priority"),
        (2, "free"),
    ]
    free = [r for r in a.cell_records if r["metrics"]["phase"] == "free"]
    assert len(free) == 4
    for rec in free:
        adm = rec["metrics"]["admission"]
        assert set(adm) == set(rec["planned"]) and not set(adm) & set(PRIORITY)
        for _d, entry in adm.items():
            assert entry["admitted"] == (abs(entry["gap"]) <= 1.0 and entry["by"] is None)
    assert {d for r in free for d in r["metrics"]["admitted"]} == {"c0-d2", "c1-d2"}
    assert {d for r in free for d in r["metrics"]["refused"]} == {"c0-d0", "c1-d1"}
    # the model only moves in rounds that end an iteration
    prio_round = a.history[1]
    assert prio_round["metrics"]["priority_loss"] > 0 and "weight" not in prio_round["metrics"]


def test_emulation_over_mqtt_is_bit_identical_to_sim(tmp_path):
    """The example config (2 matching iterations after a warm-up one) through ``fedtier run``'s hierarchy."""
    import json
    from pathlib import Path

    from protocols.config import load_config
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    example = Path(__file__).resolve().parent.parent / "examples" / "fedalign.toml"

    def cfg(out: Path):
        return load_config(example, [f"run.output={json.dumps(str(out))}", "run.rounds=5", "algorithm.warmup_rounds=1"])

    sim = run_simulation(cfg(tmp_path / "sim"))
    with EmbeddedBroker() as broker:
        emu = Emulation(cfg(tmp_path / "emu"), broker_url=broker.url).run()
    assert same(emu.params, sim.params)
    assert [r["metrics"]["phase"] for r in emu.history] == ["solo", "priority", "free", "priority", "free"]

    def admitted(res):
        return sorted(
            (r["round"], r["cell"], tuple(r["metrics"].get("admitted", ())))  # noqa: E731
            for r in res.cell_records
        )

    assert admitted(emu) == admitted(sim)
