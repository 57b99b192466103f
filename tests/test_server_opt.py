"""Server optimizers at the cloud (FedAvgM, FedAdagrad, FedAdam, FedYogi): the update rules, checkpoints, configs."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.algorithms.fedavg import FedAvgCloud, FedAvgParams
from protocols.algorithms.server_opt import ServerOptimizer
from protocols.config import ConfigError, parse_config
from protocols.wire.payload import Payload
from sim.launcher import run_simulation

LR, B1, B2, TAU, MOM = 0.05, 0.8, 0.95, 0.01, 0.7


def _params(name: str, **kw) -> FedAvgParams:
    return FedAvgParams(
        name="fedavg",
        local_steps=1,
        server_optimizer=name,
        server_lr=LR,
        server_beta1=B1,
        server_beta2=B2,
        server_tau=TAU,
        server_momentum=MOM,
        **kw,
    )


def _deltas() -> list[np.ndarray]:
    """Three rounds; round 1 is tiny on half the coordinates so that Yogi's sign(v - Delta^2) takes both signs."""
    g = np.random.default_rng(7)
    d = [g.standard_normal(12).astype(np.float32) for _ in range(3)]
    d[1][:6] *= 1e-3
    return d


def _reference(name: str, x0: np.ndarray, deltas: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Reddi et al. 2021, Algorithm 2 (m_{-1} = 0, v_{-1} = tau^2), and FedAvgM; the model is float32 each round."""
    x, m, v = x0.astype(np.float32), np.zeros(x0.shape), np.full(x0.shape, TAU**2)
    xs, signs = [], []
    for d in (dd.astype(np.float64) for dd in deltas):
        if name == "fedavgm":
            m = MOM * m + d
            step = m
        else:
            m = B1 * m + (1 - B1) * d
            if name == "fedadagrad":
                v = v + d**2
            elif name == "fedadam":
                v = B2 * v + (1 - B2) * d**2
            else:
                signs.append(np.sign(v - d**2))
                v = v - (1 - B2) * d**2 * np.sign(v - d**2)
            step = m / (np.sqrt(v) + TAU)
        x = (x.astype(np.float64) + LR * step).astype(np.float32)
        xs.append(x)
    return xs, signs


@pytest.mark.parametrize("name", ["fedavgm", "fedadagrad", "fedadam", "fedyogi"])
def test_each_optimizer_matches_a_direct_numpy_computation_over_three_rounds(name):
    x0 = np.random.default_rng(1).standard_normal(12).astype(np.float32)
    deltas = _deltas()
    expected, signs = _reference(name, x0, deltas)
    opt = ServerOptimizer(_params(name))
    model = {"w": x0}
    for t, d in enumerate(deltas):
        model, amplified = opt.step(t, model, {"w": d})
        assert not amplified and model["w"].dtype == np.float32
        np.testing.assert_allclose(model["w"], expected[t], rtol=1e-6, atol=1e-7)
    if name == "fedyogi":  # the sign rule was exercised both ways: v grew on some coordinates and shrank on others
        assert (np.concatenate(signs) > 0).any() and (np.concatenate(signs) < 0).any()
    # the optimizers really differ from each other and from plain SGD
    sgd = x0.astype(np.float64) + LR * sum(d.astype(np.float64) for d in deltas)
    assert not np.allclose(model["w"], sgd, atol=1e-4)


def test_sgd_step_is_the_plain_server_lr_step_bit_for_bit():
    opt = ServerOptimizer(_params("sgd"))
    x = {"w": np.arange(4, dtype=np.float32)}
    d = {"w": np.full(4, 0.3, np.float32)}
    new, _ = opt.step(0, x, d)
    assert new["w"].tobytes() == (x["w"] + np.asarray(LR, np.float64) * d["w"]).astype(np.float32).tobytes()
    assert opt.state().tensors == {}


def test_a_round_without_reports_leaves_model_and_state_alone():
    opt = ServerOptimizer(_params("fedadam"))
    x = {"w": np.ones(3, np.float32)}
    x1, _ = opt.step(0, x, {"w": np.ones(3, np.float32)})
    m, v = dict(opt.m), dict(opt.v)
    x2, _ = opt.step(1, x1, None)
    assert x2 is x1 and opt.m == m and opt.v == v


def test_amplification_with_momentum_or_adaptive_optimizers_is_refused():
    for name in ("fedavgm", "fedadam", "fedyogi", "fedadagrad"):
        with pytest.raises(ConfigError, match="cannot be combined with amplification"):
            parse_config(
                {"algorithm": {"name": "fedavg", "server_optimizer": name, "amplify_eta": 2.0, "amplify_period": 3}}
            )
        parse_config({"algorithm": {"name": "hist", "server_optimizer": name}})  # alone: fine
    parse_config({"algorithm": {"name": "fedavg", "amplify_eta": 2.0, "amplify_period": 3}})  # sgd + amplification
    with pytest.raises(ConfigError, match="server_optimizer"):
        parse_config({"algorithm": {"name": "fedavg", "server_optimizer": "adamw"}})


def test_optimizer_state_that_does_not_match_the_model_is_refused_on_resume():
    model = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    cloud = FedAvgCloud(_params("fedadam"), model)
    cloud.opt.step(0, model, {k: np.ones_like(v) for k, v in model.items()})
    good = cloud.state()
    FedAvgCloud(_params("fedadam"), model).load_state(good)  # round trip
    bad = Payload(good.meta, {**good.tensors, "server_opt.v/a": np.ones((3, 2))})
    with pytest.raises(ValueError, match="second moment.*shape"):
        FedAvgCloud(_params("fedadam"), model).load_state(bad)
    missing = Payload(good.meta, {k: v for k, v in good.tensors.items() if not k.startswith("server_opt.v/")})
    with pytest.raises(ValueError, match="incomplete"):
        FedAvgCloud(_params("fedadam"), model).load_state(missing)
    with pytest.raises(ValueError, match="server optimizer is 'fedadam'.*'fedyogi'"):
        FedAvgCloud(_params("fedyogi"), model).load_state(good)


def _cfg(tmp_path, **algo) -> dict:
    return {
        "run": {"name": "sopt", "seed": 5, "rounds": 6, "output": str(tmp_path / "{name}")},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "algorithm": {"name": "fedavg", "local_steps": 20, "batch_size": 16, "lr": 0.2, **algo},
        "model": {"name": "mlp", "hidden": [32]},
        "data": {"dataset": "digits", "partition": "iid"},
    }


def test_fedadam_run_learns_and_resumes_bit_identically(tmp_path):
    cfg = _cfg(tmp_path, server_optimizer="fedadam", server_lr=0.05, server_tau=0.01)
    full = run_simulation(parse_config(cfg), write_output=False)
    assert full.final_accuracy > 0.7  # from 0.1 (plain FedAvg: 0.9)
    cfg["run"]["rounds"] = 3
    run_simulation(parse_config(cfg))
    cfg["run"]["rounds"] = 6
    resumed = run_simulation(parse_config(cfg), resume=True)  # m and v restored from the checkpoint
    assert all(full.params[k].tobytes() == resumed.params[k].tobytes() for k in full.params)
    cfg["algorithm"]["server_optimizer"] = "fedyogi"
    with pytest.raises(ValueError, match="server.optimizer"):
        run_simulation(parse_config(cfg), resume=True)
