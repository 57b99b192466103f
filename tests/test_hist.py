"""HIST: disjoint covering submodels, exact reassembly, slice-only traffic, a model that learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocols import params as P
from protocols.algorithms.base import DeviceContext, ModelSpec, Rejected
from protocols.algorithms.hist import INDEX, Hist, HistCloud, draw_partition, split_task, sub_spec, unit_axes
from protocols.config import ConfigError, parse_config
from protocols.seeding import rng
from protocols.torch_trainer import TorchTrainer
from protocols.trainer import LocalData
from protocols.wire.payload import Payload, encode_payload
from sim.launcher import run_simulation

torch.set_num_threads(1)
MLP = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(30, 21, 18))
DEEP = ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(16, 12, 14, 9, 11))
CNN = ModelSpec(name="cnn", input_shape=(1, 8, 8), num_classes=10, channels=(6, 8), fc=24)


def _cloud(spec: ModelSpec, **extra) -> HistCloud:
    alg = Hist(Hist.Params(name="hist", local_steps=1, **extra), spec, seed=7)
    return alg.cloud()  # type: ignore[return-value]


@pytest.mark.parametrize("cells", [2, 3, 4])
def test_partition_disjoint_covering_fresh(cells):
    ids = [f"c{i}" for i in range(cells)]
    widths = {"fc1": 30, "fc2": 21}
    parts = draw_partition(5, 0, widths, ids)
    for layer, width in widths.items():
        groups = [parts[c][layer] for c in ids]
        together = np.concatenate(groups)
        assert sorted(together.tolist()) == list(range(width))  # covering and disjoint
        assert max(map(len, groups)) - min(map(len, groups)) <= 1  # equal sizes (up to the remainder)
    again = draw_partition(5, 0, widths, ids)
    assert all(np.array_equal(again[c]["fc1"], parts[c]["fc1"]) for c in ids)  # seeded
    later = draw_partition(5, 1, widths, ids)
    assert any(not np.array_equal(later[c]["fc1"], parts[c]["fc1"]) for c in ids)  # redrawn every round


def _mask(axes, idx, shape) -> np.ndarray:
    """The 0/1 mask p_j of eq. (2) over one tensor, from the index sets (an outer product of memberships)."""
    mask = np.ones(shape, dtype=bool)
    for dim, (layer, n) in enumerate(zip(axes, shape)):
        if layer is not None:
            member = np.zeros(n, dtype=bool)
            member[idx[layer]] = True
            mask &= member.reshape([-1 if d == dim else 1 for d in range(len(shape))])
    return mask


def _embed(sub, idx, axes, shapes) -> dict[str, np.ndarray]:
    """The dense submodel written into a zero full model (``p_j ⊙ x`` with the submodel's values)."""
    out = {}
    for k, shape in shapes.items():
        full = np.zeros(shape, np.float64)
        full[_mask(axes[k], idx, shape)] = sub[k].ravel()  # boolean indexing runs in the slices' row-major order
        out[k] = full
    return out


@pytest.mark.parametrize("spec", [MLP, DEEP, CNN])
@pytest.mark.parametrize("cells", [2, 3, 5])
def test_every_weight_in_exactly_one_submodel(spec, cells):
    """Eq. (3): the masks of a round are disjoint and cover every weight; only whole layers' biases are shared."""
    cloud = _cloud(spec)
    before = P.copy(cloud.model)
    tasks = cloud.plan(4, [f"c{i}" for i in range(cells)])
    widths, axes = unit_axes(spec)
    count = {k: np.zeros(v.shape, dtype=int) for k, v in before.items()}
    for _cell, task in tasks.items():
        sub, idx = split_task(task)
        assert set(idx) == set(widths)
        for k in before:
            mask = _mask(axes[k], idx, before[k].shape)
            assert sub[k].size == mask.sum()
            np.testing.assert_array_equal(sub[k].ravel(), before[k][mask])  # the slice holds the model's values
            count[k] += mask
    shared = sorted(k for k, c in count.items() if (c == cells).all())
    for k, c in count.items():
        if k not in shared:
            assert (c == 1).all(), k  # disjoint and covering
    assert all(k.endswith(".bias") for k in shared)  # every weight belongs to exactly one submodel
    if spec.name == "cnn":
        assert widths == {"conv1": 6, "fc1": 24} and shared == ["conv2.bias", "out.bias"]
    else:
        assert list(widths) == [f"fc{i}" for i in range(1, len(spec.hidden) + 1, 2)]
        assert shared == sorted([f"fc{i}.bias" for i in range(2, len(spec.hidden) + 1, 2)] + ["out.bias"])
    # untrained submodels reassemble bit for bit
    reports = {
        c: Payload(
            {"weight": 1.0}, {**P.zeros_like(split_task(t)[0]), **{INDEX + k: v for k, v in split_task(t)[1].items()}}
        )
        for c, t in tasks.items()
    }
    for c, r in reports.items():
        cloud.check(c, r)
    cloud.aggregate(4, reports)
    assert all(cloud.model[k].tobytes() == before[k].tobytes() for k in before)


@pytest.mark.parametrize("spec", [MLP, CNN])
def test_cloud_merge_equals_numpy(spec):
    """x̄ ← Σ_j p_j ⊙ x̄_j for the partitioned weights (eq. 6), a weighted mean for the shared biases."""
    cloud = _cloud(spec)
    before = {k: v.astype(np.float64) for k, v in cloud.model.items()}
    cells = ["c0", "c1", "c2", "c3"]
    tasks = cloud.plan(2, cells)
    _, axes = unit_axes(spec)
    g = rng(3, "test.deltas")
    reports, expected = {}, {k: np.zeros_like(v) for k, v in before.items()}
    weights = {c: float(w) for c, w in zip(cells, (1.0, 2.0, 0.5, 3.0))}
    for cell in cells:
        sub, idx = split_task(tasks[cell])
        delta = {k: g.standard_normal(v.shape).astype(np.float32) for k, v in sub.items()}
        reports[cell] = Payload({"weight": weights[cell]}, {**delta, **{INDEX + k: v for k, v in idx.items()}})
        full = _embed(delta, idx, axes, {k: v.shape for k, v in before.items()})
        for k in before:
            shared = not any(axes[k])
            expected[k] += full[k] * (weights[cell] / sum(weights.values()) if shared else 1.0)
    cloud.aggregate(2, reports)
    for k in before:
        np.testing.assert_allclose(cloud.model[k], before[k] + expected[k], rtol=1e-5, atol=1e-6)


def test_a_model_without_an_exact_partition_is_refused_at_start():
    for model, match in (
        ({"name": "mlp", "hidden": [24, 16]}, "2 hidden layers"),
        ({"name": "mlp", "hidden": [24, 2, 2]}, r"\{.fc3.: 2\} have fewer units than the 3 cells"),
        ({"name": "cnn", "channels": [2, 8], "fc": 32}, "conv1"),
        ({"name": "logreg"}, "has none"),
    ):
        cfg = _config("hist", 3)
        cfg["model"] = model
        with pytest.raises(ConfigError, match=match):
            run_simulation(parse_config(cfg), write_output=False)


def test_cloud_scatters_cell_values_and_averages_shared():
    cloud = _cloud(MLP)
    before = P.copy(cloud.model)
    tasks = cloud.plan(3, ["c0", "c1"])
    reports = {}
    for i, (cell, task) in enumerate(sorted(tasks.items())):
        sub, idx = split_task(task)
        delta = {k: np.full_like(v, i + 1.0) for k, v in sub.items()}
        reports[cell] = Payload({"weight": 1.0 + i}, {**delta, **{INDEX + k: v for k, v in idx.items()}})
    cloud.aggregate(3, reports)
    rows0 = split_task(tasks["c0"])[1]["fc1"]
    rows1 = split_task(tasks["c1"])[1]["fc1"]
    np.testing.assert_allclose(cloud.model["fc1.weight"][rows0], before["fc1.weight"][rows0] + 1, rtol=1e-6)
    np.testing.assert_allclose(cloud.model["fc1.bias"][rows1], before["fc1.bias"][rows1] + 2, rtol=1e-6)
    # out.bias touches no hidden unit: shared, weighted mean (1*1 + 2*2) / 3
    np.testing.assert_allclose(cloud.model["out.bias"], before["out.bias"] + 5 / 3, rtol=1e-6)


def test_check_rejects_wrong_index_sets_and_shapes():
    cloud = _cloud(MLP)
    tasks = cloud.plan(0, ["c0", "c1"])
    sub, idx = split_task(tasks["c0"])
    other = split_task(tasks["c1"])[1]
    with pytest.raises(Rejected, match="index sets"):
        cloud.check("c0", Payload({"weight": 1.0}, {**sub, **{INDEX + k: v for k, v in other.items()}}))
    bad = dict(sub, **{"fc1.weight": np.zeros((3, 64), np.float32)})
    with pytest.raises(Rejected):
        cloud.check("c0", Payload({"weight": 1.0}, {**bad, **{INDEX + k: v for k, v in idx.items()}}))
    nan = dict(sub, **{"out.bias": np.full(10, np.nan, np.float32)})
    with pytest.raises(Rejected):
        cloud.check("c0", Payload({"weight": 1.0}, {**nan, **{INDEX + k: v for k, v in idx.items()}}))
    with pytest.raises(Rejected, match="no submodel"):
        cloud.check("c9", Payload({"weight": 1.0}, {**sub, **{INDEX + k: v for k, v in idx.items()}}))


@pytest.mark.parametrize("spec", [ModelSpec(name="mlp", input_shape=(64,), num_classes=10, hidden=(24,)), MLP, CNN])
def test_dense_submodel_equals_masked_full_model(spec):
    """Training the small dense submodel = training the full model with the other units zeroed (eq. 4)."""
    cloud = _cloud(spec)
    sub, idx = split_task(cloud.plan(0, ["c0", "c1"])["c0"])
    _, axes = unit_axes(spec)
    g = rng(1, "data")
    data = LocalData(g.random((40, 64), dtype=np.float32), g.integers(0, 10, 40))
    full = TorchTrainer.from_spec(spec.name, spec.input_shape, 10, **spec.build_kwargs())
    narrow = sub_spec(spec, {k: len(v) for k, v in idx.items()})
    dense = full.for_model(narrow)
    assert full.for_model(narrow) is dense  # cached per shape
    shapes = {k: v.shape for k, v in cloud.model.items()}
    dense.set_params(sub)
    full.set_params({k: v.astype(np.float32) for k, v in _embed(sub, idx, axes, shapes).items()})
    for t in (dense, full):
        t.sgd(data, steps=5, batch_size=8, lr=0.1, rng=rng(2, "batches"))
    a, b = dense.get_params(), full.get_params()
    for k in a:
        mask = _mask(axes[k], idx, shapes[k])
        np.testing.assert_allclose(a[k].ravel(), b[k][mask], atol=1e-5)
        assert not b[k][~mask].any(), k  # masked units stay 0


def _config(alg: str, cells: int, **algo) -> dict:
    return {
        "run": {"name": "t", "seed": 1, "rounds": 4},
        "topology": {"cells": cells, "devices_per_cell": 2},
        "algorithm": {"name": alg, "edge_rounds": 2, "local_steps": 8, "batch_size": 16, "lr": 0.1, **algo},
        "model": {"name": "mlp", "hidden": [120]},
        "data": {"dataset": "digits", "partition": "shards", "shards_per_device": 2},
    }


@pytest.mark.parametrize("cells", [2, 3])
def test_only_slices_travel_measured_bytes(cells):
    fed = run_simulation(parse_config(_config("fedavg", cells)), write_output=False)
    hist = run_simulation(parse_config(_config("hist", cells)), write_output=False)
    d_part, d_shared = 64 * 120 + 120 + 120 * 10, 10  # values touching hidden units, output bias
    for rec_f, rec_h in zip(fed.history, hist.history):
        bf, bh = rec_f["bytes"], rec_h["bytes"]
        # FedAvg sends the full model on every link: (d_part + d_shared) floats plus a small envelope
        assert 0 < bf["cloud_to_cell"] - cells * 4 * (d_part + d_shared) < cells * 1500
        # HIST: each cell gets 1/N of the partitioned values, the shared ones, and 120/N int32 indices
        expected = 4 * (d_part + cells * d_shared + 120)
        assert 0 < bh["cloud_to_cell"] - expected < cells * 1500
        assert 0 < bh["cell_to_cloud"] - expected < cells * 1500
        # devices: 2 per cell, 2 edge rounds, submodel only (no index sets below the cell)
        dev = 4 * (d_part + cells * d_shared) * 2 * 2
        for tier in ("cell_to_device", "device_to_cell"):
            assert 0 < bh[tier] - dev < cells * 4 * 1500
            assert bh[tier] / bf[tier] == pytest.approx(1 / cells, rel=0.03)
        # the paper's unit: per-device upload per round, in full models: E/N for HIST, E for FedAvg
        assert rec_h["metrics"]["upload_units"] == pytest.approx(2 * (d_part / cells + d_shared) / (d_part + d_shared))
        assert rec_f["metrics"]["upload_units"] == pytest.approx(2.0)


def test_hist_learns_and_is_deterministic():
    cfg = _config("hist", 3)
    cfg["run"]["rounds"], cfg["data"] = 10, {"dataset": "digits", "partition": "iid"}
    cfg = parse_config(cfg)
    a = run_simulation(cfg, write_output=False)
    assert a.history[0]["accuracy"] < 0.8 < a.final_accuracy
    b = run_simulation(cfg, write_output=False)
    assert all(a.params[k].tobytes() == b.params[k].tobytes() for k in a.params)


def test_hist_cnn_partitions_conv_channels_and_runs():
    cfg = _config("hist", 2)
    cfg["model"] = {"name": "cnn", "channels": [4, 8], "fc": 32}
    cfg["run"]["rounds"] = 2
    res = run_simulation(parse_config(cfg), write_output=False)
    widths, axes = unit_axes(ModelSpec(name="cnn", input_shape=(1, 8, 8), num_classes=10, channels=(4, 8), fc=32))
    assert widths == {"conv1": 4, "fc1": 32} and axes["conv2.weight"][1] == "conv1"
    assert np.isfinite(res.final_accuracy) and res.history[-1]["metrics"]["cells"] == 2
    # each cell's devices upload half of the partitioned values (plus the two shared biases)
    assert res.history[-1]["metrics"]["upload_units"] < 0.6 * 2


def test_device_rejects_a_task_of_another_model():
    alg = Hist(Hist.Params(name="hist", local_steps=1), MLP, seed=0)
    ctx = DeviceContext(0, 0, 0, "c0", "c0-d0")
    data = LocalData(np.zeros((4, 64), np.float32), np.zeros(4, np.int64))
    with pytest.raises(Rejected):
        alg.device("c0-d0").train(
            Payload({}, {"w": np.zeros(3, np.float32)}),
            data,
            TorchTrainer.from_spec("mlp", (64,), 10, hidden=(30, 21)),
            ctx,
        )
    assert len(encode_payload(Payload({}, {}))) < 16


def test_emulation_over_mqtt_is_bit_identical_to_sim(tmp_path):
    """``fedtier run``'s hierarchy (real broker, agent processes) gives the same HIST model as ``fedtier sim``."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    def cfg(out):
        c = _config("hist", 2)
        c["run"].update(rounds=2, output=str(out))
        c["model"]["hidden"] = [24]
        return parse_config(c)

    sim = run_simulation(cfg(tmp_path / "sim"))
    with EmbeddedBroker() as broker:
        emu = Emulation(cfg(tmp_path / "emu"), broker_url=broker.url).run()
    assert all(np.array_equal(emu.params[k], sim.params[k]) for k in sim.params)


def test_hist_composes_with_an_uplink_codec():
    """The device -> cell codecs work on HIST's submodels: 1-bit SignSGD uplink, still learning."""
    base = _config("hist", 2)
    base["run"]["rounds"], base["data"] = 10, {"dataset": "digits", "partition": "iid"}
    dense = run_simulation(parse_config(base), write_output=False)
    base["algorithm"] = {**base["algorithm"], "uplink": "signsgd", "lr": 0.05}
    signed = run_simulation(parse_config(base), write_output=False)
    up_dense = sum(r["bytes"]["device_to_cell"] for r in dense.history)
    up_sign = sum(r["bytes"]["device_to_cell"] for r in signed.history)
    assert up_sign < up_dense / 20  # ~1 bit instead of 32 per value, plus headers
    assert signed.final_accuracy > 0.7
