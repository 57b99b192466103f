"""The cohort engine's batched kernels: a cohort's forward pass with each device's own parameters
(:func:`batched_forward`), the MLP's loss gradient written out as batched products (:func:`mlp_loss_and_grads`),
each device's masked loss, and which models the engine can vectorize at all. Devices are stacked along a
leading axis ``D``; nothing here mixes two devices' numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call, vmap

from . import directions as Z
from .cohort_batches import read_only_tensor


class NotVectorizable(ValueError):
    """A model the cohort engine cannot run (a layer that keeps buffers, e.g. batch-norm statistics)."""


def check_vectorizable(model: torch.nn.Module) -> None:
    """Raise :class:`NotVectorizable` naming the first layer that keeps buffers (running statistics
    would be shared across the cohort's devices instead of kept per device)."""
    for name, module in model.named_modules():
        buffers = [n for n, _ in module.named_buffers(recurse=False)]
        if buffers:
            raise NotVectorizable(
                f"layer {name or '<model>'!r} ({type(module).__name__}) keeps buffers ({', '.join(buffers)}), which "
                'the cohort engine cannot vectorize; use the per-device engine (runtime.engine = "device")'
            )


def fast_layers(model: torch.nn.Module) -> bool:
    """True when ``model`` is a sequence of layers :func:`batched_forward` runs as batched kernels."""
    from .models import Reshape

    if not isinstance(model, torch.nn.Sequential):
        return False
    for m in model:
        if isinstance(m, torch.nn.Conv2d):
            if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str):
                return False
        elif isinstance(m, torch.nn.Flatten):
            if m.start_dim != 1 or m.end_dim != -1:
                return False
        elif not isinstance(m, (torch.nn.Linear, torch.nn.ReLU, torch.nn.MaxPool2d, torch.nn.GroupNorm, Reshape)):
            return False
    return True


def batched_forward(
    model: torch.nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, shared: int = 1
) -> torch.Tensor:
    """The outputs ``[D, B, ...]`` of ``model`` under each device's parameters (``params[k]``: ``[D, *shape]``)
    on each device's inputs ``x`` ``[D, B, ...]``.

    ``shared``: each ``shared`` consecutive models take the same inputs, ``x`` being ``[D / shared, B, ...]`` (a
    device's P + 1 zeroth-order probes: one copy of its batch): the outputs of ``x.repeat_interleave(shared, 0)``. A
    forward-only first convolution takes them as they are (groups of D / shared: the same bits), others repeated.

    The zoo's layers run as batched kernels (``baddbmm`` for linear layers, one grouped convolution for
    the devices' convolutions, one group norm with ``D x groups`` groups for their GroupNorms (cnn4),
    activations and pooling on the stacked tensors); other models go through ``torch.func.vmap`` of
    ``functional_call``.
    """
    from .models import Reshape, relu_max_pool

    if not fast_layers(model):
        x = x.repeat_interleave(shared, 0) if shared > 1 else x
        return vmap(lambda p, xb: functional_call(model, p, (xb,)))(dict(params), x)
    d, b = x.shape[0] * shared, x.shape[1]
    # forward-only grouped convolutions run 1.3-2x faster on channels-last inputs, with the same bits
    # (benchmarks/README.md, DeComFL cost); with autograd or one device the default layout is as fast
    channels_last = d > 1 and not torch.is_grad_enabled()
    grouped = False  # conv layers run on [B, D*C, H, W]; the others on [D, B, ...]
    children = list(model.named_children())
    for j, (name, m) in enumerate(children):
        before, after = children[j - 1][1] if j else None, children[j + 1][1] if j + 1 < len(children) else None
        if shared > 1 and not (isinstance(m, Reshape) or (isinstance(m, torch.nn.Conv2d) and channels_last)):
            x, shared = x.repeat_interleave(shared, 0), 1  # (x is [D / shared, B, ...] until its first layer)
        if isinstance(m, torch.nn.Conv2d):
            if not grouped:
                x, grouped = _grouped(x, b, d // shared), True
            w, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
            x, shared = _grouped_conv(x, m, w, bias, d // shared, channels_last), 1  # groups: the inputs'
            continue
        if isinstance(m, torch.nn.Linear):
            if grouped:
                x, grouped = x.reshape(b, d, -1).transpose(0, 1), False
            x = _batched_linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))
        elif isinstance(m, torch.nn.ReLU):
            if not isinstance(after, torch.nn.MaxPool2d):  # else it runs with the pool (relu_max_pool)
                x = torch.relu(x)
        elif isinstance(m, torch.nn.MaxPool2d):
            if not grouped:
                x, grouped = _grouped(x, b, d), True
            x = relu_max_pool(x, m) if isinstance(before, torch.nn.ReLU) else _max_pool(x, m)
        elif isinstance(m, torch.nn.GroupNorm):  # device i's channels are a block of D*C: its groups too
            if not grouped:
                x, grouped = _grouped(x, b, d), True
            x = _grouped_group_norm(x, m, params.get(f"{name}.weight"), params.get(f"{name}.bias"), d)
        elif isinstance(m, torch.nn.Flatten):
            x = x.reshape(b, d, -1).transpose(0, 1) if grouped else x.reshape(d, b, -1)
            grouped = False
        elif isinstance(m, Reshape):
            x = x.reshape(b, d, -1).transpose(0, 1) if grouped else x
            x, grouped = x.reshape(d // shared, b, *m.shape), False
    if grouped:
        x = x.reshape(b, d, x.shape[1] // d, *x.shape[2:]).transpose(0, 1)
    return x


def perturbed_stack(base: Mapping[str, torch.Tensor], z: torch.Tensor, mu: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroth-order probes ``[D * (P + 1), *shape]`` per parameter: device ``i``'s ``x_i``, then ``x_i + mu_i z_p``
    for p = 0..P-1 (a float32 multiply, then an add: the bits of ``protocols.directions.perturbed``). ``base``:
    ``[D, *shape]`` per parameter (model order); ``z``: ``[P, n]``, the direction vectors; ``mu``: ``[D]``, or ``[1]``
    for one mu for every device (then each ``mu z_p`` is computed once, not once a device: the same bits)."""
    out, at, p = {}, 0, z.shape[0]
    for name, v in base.items():
        d, shape = v.shape[0], v.shape[1:]
        n = math.prod(shape)
        zk = z[:, at : at + n].reshape(1, p, *shape)
        at += n
        probes = torch.empty(d, p + 1, *shape, dtype=v.dtype, device=v.device)  # written in place: no temporaries
        probes[:, 0] = v
        m = mu.view(mu.shape[0], 1, *[1] * len(shape))
        if mu.shape[0] == 1 and d > 1:
            torch.add(m * zk, v.unsqueeze(1), out=probes[:, 1:])  # (mu z) + x: the same float32 sum as x + (mu z)
        else:
            torch.mul(m, zk, out=probes[:, 1:])
            probes[:, 1:] += v.unsqueeze(1)
        out[name] = probes.reshape(d * (p + 1), *shape)
    return out


def one_point_probes(
    x: torch.Tensor, z: torch.Tensor, mu: torch.Tensor, shapes: Mapping[str, Sequence[int]]
) -> dict[str, torch.Tensor]:
    """:func:`perturbed_stack`'s probes of one device (``[P + 1, *shape]`` per parameter, each its own contiguous
    tensor) from its parameters as one vector ``x`` ``[n]`` (model order, the tensors of ``shapes``): ``x`` and
    ``x + mu z_p`` written over the whole vector in three operations (the same float32 multiply, then add), then each
    parameter's block copied out: not four operations a parameter (~0.2 ms a round of the paper preset's CNN)."""
    p = z.shape[0]
    flat = torch.empty(p + 1, x.shape[0], dtype=x.dtype, device=x.device)
    flat[0] = x
    torch.mul(z, mu, out=flat[1:])
    flat[1:] += x
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[:, at : at + n].reshape(p + 1, *shape).contiguous()
        at += n
    return out


def probe_operands(
    directions: Sequence[np.ndarray], mus: Sequence[float], n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`perturbed_stack`'s ``z`` and ``mu`` on ``device``: the P direction vectors (``n`` floats each) as one
    ``[P, n]`` float32 tensor, the read-only block they were drawn in where they are its rows (``directions.stacked``:
    not copied on the host, 4Pn bytes a round; only read) else a stack of them; the devices' mus, one where they are
    all equal (each ``mu z_p`` is then computed once)."""
    mu = torch.tensor(mus[:1] if len(set(mus)) == 1 else mus, dtype=torch.float32, device=device)
    if not directions:
        return torch.zeros((0, n), dtype=torch.float32, device=device), mu
    return read_only_tensor(Z.stacked(directions), np.float32, device), mu


def _batched_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[D, B, in]`` through each device's linear layer (weights ``w`` ``[D, out, in]``)."""
    return torch.bmm(x, w.transpose(1, 2)) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, w.transpose(1, 2))


def _max_pool(x: torch.Tensor, m: torch.nn.MaxPool2d) -> torch.Tensor:
    return F.max_pool2d(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)


def _grouped(x: torch.Tensor, b: int, d: int) -> torch.Tensor:
    """``[D, B, C, H, W]`` as ``[B, D*C, H, W]``: the devices' channels side by side, for grouped kernels."""
    return x.transpose(0, 1).reshape(b, d * x.shape[2], *x.shape[3:])


def _grouped_conv(
    x: torch.Tensor, m: torch.nn.Conv2d, w: torch.Tensor, bias: torch.Tensor | None, groups: int, channels_last: bool
) -> torch.Tensor:
    """The D devices' convolutions (weights ``w`` ``[D, out, in, kh, kw]``) as one grouped convolution of ``groups``
    groups: D, or D / n where each run of n devices takes the same inputs (``x`` ``[B, groups * in, H, W]``)."""
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return F.conv2d(
        x,
        w.reshape(-1, *w.shape[2:]),
        None if bias is None else bias.reshape(-1),
        m.stride,
        m.padding,
        m.dilation,
        groups=groups,
    )


def _grouped_group_norm(
    x: torch.Tensor, m: torch.nn.GroupNorm, scale: torch.Tensor | None, shift: torch.Tensor | None, d: int
) -> torch.Tensor:
    """The ``d`` devices' GroupNorms as one, of ``d`` times the groups (each device's a block of them)."""
    return F.group_norm(
        x,
        d * m.num_groups,
        None if scale is None else scale.reshape(-1),
        None if shift is None else shift.reshape(-1),
        m.eps,
    )


def mlp_chain(model: torch.nn.Module) -> list[tuple[str, bool]] | None:
    """``[(linear layer name, ReLU after it), ...]`` when ``model`` is ``[Flatten] (Linear [ReLU])*`` (the
    zoo's mlp and logreg), whose loss gradient :func:`mlp_loss_and_grads` writes out; else ``None``."""
    if not isinstance(model, torch.nn.Sequential):
        return None
    chain: list[tuple[str, bool]] = []
    for i, (name, m) in enumerate(model.named_children()):
        if isinstance(m, torch.nn.Flatten) and i == 0 and m.start_dim == 1 and m.end_dim == -1:
            continue
        if isinstance(m, torch.nn.Linear):
            chain.append((name, False))
        elif isinstance(m, torch.nn.ReLU) and chain and not chain[-1][1]:
            chain[-1] = (chain[-1][0], True)
        else:
            return None
    return chain or None


def mlp_loss_and_grads(
    chain: Sequence[tuple[str, bool]],
    params: Mapping[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    mask: torch.Tensor,
    lr: float | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each device's masked mean cross-entropy ``[D]`` (as :func:`device_losses`) and its gradient with
    respect to each device's parameters (in ``params`` order), for a :func:`mlp_chain` model: the
    backward pass written out as batched products, which on small models costs a fraction of
    autograd's bookkeeping. ``x`` ``[D, B, ...]``, ``y`` and ``mask`` ``[D, B]``.

    With ``lr`` (plain SGD, every device at that rate) the step is taken in place instead and no
    gradient returned: each layer's weight gradient is added into the weights by the product itself
    (``baddbmm_``, after the layer's input gradient is taken with the old weights), so the gradients are
    never written out and read back (on a CPU, 2x faster for a cohort of 64 such MLPs)."""
    d, b = x.shape[0], x.shape[1]
    a = x.reshape(d, b, -1)
    inputs: list[torch.Tensor] = []
    actives: list[torch.Tensor | None] = []
    for name, relu in chain:
        w, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
        inputs.append(a)
        a = torch.bmm(a, w.transpose(1, 2)) if bias is None else torch.baddbmm(bias.unsqueeze(1), a, w.transpose(1, 2))
        if relu:
            actives.append(a > 0)
            a = a.clamp_min(0)
        else:
            actives.append(None)
    logp = torch.log_softmax(a, -1)
    per = mask / mask.sum(1, keepdim=True).clamp(min=1.0)  # [D, B]: each real sample's weight in its mean
    picked = logp.gather(2, y.unsqueeze(2)).squeeze(2)
    loss = -(picked * per).sum(1)
    g = logp.exp_()
    g.scatter_add_(2, y.unsqueeze(2), torch.full_like(picked, -1.0).unsqueeze(2))
    g.mul_(per.unsqueeze(2))  # d loss_d / d logits
    grads: dict[str, torch.Tensor] = {}
    for i in range(len(chain) - 1, -1, -1):
        name, _ = chain[i]
        active = actives[i]
        if active is not None:
            g = g * active
        w, bias = params[f"{name}.weight"], params.get(f"{name}.bias")
        below = torch.bmm(g, w) if i else None  # the input gradient, with the weights before the step
        if lr is None:
            grads[f"{name}.weight"] = torch.bmm(g.transpose(1, 2), inputs[i])
            if bias is not None:
                grads[f"{name}.bias"] = g.sum(1)
        else:
            w.baddbmm_(g.transpose(1, 2), inputs[i], alpha=-lr)
            if bias is not None:
                bias.sub_(g.sum(1), alpha=lr)
        if below is not None:
            g = below
    return loss, [grads[k] for k in params] if lr is None else []


def device_losses(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each device's mean cross-entropy ``[D]`` over its real samples (``mask`` 1; 0 when there are none)."""
    ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none").view_as(mask)
    return (ce * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def probe_inputs(x: torch.Tensor, k: int, one: bool) -> tuple[torch.Tensor, int]:
    """:func:`batched_forward`'s inputs and ``shared`` for zeroth-order probes, from the devices' batches ``x``
    ``[D, n, ...]``: each device's batch once, shared by its k probes; at one point (the devices share their probes,
    :func:`probe_losses`) every batch for each probe, ``[k, D * n, ...]`` (repeated: the first convolution of one
    group over them all that sharing gives ran 25% slower on a CPU than one of k groups over the repeated batches)."""
    return (x.flatten(0, 1).expand(k, -1, *x.shape[2:]), 1) if one else (x, k)


def probe_losses(out: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, one: bool) -> torch.Tensor:
    """Each device's mean cross-entropy under each of its P + 1 probes, ``[D, P + 1]``, from the probes' outputs
    ``out``: ``[D * (P + 1), n, classes]`` (device by device), or with ``one`` (devices at one point sharing their
    probes) ``[P + 1, D * n, classes]``, each probe over every device's samples (labels ``y``, masks ``[D, n]``)."""
    d, n = mask.shape
    k = out.shape[0] // (1 if one else d)
    if not one:
        return device_losses(out, y.repeat_interleave(k, 0), mask.repeat_interleave(k, 0)).view(d, k)
    labels = y.reshape(1, -1).expand(k, -1).reshape(-1)
    ce = F.cross_entropy(out.reshape(-1, out.shape[-1]), labels, reduction="none").view(k, d, n)
    return ((ce * mask).sum(2) / mask.sum(1).clamp(min=1.0)).T
