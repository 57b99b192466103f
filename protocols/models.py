"""The model zoo shared by every tier: the same architecture everywhere, built from a spec.

Parameters cross tiers as ``name -> float32 array`` in ``state_dict`` order (see ``params.py``).
This module needs torch; forward-only (onnxruntime) devices never import it.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import plugins
from .params import check_names_and_shapes

# torch's global RNG, seeded by init_params and drawn by build_model: one thread at a time (reentrant: a plugin's
# model factory may build a zoo model)
_SEEDED = threading.RLock()


class Reshape(nn.Module):
    """Reshape flat feature rows to images: ``[B, D] -> [B, *shape]``."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], *self.shape)


def _is_2x2(pool: nn.MaxPool2d) -> bool:
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    return (
        pair(pool.kernel_size) == (2, 2)
        and pair(pool.stride) == (2, 2)
        and pair(pool.padding) == (0, 0)
        and pair(pool.dilation) == (1, 1)
        and not pool.ceil_mode
        and not pool.return_indices
    )


def relu_max_pool(x: torch.Tensor, pool: nn.MaxPool2d) -> torch.Tensor:
    """``pool(relu(x))`` for ``[N, C, H, W]`` ``x``, equal to it bit for bit (values and gradients), faster.

    ReLU and max commute, so a 2x2 pool runs first and the ReLU on a quarter of the values; the gradient is
    the same too (the first maximum of a window takes it, and a window whose maximum is not positive passes
    none either way). With autograd the pool runs on a channels-last copy (torch's NCHW max-pool kernel and
    its backward are the slow ones on CPU: the pool runs 1.1-3x faster, a FedMRN cnn4 run takes ~9 % less
    CPU); without, it is the maximum of the four strided quarters: forward-only work (evaluation,
    zeroth-order methods) runs 1.6-2x faster on the zoo's CNNs. Other pools: ``pool(relu(x))`` as written.
    """
    if not _is_2x2(pool):
        return pool(torch.relu(x))
    if torch.is_grad_enabled() and x.requires_grad:
        if x.dim() == 4:
            x = x.contiguous(memory_format=torch.channels_last)
        return torch.relu(F.max_pool2d(x, 2)).contiguous()
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    return torch.relu(
        torch.maximum(
            torch.maximum(x[..., 0:h:2, 0:w:2], x[..., 0:h:2, 1:w:2]),
            torch.maximum(x[..., 1:h:2, 0:w:2], x[..., 1:h:2, 1:w:2]),
        )
    )


class ConvNet(nn.Sequential):
    """The zoo's CNNs: a Sequential whose ``ReLU -> MaxPool2d`` pairs run as one :func:`relu_max_pool`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = list(self._modules.values())
        i = 0
        while i < len(layers):
            layer, after = layers[i], layers[i + 1] if i + 1 < len(layers) else None
            if isinstance(layer, nn.ReLU) and isinstance(after, nn.MaxPool2d):
                x, i = relu_max_pool(x, after), i + 2
            else:
                x, i = layer(x), i + 1
        return x


def build_model(
    name: str,
    input_shape: Sequence[int],
    num_classes: int,
    hidden: Sequence[int] = (200, 200),
    channels: Sequence[int] = (32, 64),
    fc: int = 512,
) -> nn.Module:
    """Build a model of the zoo.

    - ``mlp``: flatten -> ``fc{i}`` Linear/ReLU for each ``hidden`` width -> ``out`` Linear.
    - ``cnn``: the small CNN of the FedAvg/FedMRN papers for 28x28 (or 8x8) images: conv5x5 c1 ->
      ReLU -> maxpool2 -> conv5x5 c2 -> ReLU -> maxpool2 -> ``fc1`` -> ReLU -> ``out``; ``fc = 0``: no
      ``fc1`` (the DeComFL paper's 28,938-parameter MNIST CNN is ``channels = (16, 32), fc = 0``).
    - ``cnn4``: the CNN4 of the FedMRN paper with GroupNorm in place of its batch norm: for each of the
      four ``channels`` widths, ``conv{i}`` 3x3 (padding 1, no bias) -> ``norm{i}`` GroupNorm -> ReLU ->
      maxpool2, then ``out`` Linear (no bias). GroupNorm keeps no running statistics, so the model is its
      parameters alone: it federates by averaging like any other layer and behaves the same in training and
      evaluation (batch norm's statistics would need their own handling). Groups: ``gcd(8, width)``.
    - ``logreg``: a single linear layer.
    - a name registered with ``protocols.plugins.register_model``: its factory's model (the size keywords unused).

    The layers' default initialisers draw from torch's global RNG: built under :func:`init_params`'s lock with
    that RNG forked, so a model built in one thread never takes draws from another thread's seeded init (an
    emulation beside a sim in one process once started from another initial model than the sim's).
    """
    with _SEEDED, torch.random.fork_rng(devices=[]):
        return _build(name, input_shape, num_classes, hidden, channels, fc)


def _build(
    name: str, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int], channels: Sequence[int], fc: int
) -> nn.Module:
    """:func:`build_model`'s body (its caller holds the RNG's lock)."""
    if name in plugins.MODELS:
        return plugins.build_registered(name, tuple(input_shape), num_classes)
    in_features = int(np.prod(input_shape))
    if name == "mlp":
        return _mlp(in_features, hidden, num_classes)
    if name == "logreg":
        return nn.Sequential(OrderedDict([("flatten", nn.Flatten()), ("out", nn.Linear(in_features, num_classes))]))
    if name == "cnn":
        return _cnn(_image_shape(input_shape), channels, fc, num_classes)
    if name == "cnn4":
        return _cnn4(_image_shape(input_shape), channels, num_classes)
    raise ValueError(f"unknown model {name!r} (available: {', '.join(plugins.model_names())})")


def _image_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """``(channels, height, width)`` of ``input_shape`` (a 2-d shape: one channel)."""
    c, h, w = (int(x) for x in input_shape) if len(input_shape) == 3 else (1, *(int(x) for x in input_shape))
    return c, h, w


def _mlp(in_features: int, hidden: Sequence[int], num_classes: int) -> nn.Module:
    """The zoo's ``mlp`` (see :func:`build_model`)."""
    layers: list[tuple[str, nn.Module]] = []
    width = in_features
    for i, h in enumerate(hidden, start=1):
        layers += [(f"fc{i}", nn.Linear(width, int(h))), (f"relu{i}", nn.ReLU())]
        width = int(h)
    layers.append(("out", nn.Linear(width, num_classes)))
    return nn.Sequential(OrderedDict([("flatten", nn.Flatten()), *layers]))


def _cnn(image: tuple[int, int, int], channels: Sequence[int], fc: int, num_classes: int) -> nn.Module:
    """The zoo's ``cnn`` (see :func:`build_model`)."""
    c, h, w = image
    c1, c2 = (int(x) for x in channels)
    # 'same' padding: 28 -> 14 -> 7 and 8 -> 4 -> 2 after the two poolings
    flat = c2 * (h // 4) * (w // 4)
    head = (
        [("fc1", nn.Linear(flat, fc)), ("relu3", nn.ReLU()), ("out", nn.Linear(fc, num_classes))]
        if fc
        else [("out", nn.Linear(flat, num_classes))]
    )
    return ConvNet(
        OrderedDict(
            [
                ("reshape", Reshape((c, h, w))),
                ("conv1", nn.Conv2d(c, c1, 5, padding=2)),
                ("relu1", nn.ReLU()),
                ("pool1", nn.MaxPool2d(2)),
                ("conv2", nn.Conv2d(c1, c2, 5, padding=2)),
                ("relu2", nn.ReLU()),
                ("pool2", nn.MaxPool2d(2)),
                ("flatten", nn.Flatten()),
                *head,
            ]
        )
    )


def _cnn4(image: tuple[int, int, int], channels: Sequence[int], num_classes: int) -> nn.Module:
    """The zoo's ``cnn4`` (see :func:`build_model`)."""
    c, h, w = image
    widths = [int(x) for x in channels]
    if len(widths) != 4:
        raise ValueError(f"cnn4 needs 4 channel widths, got {widths}")
    if h < 16 or w < 16:
        raise ValueError(f"cnn4 pools 4 times: images of at least 16x16 needed, got {h}x{w}")
    layers: list[tuple[str, nn.Module]] = [("reshape", Reshape((c, h, w)))]
    for i, width in enumerate(widths, start=1):
        layers += [
            (f"conv{i}", nn.Conv2d(c, width, 3, padding=1, bias=False)),
            (f"norm{i}", nn.GroupNorm(math.gcd(8, width), width)),
            (f"relu{i}", nn.ReLU()),
            (f"pool{i}", nn.MaxPool2d(2)),
        ]
        c, h, w = width, h // 2, w // 2
    layers += [("flatten", nn.Flatten()), ("out", nn.Linear(c * h * w, num_classes, bias=False))]
    return ConvNet(OrderedDict(layers))


def init_params(model: nn.Module, seed: int, std: float | None = None) -> OrderedDict[str, np.ndarray]:
    """Re-initialise ``model`` deterministically from ``seed`` and return its parameters.

    Uses torch's default initialisers under ``torch.manual_seed(seed)`` inside a forked RNG, so
    the global torch RNG is left as it was. ``std``: conv and linear weights drawn from N(0, std^2)
    instead, their biases zero (the FedMRN paper's N(0, 0.01)); norm layers keep scale 1, shift 0.
    """
    with _SEEDED, torch.random.fork_rng(devices=[]):  # (another thread's seeding would change this init)
        torch.manual_seed(seed)
        for module in model.modules():
            if hasattr(module, "reset_parameters") and module is not model:
                module.reset_parameters()  # type: ignore[operator]  # a Module's attributes are typed Tensor | Module
            if std is not None and isinstance(module, (nn.Linear, nn.Conv2d)):
                with torch.no_grad():
                    module.weight.normal_(0.0, std)
                    if module.bias is not None:
                        module.bias.zero_()
    return get_params(model)


NamedParams = Sequence[tuple[str, nn.Parameter]]
"""``list(model.named_parameters())``, listed once by a caller that reads or sets them often."""


def get_params(model: nn.Module, named: NamedParams | None = None) -> OrderedDict[str, np.ndarray]:
    """The model's trainable parameters as float32 numpy copies, in ``named_parameters`` order."""
    return OrderedDict(
        (k, v.detach().cpu().numpy().astype(np.float32, copy=True))
        for k, v in (model.named_parameters() if named is None else named)
    )


def set_params(model: nn.Module, params: OrderedDict[str, np.ndarray], named: NamedParams | None = None) -> None:
    """Copy ``params`` into the model in place. Read-only arrays (e.g. the views of a received message) are
    copied straight into a CPU parameter's memory or, for another device, through a copy: torch would warn
    that it cannot protect a tensor made of them. Names and shapes must be the model's exactly (a
    :class:`~protocols.rejections.Rejected` of kind shape otherwise, before anything is copied): a tensor
    of another shape is never broadcast into a parameter."""
    named = list(model.named_parameters()) if named is None else named
    check_names_and_shapes(params, {k: tuple(p.shape) for k, p in named}, "model", ordered=False)
    with torch.no_grad():
        for k, p in named:
            src = params[k]
            if p.device.type == "cpu" and p.dtype == torch.float32:
                np.copyto(p.detach().numpy(), src, casting="unsafe")  # torch's copy_ casts as this does
            else:
                src = np.ascontiguousarray(src)
                p.copy_(torch.from_numpy(src if src.flags.writeable else src.copy()))
