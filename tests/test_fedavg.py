"""Hierarchical FedAvg: exact aggregation weights, learning, determinism, deadlines, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from protocols import runfiles
from protocols.algorithms.base import DeviceContext, ModelSpec, Rejected
from protocols.algorithms.fedavg import FedAvg, FedAvgCell, FedAvgCloud
from protocols.config import parse_config
from protocols.wire import topics
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy, run_simulation


def params(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"w": (r.standard_normal((4, 3)) * scale).astype(np.float32), "b": r.standard_normal(3).astype(np.float32)}


def test_cell_and_cloud_weights_match_direct_numpy_computation():
    train = parse_config({"algorithm": {"name": "fedavg", "edge_rounds": 2}}).train
    base = params(0)
    cell = FedAvgCell(train, "c0")
    cell.begin(0, Payload({}, base))
    tasks = cell.plan(0, ["d1", "d2", "d3"])
    assert set(tasks) == {"d1", "d2", "d3"}
    deltas = {"d1": params(1, 0.1), "d2": params(2, 0.1), "d3": params(3, 0.1)}
    weights = {"d1": 10, "d2": 30, "d3": 60}
    cell.aggregate(0, {d: Payload({"weight": weights[d]}, deltas[d]) for d in deltas})
    # second edge round: only d2 answers
    d2b = params(4, 0.1)
    cell.aggregate(1, {"d2": Payload({"weight": 30}, d2b)})
    report = cell.report()
    for k in base:
        first = sum(weights[d] * deltas[d][k].astype(np.float64) for d in deltas) / 100
        expected = first + d2b[k].astype(np.float64)
        np.testing.assert_allclose(report.tensors[k], expected, rtol=1e-5, atol=1e-6)
    assert report.meta["weight"] == 100  # distinct devices that answered

    cloud = FedAvgCloud(train, base)
    other = {k: v * 2 for k, v in report.tensors.items()}
    cloud.aggregate(0, {"c0": report, "c1": Payload({"weight": 300}, other), "c2": Payload({"weight": 0}, {})})
    for k in base:
        expected = base[k] + (100 * report.tensors[k].astype(np.float64) + 300 * other[k]) / 400
        np.testing.assert_allclose(cloud.global_params()[k], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "bad, match",
    [
        (Payload({"weight": 5}, {"w": np.zeros((4, 3), np.float32)}), "wrong tensors"),
        (Payload({"weight": 5}, {"w": np.zeros((3, 4), np.float32), "b": np.zeros(3, np.float32)}), "shape"),
        (Payload({"weight": -1}, params(1)), "weight"),
        (Payload({"weight": float("inf")}, params(1)), "weight"),
        (Payload({}, params(1)), "weight"),
        (
            Payload({"weight": 3}, {"w": np.full((4, 3), np.nan, np.float32), "b": np.zeros(3, np.float32)}),
            "non-finite",
        ),
        (Payload({"weight": 3}, {"w": np.zeros((4, 3), np.int32), "b": np.zeros(3, np.float32)}), "dtype"),
    ],
)
def test_bad_results_are_rejected(bad, match):
    cell = FedAvgCell(parse_config({}).train, "c0")
    cell.begin(0, Payload({}, params(0)))
    with pytest.raises(Rejected, match=match):
        cell.check("d1", bad)


def test_device_role_is_deterministic_and_uses_its_own_batches():
    from protocols.torch_trainer import TorchTrainer
    from protocols.trainer import LocalData
    from sim.datasets import load_dataset

    ds = load_dataset("digits")
    spec = ModelSpec(name="mlp", input_shape=ds.input_shape, hidden=(16,))
    alg = FedAvg(parse_config({"algorithm": {"name": "fedavg", "local_steps": 5}}).train, spec, seed=0)
    trainer = TorchTrainer.from_spec("mlp", ds.input_shape, 10, hidden=(16,))
    start = Payload({}, alg.initial_params())
    data = LocalData(ds.x_train[:200], ds.y_train[:200])
    ctx = DeviceContext(0, 0, 0, "c0", "c0-d0")
    a = alg.device("c0-d0").train(start, data, trainer, ctx)
    b = alg.device("c0-d0").train(start, data, trainer, ctx)
    c = alg.device("c0-d1").train(start, data, trainer, DeviceContext(0, 0, 0, "c0", "c0-d1"))
    assert all(np.array_equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert not all(np.array_equal(a.tensors[k], c.tensors[k]) for k in a.tensors)
    assert a.meta["weight"] == 200 and a.meta["steps"] == 5


def test_hierarchy_learns_digits(make_config):
    result = run_simulation(make_config(run={"rounds": 6}))
    accs = [r["accuracy"] for r in result.history]
    assert accs[-1] >= 0.88, accs
    assert accs[-1] > accs[0]


def test_same_config_and_seed_give_byte_identical_model(make_config, tmp_path):
    a = run_simulation(make_config(run={"output": str(tmp_path / "a")}))
    b = run_simulation(make_config(run={"output": str(tmp_path / "b")}))
    c = run_simulation(make_config(run={"output": str(tmp_path / "c"), "seed": 1}))
    fa, fb, fc = ((r.output_dir / runfiles.FINAL_MODEL).read_bytes() for r in (a, b, c))
    assert fa == fb
    assert fa != fc


def test_run_files_are_written(make_config):
    result = run_simulation(make_config())
    out = result.output_dir
    from protocols.checkpoint import load_params
    from protocols.jsonl import read_jsonl

    metrics = list(read_jsonl(out / runfiles.METRICS))
    cells = list(read_jsonl(out / runfiles.AGGREGATION))
    assert [m["round"] for m in metrics] == [0, 1, 2]
    assert len(cells) == 3 * 2 * 2  # rounds x cells x edge rounds
    rec = cells[0]
    assert rec["planned"] == rec["answered"] == ["c0-d0", "c0-d1", "c0-d2"]
    assert rec["bytes_in"] > 0 and rec["bytes_out"] > 0 and rec["loss_mean"] > 0
    final = load_params(out / runfiles.FINAL_MODEL)
    assert all(np.array_equal(final[k], result.params[k]) for k in final)
    assert (out / runfiles.CONFIG).read_text().startswith("[run]")
    # bytes per tier add up: what cells report equals what their records counted
    assert metrics[0]["bytes"]["device_to_cell"] == sum(r["bytes_in"] for r in cells if r["round"] == 0)
    assert metrics[0]["bytes"]["cell_to_device"] == sum(r["bytes_out"] for r in cells if r["round"] == 0)


class Failing:
    """A device role whose training raises (a bug, a model mismatch): the agent answers "failed" with why."""

    def train(self, *a, **k):
        raise RuntimeError("this device cannot train")


def test_device_whose_task_raises_does_not_block_the_round(make_config):
    """c0-d1's task raises: it answers "failed" with the reason at once, so c0 closes every edge round as
    soon as all answered (it used to wait out the 30 s deadline), records the failure, and aggregates the rest."""
    sim = SimHierarchy(make_config(run={"rounds": 2}, runtime={"device_deadline": 30.0}))
    sim.agents["c0-d1"].role = Failing()
    result = sim.run()
    c0 = [r for r in result.cell_records if r["cell"] == "c0"]
    assert len(c0) == 4 and result.status == "finished"
    for r in c0:
        assert r["closed_by"] == "all answered" and not r["absent"]
        assert r["failed"] == {"c0-d1": "RuntimeError: this device cannot train"}
        assert r["failed_counts"] == {"RuntimeError: this device cannot train": 1}
        assert r["answered"] == ["c0-d0", "c0-d2"] and r["clock_s"] < 1.0
    assert all(r["closed_by"] == "all answered" for r in result.cell_records if r["cell"] == "c1")
    assert [r["devices_failed"] for r in result.history] == [{"c0": 1}] * 2
    assert result.history[-1]["accuracy"] > 0.5


def test_offline_device_is_absent_and_foreign_garbage_is_rejected(make_config):
    sim = SimHierarchy(make_config(run={"rounds": 2}))
    sim.agents["c1-d2"].transport.crash()  # vanishes: the hub publishes its will (offline)
    intruder = sim.hub.connect("intruder")
    topic = topics.device_result("t", "c0", "c0-d0")

    def inject(record):  # after round 0, publish junk on a device topic
        if record["round"] == 0:
            intruder.publish(topic, b"\x00garbage")
            intruder.publish(topic, b"FTW1" + b"\xff" * 40)

    sim.cloud.on_round = inject
    result = sim.run()
    c1 = [r for r in result.cell_records if r["cell"] == "c1"]
    assert all(r["absent"] == {"c1-d2": "offline"} and "c1-d2" not in r["planned"] for r in c1)
    rejected = [x for r in result.cell_records if r["cell"] == "c0" for x in r["rejected"]]
    assert len(rejected) == 2 and all(x["device"] == "c0-d0" for x in rejected)
    assert len(result.history) == 2 and result.history[-1]["accuracy"] > 0.5


def test_duplicate_and_wrong_round_results_do_not_change_the_aggregate(make_config, tmp_path):
    clean = run_simulation(make_config(run={"output": str(tmp_path / "clean")}))
    sim = SimHierarchy(make_config(run={"output": str(tmp_path / "dup")}))
    agent = sim.agents["c0-d0"]
    original = agent.transport.publish

    def publish_twice(topic, payload, **kw):  # every message the device sends arrives twice
        original(topic, payload, **kw)
        original(topic, payload, **kw)

    agent.transport.publish = publish_twice
    dup = sim.run()
    assert all(np.array_equal(clean.params[k], dup.params[k]) for k in clean.params)


def test_resume_continues_to_the_same_model_as_an_uninterrupted_run(make_config, tmp_path):
    straight = run_simulation(make_config(run={"rounds": 4, "output": str(tmp_path / "straight")}))
    first = make_config(run={"rounds": 2, "output": str(tmp_path / "resumed")})
    run_simulation(first)  # "crashes" after round 1: its checkpoint holds round 1's state
    resumed = run_simulation(make_config(run={"rounds": 4, "output": str(tmp_path / "resumed")}), resume=True)
    assert [r["round"] for r in resumed.history] == [2, 3]
    assert all(np.array_equal(straight.params[k], resumed.params[k]) for k in straight.params)
    from protocols.jsonl import read_jsonl

    assert [m["round"] for m in read_jsonl(tmp_path / "resumed" / runfiles.METRICS)] == [0, 1, 2, 3]
    assert resumed.history[-1]["cumulative_bytes"] == straight.history[-1]["cumulative_bytes"]


def test_cell_survives_a_task_its_role_refuses(make_config):
    sim = SimHierarchy(make_config(run={"rounds": 3}, runtime={"device_deadline": 5.0, "cell_deadline": 60.0}))
    cell = sim.cells["c0"]
    begin = cell.role.begin

    def picky_begin(rnd, task):
        if rnd == 1:
            raise KeyError("task lacks what the role needs")
        begin(rnd, task)

    cell.role.begin = picky_begin
    result = sim.run()
    r1 = result.history[1]
    assert r1["cells_reported"] == ["c1"] and r1["cells_absent"] == ["c0"] and r1["closed_by"] == "deadline"
    assert result.history[2]["cells_reported"] == ["c0", "c1"]  # the cell is back the next round
    assert any("cell task refused" in x["reason"] for r in result.cell_records for x in r["rejected"])


def test_local_momentum_is_torchs_heavy_ball():
    """trainer.sgd(momentum=0.5) takes exactly torch.optim.SGD(momentum=0.5)'s steps (weight decay too)."""
    import torch

    from protocols.models import build_model, init_params
    from protocols.seeding import rng
    from protocols.torch_trainer import TorchTrainer
    from protocols.trainer import LocalData, batches

    spec = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(16,))
    x0 = init_params(build_model(spec.name, spec.input_shape, 10, **spec.build_kwargs()), 0)
    g = np.random.default_rng(0)
    data = LocalData(g.random((80, 64), dtype=np.float32), g.integers(0, 10, 80))
    trainer = TorchTrainer.from_spec(spec.name, spec.input_shape, 10, **spec.build_kwargs())
    out = {}
    for beta in (0.0, 0.5):
        trainer.set_params(x0)
        trainer.sgd(data, steps=12, batch_size=16, lr=0.1, rng=rng(0, "b"), weight_decay=1e-3, momentum=beta)
        out[beta] = trainer.get_params()
    ref = build_model(spec.name, spec.input_shape, 10, **spec.build_kwargs())
    with torch.no_grad():
        for k, p in ref.named_parameters():
            p.copy_(torch.from_numpy(x0[k]))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5, weight_decay=1e-3)
    for idx in batches(80, 16, 12, rng(0, "b")):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(torch.from_numpy(data.x[idx])), torch.from_numpy(data.y[idx])).backward()
        opt.step()
    for k, p in ref.named_parameters():
        np.testing.assert_allclose(out[0.5][k], p.detach().numpy(), rtol=1e-5, atol=1e-6)
        assert not np.allclose(out[0.0][k], out[0.5][k])  # momentum changes the trajectory


def test_given_data_trains_each_device_on_its_own_samples_and_request_stop_ends_the_run(make_config):
    """``SimHierarchy(prepared=prepare_given(...))``: a caller's own dataset and per-device indices replace
    data.dataset / data.partition; ``cloud.request_stop`` from ``on_round`` ends the run after that round."""
    from protocols.config import ConfigError
    from sim.datasets import Dataset
    from sim.hierarchy import prepare_given

    g = np.random.default_rng(0)
    means = g.normal(0, 2, (4, 8))
    y = np.repeat(np.arange(4), 100)
    x = (means[y] + g.normal(0, 1, (400, 8))).astype(np.float32)
    yt = np.repeat(np.arange(4), 50)
    xt = (means[yt] + g.normal(0, 1, (200, 8))).astype(np.float32)
    ds = Dataset(x, y, xt, yt, (8,), 4, "given")
    cfg = make_config(
        run={"rounds": 30},
        topology={"cells": 2, "devices_per_cell": 2},
        model={"name": "logreg"},
        algorithm={"lr": 0.02},
    )
    devices = list(cfg.topology.devices())
    parts = {d: np.flatnonzero(y == k) for k, d in enumerate(devices)}  # device k holds class k only
    with pytest.raises(ConfigError, match="missing"):
        prepare_given(cfg, ds, {d: parts[d] for d in devices[1:]})
    sim = SimHierarchy(cfg, write_output=False, prepared=prepare_given(cfg, ds, parts))
    for k, d in enumerate(devices):
        assert set(sim.prep.device_data[d].y.tolist()) == {k}

    def stop_at_target(rec: dict) -> None:
        if rec["accuracy"] >= 0.95:
            sim.cloud.request_stop("reached 95 %")

    sim.cloud.on_round = stop_at_target
    result = sim.run()
    assert result.history[-1]["accuracy"] >= 0.95  # learned the 4 classes from 4 single-class devices
    assert 1 < len(result.history) < 30 and result.stopped == "reached 95 %"
    assert all(r["accuracy"] < 0.95 for r in result.history[:-1])
