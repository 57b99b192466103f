"""FedProx (``algorithm.prox_mu``): the device's proximal term, on FedAvg and HIST."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protocols.config import parse_config
from protocols.torch_trainer import TorchTrainer
from protocols.trainer import LocalData, batches
from sim.launcher import run_simulation


def _data(n: int = 40, seed: int = 0) -> LocalData:
    g = np.random.default_rng(seed)
    return LocalData(g.standard_normal((n, 8)).astype(np.float32), g.integers(0, 3, n).astype(np.int64))


def test_proximal_sgd_matches_autograd_on_the_prox_objective():
    """Each step descends loss + mu/2 ||w - w_0||^2 (w_0: the parameters the call started from)."""
    mu, lr, steps = 0.7, 0.1, 6
    trainer = TorchTrainer.from_spec("mlp", (8,), 3, hidden=(5,))
    start = trainer.get_params()
    data = _data()
    trainer.sgd(data, steps=steps, batch_size=8, lr=lr, rng=np.random.default_rng(3), prox_mu=mu)
    got = trainer.get_params()

    ref = TorchTrainer.from_spec("mlp", (8,), 3, hidden=(5,))
    ref.set_params(start)
    w0 = {k: torch.from_numpy(v.copy()) for k, v in start.items()}
    x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
    for idx in batches(len(data), 8, steps, np.random.default_rng(3)):
        ref.model.zero_grad()
        it = torch.from_numpy(idx)
        prox = sum(((p - w0[k]) ** 2).sum() for k, p in ref.model.named_parameters())
        (F.cross_entropy(ref.model(x[it]), y[it]) + mu / 2 * prox).backward()
        with torch.no_grad():
            for p in ref.model.parameters():
                p -= lr * p.grad
    want = ref.get_params()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6)
    plain = TorchTrainer.from_spec("mlp", (8,), 3, hidden=(5,))
    plain.set_params(start)
    plain.sgd(data, steps=steps, batch_size=8, lr=lr, rng=np.random.default_rng(3))
    # the proximal term pulls towards w_0: the update is shorter than plain SGD's
    norm = lambda a: float(np.sqrt(sum(((a[k] - start[k]) ** 2).sum() for k in a)))  # noqa: E731
    assert norm(got) < norm(plain.get_params())


def _cfg(name: str, **algo) -> dict:
    return {
        "run": {"name": "prox", "seed": 2, "rounds": 2},
        "topology": {"cells": 2, "devices_per_cell": 3},
        "algorithm": {"name": name, "local_steps": 5, "batch_size": 16, "lr": 0.1, **algo},
        "model": {"name": "mlp", "hidden": [16]},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 0.3},
    }


@pytest.mark.parametrize("name", ["fedavg", "hist"])
def test_mu_zero_is_fedavg_bit_for_bit_and_mu_changes_the_model(name):
    plain = run_simulation(parse_config(_cfg(name)), write_output=False)
    zero = run_simulation(parse_config(_cfg(name, prox_mu=0.0)), write_output=False)
    assert all(plain.params[k].tobytes() == zero.params[k].tobytes() for k in plain.params)
    prox = run_simulation(parse_config(_cfg(name, prox_mu=1.0)), write_output=False)
    assert any(plain.params[k].tobytes() != prox.params[k].tobytes() for k in plain.params)
