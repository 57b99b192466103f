"""The zoo's CNNs run ReLU -> 2x2 max-pool as one fused step: the same values and gradients, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from protocols.models import ConvNet, build_model, init_params, relu_max_pool, set_params


def layer_by_layer(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    for layer in model.children():  # nn.Sequential's own forward: every layer as written
        x = layer(x)
    return x


@pytest.mark.parametrize(
    "name, channels, side", [("cnn", (4, 8), 28), ("cnn4", (4, 8, 8, 16), 28), ("cnn", (4, 8), 9)]
)  # 9: odd sides floor as torch does
def test_fused_relu_pool_equals_the_layers_bit_for_bit(name, channels, side):
    model = build_model(name, (1, side, side), 10, channels=channels, fc=0 if name == "cnn" else 512)
    assert isinstance(model, ConvNet)
    set_params(model, init_params(model, seed=3))
    x = torch.randn(16, side * side, generator=torch.Generator().manual_seed(0))
    x[:4] = x[:4].round()  # integer pixels: exact ties inside pooling windows, positive and negative
    with torch.no_grad():  # the strided forward-only path
        assert torch.equal(model(x), layer_by_layer(model, x))
    y = torch.randint(0, 10, (16,))
    grads = []
    for forward in (model, lambda v: layer_by_layer(model, v)):
        model.zero_grad()
        loss = nn.functional.cross_entropy(forward(x), y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_relu_max_pool_ties_and_other_pools():
    x = torch.tensor([[[[3.0, 3.0, -1.0, -2.0], [1.0, 3.0, -3.0, -1.0]]]], requires_grad=True)
    out = relu_max_pool(x, nn.MaxPool2d(2))
    out.sum().backward()
    assert out.tolist() == [[[[3.0, 0.0]]]]
    # the first maximum of a window takes the gradient (as torch's pool), a non-positive window passes none
    assert x.grad.tolist() == [[[[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]]
    pool3 = nn.MaxPool2d(3, stride=1, padding=1)
    z = torch.randn(2, 3, 7, 7)
    assert torch.equal(relu_max_pool(z, pool3), pool3(torch.relu(z)))


def test_a_task_tensor_of_another_shape_is_refused_not_broadcast_into_the_model():
    """A lying cell's task whose tensor broadcasts into a parameter (shape (1,) or a row) fails the device's
    task with a shape rejection, and leaves the device's model as it was."""
    import numpy as np

    from protocols.algorithms.base import DeviceContext
    from protocols.rejections import Rejected, RejectKind
    from protocols.torch_trainer import TorchTrainer
    from protocols.trainer import LocalData
    from protocols.wire.payload import Payload

    trainer = TorchTrainer.from_spec("mlp", (1, 8, 8), 10, hidden=[4])
    good = trainer.get_params()
    name, weight = next(iter(good.items()))  # a 2-d weight: (4, 64)
    for lie in (np.ones((1,), np.float32), np.ones((1, weight.shape[1]), np.float32)):
        with pytest.raises(Rejected) as err:
            trainer.set_params({**good, name: lie})
        assert err.value.kind == RejectKind.SHAPE and str(lie.shape) in str(err.value)
        assert all(np.array_equal(a, b) for a, b in zip(trainer.get_params().values(), good.values()))
    with pytest.raises(Rejected, match="missing"):
        trainer.set_params({k: v for k, v in good.items() if k != name})
    # a FedAvg device given such a task: the role's training refuses it the same way
    from protocols.algorithms.base import ModelSpec
    from protocols.algorithms.fedavg import FedAvg
    from protocols.config import parse_config

    alg = FedAvg(
        parse_config({"algorithm": {"name": "fedavg", "local_steps": 2}}).train,
        ModelSpec(input_shape=(1, 8, 8), hidden=(4,)),
        seed=0,
    )
    data = LocalData(np.zeros((8, 64), np.float32), np.zeros(8, np.int64))
    with pytest.raises(Rejected):
        alg.device("c0-d0").train(
            Payload({}, {**good, name: np.ones((1,), np.float32)}), data, trainer, DeviceContext(0, 0, 0, "c0", "c0-d0")
        )


def test_set_params_takes_the_names_in_any_order_check_like_only_in_order():
    """One name/shape check serves both: a model is set from its tensors in any order (by name), while an
    update must list the reference's tensors in order; both refuse a missing or misshapen tensor."""
    import numpy as np

    from protocols.params import check_like
    from protocols.rejections import Rejected, RejectKind

    model = build_model("mlp", (1, 8, 8), 10, hidden=[4])
    good = init_params(model, seed=1)
    backwards = dict(reversed(list(good.items())))
    set_params(model, init_params(model, seed=2))
    set_params(model, backwards)
    assert all(np.array_equal(p.detach().numpy(), good[k]) for k, p in model.named_parameters())
    check_like(good, good)
    with pytest.raises(Rejected, match="wrong tensors") as err:
        check_like(backwards, good)
    assert err.value.kind == RejectKind.SHAPE
    first = next(iter(good))
    for lie in ({k: v for k, v in good.items() if k != first}, {**good, first: np.ones((1,), np.float32)}):
        for check in (lambda p: set_params(model, p), lambda p: check_like(p, good)):
            with pytest.raises(Rejected) as err:
                check(lie)
            assert err.value.kind == RejectKind.SHAPE


def test_an_init_is_the_same_while_another_thread_builds_models() -> None:
    """A model's seeded init draws from torch's global RNG: a model built meanwhile in another thread (its layers'
    default init draws from that RNG too) must not take draws from the seeded stream. It did: an emulation beside
    a sim in one process (tests/test_run_cohort.py) once started from another initial model than the sim's."""
    import threading

    want = init_params(build_model("mlp", (1, 8, 8), 10, hidden=[64]), seed=5)
    stop = threading.Event()

    def build_meanwhile() -> None:
        while not stop.is_set():
            build_model("mlp", (1, 8, 8), 10, hidden=[64])

    builder = threading.Thread(target=build_meanwhile, daemon=True)
    builder.start()
    try:
        for _ in range(300):
            got = init_params(build_model("mlp", (1, 8, 8), 10, hidden=[64]), seed=5)
            assert all(np.array_equal(got[k], want[k]) for k in want)
    finally:
        stop.set()
        builder.join()
