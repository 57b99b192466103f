"""The cohort engine's local training steps: what each step applies per device (:class:`StepTerms`: learning rates,
weight decay, FedProx's pull, momentum, a gradient transform) and the step loop itself (:func:`run_steps`), every
device of a cohort at once on its stacked parameters. ``CohortEngine._sgd`` (``protocols.cohort_trainer``) builds the
minibatches and answers the requests around them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cohort_device import Request
from .cohort_kernels import batched_forward, device_losses, mlp_loss_and_grads
from .trainer import PROGRESS, GradTransform


@dataclass
class StepTerms:
    """What each step of a cohort sgd call applies per device, built once per call (the step loop reads
    them into locals): learning rates, weight decay, FedProx's pull to the start, momentum, a transform."""

    rates: torch.Tensor  # [D, S]: a device with an empty batch stands still
    same_lr: float  # the first device's rate ...
    same_rate: list[bool]  # [S]: ... shared by every device active at step s (one fused update)
    wd: torch.Tensor  # [D]
    decay: bool
    mu: torch.Tensor  # [D]
    start: list[torch.Tensor] | None  # FedProx: w_0
    beta: torch.Tensor  # [D]
    bufs: list[torch.Tensor] | None  # heavy ball
    transform: GradTransform | None  # one fn for the group (Request.key) ...
    state: list[torch.Tensor] = field(default_factory=list)  # ... and the devices' states stacked


def step_terms(
    reqs: Sequence[Request],
    params: Mapping[str, torch.Tensor],
    counts: torch.Tensor,
    mask: np.ndarray,
    active: list[int],
) -> StepTerms:
    """The :class:`StepTerms` of ``reqs`` (sorted by step count), their stacked ``params``, the samples per step
    ``counts`` ``[D, S]`` and masks ``[D, S, B]``, and the ``active`` devices of each step (the state of a
    gradient transform is the caller's)."""
    dev = counts.device
    lr = torch.tensor([r.lr for r in reqs], dtype=torch.float32, device=dev)
    same_lr = reqs[0].lr
    uniform = all(r.lr == same_lr for r in reqs)
    wd = torch.tensor([r.weight_decay for r in reqs], dtype=torch.float32, device=dev)
    mu = torch.tensor([r.prox_mu for r in reqs], dtype=torch.float32, device=dev)
    beta = torch.tensor([r.momentum for r in reqs], dtype=torch.float32, device=dev)
    return StepTerms(
        rates=lr.unsqueeze(1) * (counts > 0),
        same_lr=same_lr,
        same_rate=_same_rate(uniform, mask, active),
        wd=wd,
        decay=bool((wd != 0).any()),
        mu=mu,
        start=[v.detach().clone() for v in params.values()] if bool((mu != 0).any()) else None,
        beta=beta,
        bufs=[torch.zeros_like(v) for v in params.values()] if bool((beta != 0).any()) else None,
        transform=reqs[0].grad_transform,
    )


def _same_rate(uniform: bool, mask: np.ndarray, active: list[int]) -> list[bool]:
    """Per step: whether every device active then (the first ``active[s]``) has samples in it, under one learning rate
    (``uniform``), from the masks ``[D, S, B]`` in three passes (a pass a step: ~150 us of a standard round)."""
    if not uniform:
        return [False] * len(active)
    idle = np.arange(mask.shape[0])[:, None] >= np.asarray(active, dtype=np.int64)[None, :]  # [D, S]: past its steps
    return [bool(ok) for ok in np.asarray((mask.any(axis=2) | idle).all(axis=0))]


def run_steps(
    model: torch.nn.Module,
    chain: Sequence[tuple[str, bool]] | None,
    fused: Sequence[tuple[str, bool]] | None,
    params: dict[str, torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    span: range,
    active: list[int],
    terms: StepTerms,
    losses: torch.Tensor,
) -> None:
    """Steps ``span`` of every device at once, in place on ``params`` (``[D, *shape]``), each step's losses into
    ``losses`` ``[D, S]``. ``batch``: the inputs and labels gathered for ``span`` (``[a, len(span), B, ...]``)
    and every step's sample masks ``[D, S, B]``; ``fused``: plain SGD's chain (the step in the backward pass)."""
    xs, ys, mask_t = batch
    rates, same_lr, same_rate, transform, state = (
        terms.rates,
        terms.same_lr,
        terms.same_rate,
        terms.transform,
        terms.state,
    )
    wd, decay, mu, start, beta, bufs = terms.wd, terms.decay, terms.mu, terms.start, terms.beta, terms.bufs
    shape = lambda p: (-1, *[1] * (p.dim() - 1))  # noqa: E731  a [D] vector against a [D, ...] tensor
    leaves, d, s0 = list(params.values()), mask_t.shape[0], span.start
    for s in span:
        PROGRESS.tick()
        a = active[s]  # devices 0..a-1 have a step s
        full = a == d
        ps = params if full else {k: v[:a] for k, v in params.items()}
        vs = leaves if full else list(ps.values())
        x, y, m = xs[:a, s - s0], ys[:a, s - s0], mask_t[:a, s]
        if fused is not None and same_rate[s]:  # plain SGD at one rate: the step inside the backward pass
            losses[:a, s] = mlp_loss_and_grads(fused, ps, x, y, m, lr=same_lr)[0]
            continue
        if chain:
            loss, grads = mlp_loss_and_grads(chain, ps, x, y, m)
        else:
            loss = device_losses(batched_forward(model, ps, x), y, m)
            grads = list(torch.autograd.grad(loss.sum(), vs))  # devices are independent: each its own
        with torch.no_grad():
            if not full:  # the leaves' prefixes, updated in place below
                vs = [p[:a] for p in leaves]
            if decay:
                grads = [g + wd[:a].view(shape(p)) * p for p, g in zip(vs, grads)]
            if start is not None:  # FedProx: + mu (w - w_0)
                grads = [g + mu[:a].view(shape(p)) * (p - p0[:a]) for p, g, p0 in zip(vs, grads, start)]
            if transform is not None:  # one call for the cohort's devices
                grads = transform.fn(list(grads), list(vs), [c[:a] for c in state])
            if bufs is not None:  # b = beta * b + g, per device; the step follows b
                grads = [b[:a].mul_(beta[:a].view(shape(g))).add_(g) for b, g in zip(bufs, grads)]
            if same_rate[s]:  # every device steps with the same lr (the usual case): one fused update
                torch._foreach_add_(vs, grads, alpha=-same_lr)
            else:
                for p, g in zip(vs, grads):
                    p.sub_(rates[:a, s].view(shape(p)) * g)
            losses[:a, s] = loss
