"""Where the engines compute (issue #33): ``runtime.device`` checked at start, ``auto``'s logged choice,
a cohort computed in parts (a CPU's cache, a GPU's memory) with the whole cohort's results, a device too
large for the GPU refused with the sizes, and the CUDA paths (skipped without a GPU)."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from edge_agent.cohort import run_cohort
from protocols.algorithms.base import ModelSpec
from protocols.cohort_trainer import CohortEngine, Request
from protocols.config import ConfigError
from protocols.models import build_model, init_params
from protocols.torch_trainer import pick_device
from protocols.trainer import LocalData
from protocols.wire.payload import Payload
from sim.launcher import SimHierarchy

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
SPEC = ModelSpec(name="mlp", input_shape=(8,), num_classes=3, hidden=(6,))


def requests(n: int, momentum: float = 0.0, steps: int = 0) -> list[Request]:
    """``n`` devices' sgd requests: uneven data (so uneven steps and short last batches), seeded orders
    (an epoch, or its first ``steps`` batches)."""
    g = np.random.default_rng(0)
    params = init_params(build_model("mlp", (8,), 3, hidden=(6,)), 0)
    out = []
    for i in range(n):
        m = 5 + 7 * i
        x, y = g.normal(size=(m, 8)).astype(np.float32), g.integers(0, 3, m)
        order = [np.random.default_rng(i).permutation(m)[s : s + 4] for s in range(0, m, 4)]
        order = order[:steps] if steps else order
        out.append(Request("sgd", SPEC, params, x, y, order, lr=0.1, momentum=momentum))
    return out


def results(engine: CohortEngine, reqs: list[Request]) -> list:
    engine.run(reqs)
    return [r.result for r in reqs]


@pytest.mark.parametrize("momentum", [0.0, 0.9], ids=["plain", "momentum"])
def test_a_cohort_in_parts_gives_the_whole_cohorts_results(momentum: float) -> None:
    whole = results(CohortEngine(), requests(7, momentum))
    parts = CohortEngine()
    parts.part_devices = 3  # 3 + 3 + 1
    limited = CohortEngine()
    limited.memory_limit = 2 * max(_bytes(r) for r in requests(7, momentum))  # 2 devices fit at once
    for engine in (parts, limited):
        for (p, s), (q, t) in zip(whole, results(engine, requests(7, momentum))):
            assert s.steps == t.steps and s.samples == t.samples and t.loss == pytest.approx(s.loss, rel=1e-5)
            for k in p:
                np.testing.assert_allclose(q[k], p[k], rtol=1e-5, atol=1e-7)
    assert len({s.steps for _, s in whole}) > 1  # the devices really differ


@pytest.mark.parametrize("steps", [0, 2], ids=["epoch", "few-steps"])
def test_the_cohorts_gather_gives_each_devices_own_batches(steps: int) -> None:
    """An epoch gathers from the joined data sets, two steps from each device's (its data is much larger
    than its batches): either way each device's result is the one it gets trained alone."""
    whole = results(CohortEngine(), requests(6, steps=steps))
    for i, (p, s) in enumerate(whole):
        alone = results(CohortEngine(), [requests(6, steps=steps)[i]])[0]
        assert s.steps == alone[1].steps and s.loss == pytest.approx(alone[1].loss, rel=1e-5)
        for k in p:
            np.testing.assert_allclose(p[k], alone[0][k], rtol=1e-5, atol=1e-7)


def _bytes(r: Request) -> int:
    from protocols.cohort_trainer import _device_bytes

    return _device_bytes("sgd", build_model("mlp", (8,), 3, hidden=(6,)), r)


def test_data_kept_across_cohorts_within_a_byte_budget(monkeypatch) -> None:
    """What a GPU engine does (here on the CPU, ``keep_data`` on): each device's data set is converted once
    and kept across cohorts, the least recently used dropped beyond the budget; results unchanged."""
    import protocols.cohort_trainer as ct

    reqs = requests(4)  # 5, 12, 19, 26 samples

    def size(r: Request) -> int:
        return r.x.size * 4 + r.y.size * 8  # float32 inputs, int64 labels

    monkeypatch.setattr(ct, "DEVICE_DATA_BYTES", size(reqs[1]) + size(reqs[2]))  # the first two fit, not all three
    engine = ct.CohortEngine()
    engine.keep_data = True
    first = results(engine, reqs[:2])
    engine.forget_data()
    kept = {id(r.x) for r in reqs[:2]}
    assert set(engine._data) == kept  # both fit the budget: kept for the next round
    xt = engine.tensors(reqs[0].x, reqs[0].y)[0]
    assert engine.tensors(reqs[0].x, reqs[0].y)[0] is xt  # converted once
    again = results(engine, reqs[:2])
    for (p, _), (q, _) in zip(first, again):
        for k in p:
            np.testing.assert_array_equal(p[k], q[k])
    results(engine, reqs[2:3])  # a third device: over the budget once this cohort is done
    engine.forget_data()
    assert set(engine._data) == {id(reqs[0].x), id(reqs[2].x)}  # the least recently used (device 1) went
    assert engine._data_bytes == sum(x.nbytes + y.nbytes for _, x, y in engine._data.values())
    plain = ct.CohortEngine()
    results(plain, reqs[:2])
    plain.forget_data()
    assert not plain._data  # on the CPU nothing is kept by default


def test_devices_that_are_rows_of_one_data_set_train_from_it_without_a_copy() -> None:
    """``fedtier sim``'s devices are rows of the data set (``DatasetRows``): the engine gathers their minibatches
    from the data set itself (read-only, used as it is), never copying a device's samples out, and each device's
    result is bit for bit the one it gets from its own copy (uneven devices: short last batches, uneven steps)."""
    from protocols.trainer import DatasetRows

    g = np.random.default_rng(1)
    x_all, y_all = g.normal(size=(90, 8)).astype(np.float32), g.integers(0, 3, 90)
    x_all.flags.writeable = y_all.flags.writeable = False  # as a shared, cached data set
    cut = np.split(g.permutation(90), [5, 17, 36, 60])
    params = init_params(build_model("mlp", (8,), 3, hidden=(6,)), 0)

    def train(data: list[LocalData]) -> tuple[list, CohortEngine]:
        def job(i: int):
            def run(trainer):
                trainer.set_params(params)
                steps = -(-len(data[i]) // 4)  # an epoch
                stats = trainer.sgd(data[i], steps=steps, batch_size=4, lr=0.1, rng=np.random.default_rng(i))
                return trainer.params, stats

            return run

        engine = CohortEngine()
        return [out for out, _ in run_cohort(engine, SPEC, [job(i) for i in range(len(data))])], engine

    rows = [DatasetRows(x_all, y_all, r) for r in cut]
    gathered, engine = train(rows)
    own, _ = train([LocalData(x_all[r], y_all[r]) for r in cut])
    assert all("x" not in vars(d) and "y" not in vars(d) for d in rows)  # no device's samples copied out
    assert [xt.data_ptr() for _, xt, _ in engine._data.values()] == [x_all.ctypes.data]  # nor the data set
    for (p, s), (q, t) in zip(gathered, own):
        assert (s.steps, s.samples, s.loss) == (t.steps, t.samples, t.loss)
        for k in p:
            np.testing.assert_array_equal(p[k], q[k])
    assert [s.steps for _, s in gathered] == [2, 3, 5, 6, 8]  # uneven devices (epochs of 5 to 30 samples)
    assert np.array_equal(rows[2].x, x_all[cut[2]]) and len(rows[2]) == len(cut[2])  # a role reading them copies


def test_devices_that_start_from_one_shared_task_get_it_stacked_into_memory_of_their_own() -> None:
    """A cell's task reaches its devices as views of one shared message: the engine takes that memory once (on a GPU
    one upload, not one a device) and repeats it into a stack of the call's own, the same values as a stack of
    copies, never writing into the message (other views, other layouts: stacked as before)."""
    from protocols.cohort_batches import stacked

    message = np.arange(24, dtype=np.float32).tobytes()  # immutable bytes, as a received message's
    views = [np.ndarray((2, 3), np.float32, message, 24) for _ in range(4)]  # each device's view of one tensor
    out = stacked(views, torch.device("cpu"), once=True)  # (what a GPU does; the CPU stacks with numpy)
    assert torch.equal(out, torch.from_numpy(np.stack(views))) and out.is_contiguous()
    out += 1  # training writes into its stack, never into the message
    assert np.frombuffer(message, np.float32).tolist() == list(range(24))
    others = [views[0], np.ndarray((2, 3), np.float32, message, 0)]  # another part of the message: not one memory
    assert torch.equal(stacked(others, torch.device("cpu"), once=True), torch.from_numpy(np.stack(others)))
    assert torch.equal(stacked(views, torch.device("cpu")), out - 1)


def test_a_device_too_large_for_the_memory_is_refused_with_the_sizes() -> None:
    engine = CohortEngine()
    engine.memory_limit = 1000  # bytes: not one device fits
    with pytest.raises(MemoryError, match=r"needs about .* MiB on cpu, but .* MiB is free"):
        engine.run(requests(2))

    def job(trainer):
        r = requests(1)[0]
        trainer.set_params(r.params)
        stats = trainer.sgd(LocalData(r.x, r.y), steps=2, batch_size=4, lr=0.1, rng=np.random.default_rng(0))
        return Payload({"loss": stats.loss}, trainer.get_params())

    outcomes = run_cohort(engine, SPEC, [job, job], ["a", "b"])  # each device fails alone, with the reason
    assert all(result is None and "MiB" in error for result, error in outcomes)


def test_device_setting_is_checked(make_config) -> None:
    with pytest.raises(ConfigError, match="runtime.device"):
        make_config(runtime={"device": "gpu"})
    assert make_config(runtime={"device": "cuda:1"}).runtime.device == "cuda:1"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("engine", ["device", "cohort"])
def test_cuda_without_cuda_is_one_clear_error_at_start(make_config, engine: str) -> None:
    cfg = make_config(runtime={"device": "cuda", "engine": engine})
    with pytest.raises(ConfigError, match=r"runtime.device = 'cuda' but this machine has 0 CUDA device"):
        SimHierarchy(cfg, write_output=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_fedtier_sim_on_cuda_without_cuda_exits_2_with_one_line(tmp_path, make_config) -> None:
    from click.testing import CliRunner

    from fedtier.cli import main

    path = tmp_path / "c.toml"
    path.write_text(make_config(run={"rounds": 1, "output": str(tmp_path / "out")}).to_toml())
    res = CliRunner().invoke(main, ["sim", str(path), "--set", "runtime.device=cuda", "--no-progress"])
    assert res.exit_code == 2 and "runtime.device = 'cuda' but this machine has 0 CUDA device" in res.output
    assert "Traceback" not in res.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())  # a monitor of the folder ends (735c7e8)
    assert summary["status"] == "failed" and "runtime.device = 'cuda'" in summary["failed"], summary


def test_auto_logs_its_choice(caplog) -> None:
    caplog.set_level(logging.INFO, logger="fedtier.device")
    from protocols import torch_trainer

    torch_trainer._told.clear()
    chosen = pick_device("auto")
    assert chosen.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert f"runtime.device = auto: chose {chosen.type}" in caplog.text


def test_auto_keeps_a_small_cohort_on_the_cpu(monkeypatch, caplog) -> None:
    """With a GPU present (here pretended), ``auto`` computes a cohort whose step is little work on the
    CPU and says why; the results are the CPU engine's."""
    caplog.set_level(logging.INFO, logger="fedtier.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    engine = CohortEngine("auto")
    got = results(engine, requests(3))
    assert engine.device.type == "cpu" and "chose cpu" in caplog.text and "multiply-adds a step" in caplog.text
    for (p, _), (q, _) in zip(results(CohortEngine(), requests(3)), got):
        for k in p:
            np.testing.assert_array_equal(p[k], q[k])


def test_auto_counts_each_probe_of_a_zeroth_order_request(monkeypatch, caplog) -> None:
    """DeComFL's paper preset: 10 devices probing P + 1 = 11 models of 28,938 parameters on a batch of 32 is ~100M
    multiply-adds a step: ``auto`` chooses the GPU (counting only the 10 requests, 9.3M, it chose the CPU)."""
    caplog.set_level(logging.INFO, logger="fedtier.device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("protocols.cohort_trainer.pick_device", lambda device: torch.device("cpu"))  # no GPU here
    spec = ModelSpec(name="cnn", input_shape=(1, 28, 28), num_classes=10, channels=(16, 32), fc=0)
    params = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 0)
    z = tuple(np.zeros(28938, np.float32) for _ in range(10))
    x, y = np.zeros((32, 1, 28, 28), np.float32), np.zeros(32, np.int64)
    CohortEngine("auto")._choose([Request("probe", spec, params, x, y, directions=z, mu=1e-3) for _ in range(10)])
    assert "110 models x batch 32 x 28938 parameters" in caplog.text and "the GPU" in caplog.text


# ------------------------------------------------------------------------------ on a GPU only
@cuda
def test_per_device_engine_trains_on_cuda(make_config) -> None:
    """Item 6: the per-device engine (what fedtier agent runs) on CUDA reaches the CPU's model."""
    cpu = SimHierarchy(make_config(run={"rounds": 2}), write_output=False).run()
    gpu_sim = SimHierarchy(make_config(run={"rounds": 2}, runtime={"device": "cuda"}), write_output=False)
    gpu = gpu_sim.run()
    for k in cpu.params:
        np.testing.assert_allclose(gpu.params[k], cpu.params[k], rtol=1e-3, atol=1e-5)
    assert abs(gpu.final_accuracy - cpu.final_accuracy) <= 0.02


@cuda
def test_cohort_on_cuda_keeps_data_on_the_gpu_and_splits_to_fit() -> None:
    engine = CohortEngine("cuda")
    reqs = requests(5)
    first = results(engine, reqs)
    engine.forget_data()
    assert engine._data and all(xt.is_cuda for _, xt, _ in engine._data.values())  # kept for the next round
    engine.memory_limit = 2 * max(_bytes(r) for r in reqs)
    for (p, _), (q, _) in zip(first, results(engine, reqs)):
        for k in p:
            np.testing.assert_allclose(q[k], p[k], rtol=1e-4, atol=1e-6)
    for (p, _), (q, _) in zip(results(CohortEngine(), requests(5)), first):
        for k in p:
            np.testing.assert_allclose(q[k], p[k], rtol=1e-4, atol=1e-6)


@cuda
def test_auto_puts_a_large_cohort_on_the_gpu(caplog) -> None:
    caplog.set_level(logging.INFO, logger="fedtier.device")
    spec = ModelSpec(name="mlp", input_shape=(784,), num_classes=10, hidden=(200, 200))
    params = init_params(build_model("mlp", (784,), 10, hidden=(200, 200)), 0)
    g = np.random.default_rng(0)
    x, y = g.random((60, 784), dtype=np.float32), g.integers(0, 10, 60)
    order = [np.arange(s, s + 10) for s in range(0, 60, 10)]
    reqs = [Request("sgd", spec, params, x, y, order, lr=0.05) for _ in range(16)]
    engine = CohortEngine("auto")
    engine.run(reqs)
    assert engine.device.type == "cuda" and "chose cuda" in caplog.text


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_evaluation_keeps_its_held_out_set_on_the_device_and_each_set_its_own_result(device: str) -> None:
    """The cloud's evaluation (``TorchTrainer.evaluate``) keeps the last set it evaluated on the trainer's
    device (uploaded once, not every round) and gives exactly the chunk-by-chunk result; a different set, even
    one the same size, is evaluated afresh (the cache is keyed by the arrays, not their ids or sizes)."""
    import torch.nn.functional as F

    from protocols.torch_trainer import TorchTrainer

    trainer = TorchTrainer.from_spec("mlp", (12,), 4, device, hidden=(8,))
    g = np.random.default_rng(0)
    sets = [(g.normal(size=(50, 12)).astype(np.float32), g.integers(0, 4, 50)) for _ in range(2)]

    def by_chunks(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:  # the evaluation before the cache
        total, correct = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(y), 16):
                xt = torch.from_numpy(x[start : start + 16]).to(trainer.device)
                yt = torch.from_numpy(y[start : start + 16]).to(trainer.device)
                out = trainer.model(xt)
                total += float(F.cross_entropy(out, yt, reduction="sum"))
                correct += int((out.argmax(1) == yt).sum())
        return total / len(y), correct / len(y)

    expected = [by_chunks(x, y) for x, y in sets]
    assert expected[0] != expected[1]
    for x, y in [*sets, *sets]:
        assert trainer.evaluate(x, y, batch_size=16) == expected[[s[0] is x for s in sets].index(True)]
        assert trainer._eval_cache is not None and trainer._eval_cache[2].device.type == trainer.device.type
    held = trainer._eval_cache[2]
    assert trainer.evaluate(*sets[1], batch_size=16) == expected[1] and trainer._eval_cache[2] is held  # kept


def test_a_calls_minibatch_indices_and_masks_are_each_batch_where_its_step_is() -> None:
    """The engine's batch assembly writes each device's full batches in one copy and the short ones (an epoch's last,
    wherever it falls: several epochs, fewer steps than others) one by one: the indices and masks a step-by-step
    construction gives, mapped to the device's rows of the data set."""
    from protocols.cohort_batches import minibatches

    g = np.random.default_rng(3)
    data = (torch.zeros(100, 8), torch.zeros(100, dtype=torch.long))
    reqs = []
    for i, (n, epochs, steps) in enumerate([(10, 1, 0), (12, 1, 0), (10, 3, 7), (9, 2, 0), (4, 1, 0)]):
        order = [p[s : s + 4] for p in (g.permutation(n) for _ in range(epochs)) for s in range(0, n, 4)]
        r = Request("sgd", SPEC, {}, np.zeros((n, 8), np.float32), np.zeros(n, np.int64), order[: steps or None])
        r.rows = g.permutation(100)[:n] if i % 2 == 0 else None
        reqs.append(r)
    reqs.sort(key=lambda r: -len(r.order))  # (as the engine orders them: most steps first)
    _, _, _, idx, mask = minibatches(reqs, [data] * len(reqs))
    want_idx, want_mask = np.zeros_like(idx), np.zeros_like(mask)
    for i, r in enumerate(reqs):
        for s, batch in enumerate(r.order):
            want_idx[i, s, : len(batch)], want_mask[i, s, : len(batch)] = batch, 1.0
        if r.rows is not None:
            want_idx[i] = r.rows[want_idx[i]]
    assert idx.shape == (5, 7, 4) and np.array_equal(idx, want_idx) and np.array_equal(mask, want_mask)


def test_a_step_shares_one_rate_where_every_device_active_then_has_samples_in_it() -> None:
    """``StepTerms.same_rate`` (one fused update a step, CUDA graphs) holds at step ``s`` exactly where each of the
    devices still active then has a sample in its batch, under one learning rate: random masks and step counts."""
    from protocols.cohort_steps import step_terms

    g = np.random.default_rng(5)
    for _ in range(60):
        d, steps, b = (int(v) for v in g.integers(1, 7, 3))
        mask = (g.random((d, steps, b)) < 0.4).astype(np.float32)
        active = sorted((int(a) for a in g.integers(1, d + 1, steps)), reverse=True)
        rates = [0.1] * d if g.random() < 0.8 else [0.1] * (d - 1) + [0.2]
        reqs = [Request("sgd", SPEC, {}, np.zeros((1, 8), np.float32), np.zeros(1, np.int64), lr=lr) for lr in rates]
        counts = torch.from_numpy(mask.sum(2))
        terms = step_terms(reqs, {"w": torch.zeros(d, 2)}, counts, mask, active)
        uniform = len(set(rates)) == 1
        want = [uniform and all(mask[i, s].sum() > 0 for i in range(a)) for s, a in enumerate(active)]
        assert terms.same_rate == want
