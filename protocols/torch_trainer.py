"""The torch trainer backend: CPU, or CUDA when asked for (``device="auto"`` picks CUDA if present)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from .config import ConfigError
from .models import build_model, get_params, set_params
from .trainer import PROGRESS, GradTransform, LocalData, Trainer, TrainStats, batches

log = logging.getLogger("fedtier.device")
_told: set[str] = set()  # the auto choices logged in this process (once each)


def as_tensor(a: np.ndarray, dtype: npt.DTypeLike, device: torch.device) -> torch.Tensor:
    """A torch tensor of ``a`` (copied when ``a`` is read-only, e.g. a shared cached data set)."""
    a = np.ascontiguousarray(a, dtype=dtype)
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(device)


def pick_device(device: str = "cpu") -> torch.device:
    """The torch device of ``runtime.device``: ``auto`` is CUDA when torch sees a GPU, else the CPU
    (the choice logged once per process); ``cuda`` (``cuda:N``) without that GPU is a
    :class:`~protocols.config.ConfigError` saying so, raised where the run builds its first trainer."""
    if device == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
        why = torch.cuda.get_device_name(0) if chosen == "cuda" else "torch sees no CUDA device"
        say(f"runtime.device = auto: chose {chosen} ({why})")
        return torch.device(chosen)
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"runtime.device = {device!r} is not a torch device (cpu, cuda, cuda:N or auto)") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (dev.index or 0) >= count:
            built = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
            raise ConfigError(
                f"runtime.device = {device!r} but this machine has {count} CUDA device(s) ({built}); "
                'use runtime.device = "cpu" or "auto"'
            )
    return dev


def say(message: str) -> None:
    """Log a device choice once per process (every trainer and engine of a run asks)."""
    if message not in _told:
        _told.add(message)
        log.info(message)


def transform_state(
    transform: GradTransform | None, named: list[tuple[str, torch.nn.Parameter]], device: torch.device
) -> list[torch.Tensor]:
    """A gradient transform's per-device state as float32 tensors in parameter order; ``ValueError`` when it
    does not name every parameter with its shape."""
    if transform is None:
        return []
    state = transform.state
    if list(state) != [k for k, _ in named]:
        raise ValueError(f"grad_transform state names {sorted(state)[:4]}... are not the model's parameters")
    out = []
    for k, p in named:
        v = np.asarray(state[k], dtype=np.float32)
        if v.shape != tuple(p.shape):
            raise ValueError(f"grad_transform state {k} is {list(v.shape)}, the parameter {list(p.shape)}")
        out.append(as_tensor(v, np.float32, device))
    return out


class TorchTrainer(Trainer):
    """Runs one model of the zoo. One instance can serve many simulated devices in turn."""

    trains_in_cohorts = True

    def __init__(self, model: torch.nn.Module, device: str = "cpu") -> None:
        self.device = pick_device(device)
        self.model = model.to(self.device)
        self._named = list(self.model.named_parameters())  # listed once: a tiny model pays per call
        self._params = [p for _, p in self._named]
        self._x_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._eval_cache: tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor] | None = None
        self._others: dict[Any, TorchTrainer] = {}

    @classmethod
    def from_spec(cls, name: str, input_shape, num_classes: int, device: str = "cpu", **kwargs) -> TorchTrainer:
        return cls(build_model(name, input_shape, num_classes, **kwargs), device)

    def for_model(self, spec: Any) -> TorchTrainer:
        """A cached trainer, on the same device, for the zoo model of ``spec`` (a frozen ``ModelSpec``)."""
        if spec not in self._others:
            self._others[spec] = TorchTrainer.from_spec(
                spec.name, spec.input_shape, spec.num_classes, str(self.device), **spec.build_kwargs()
            )
        return self._others[spec]

    def get_params(self) -> OrderedDict[str, np.ndarray]:
        return get_params(self.model, self._named)

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        set_params(self.model, params, self._named)  # type: ignore[arg-type]

    def _tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        # a device trains on the same arrays every round: convert them once
        if self._x_cache is not None and self._x_cache[0] == id(x) and self._x_cache[1].shape[0] == len(x):
            return self._x_cache[1], self._x_cache[2]
        xt = as_tensor(x, np.float32, self.device)
        yt = as_tensor(y, np.int64, self.device)
        self._x_cache = (id(x), xt, yt)
        return xt, yt

    @torch.no_grad()
    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        self.model.eval()
        xt = as_tensor(x, np.float32, self.device)
        yt = as_tensor(y, np.int64, self.device)
        return float(F.cross_entropy(self.model(xt), yt))

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> tuple[float, float]:
        self.model.eval()
        xs, ys = self._eval_tensors(x, y)
        losses, hits = [], []
        for start in range(0, len(y), batch_size):
            PROGRESS.tick()  # an evaluation batch is progress: a long one is no hung worker (sim/worker_watch.py)
            out = self.model(xs[start : start + batch_size])
            yt = ys[start : start + batch_size]
            losses.append(F.cross_entropy(out, yt, reduction="sum"))
            hits.append((out.argmax(1) == yt).sum())
        # one transfer from the device; the chunks' sums added in order, in float64, as one by one
        total_loss = sum(torch.stack(losses).tolist()) if losses else 0.0
        correct = int(torch.stack(hits).sum()) if hits else 0
        n = max(1, len(y))
        return total_loss / n, correct / n

    def _eval_tensors(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` and ``y`` on the trainer's device; the last set evaluated stays there (the cloud evaluates
        the same held-out set every round: on a GPU it is uploaded once, not every round). Keyed by the
        arrays themselves (held, so their ids cannot be reused); on the CPU no copy is kept (a tensor of a
        writable float32 array is a view of it)."""
        cached = self._eval_cache
        if cached is not None and cached[0] is x and cached[1] is y:
            return cached[2], cached[3]
        xt, yt = as_tensor(x, np.float32, self.device), as_tensor(y, np.int64, self.device)
        self._eval_cache = (x, y, xt, yt)
        return xt, yt

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray) -> tuple[float, OrderedDict[str, np.ndarray]]:
        self.model.train()
        self.model.zero_grad(set_to_none=True)
        xt = as_tensor(x, np.float32, self.device)
        yt = as_tensor(y, np.int64, self.device)
        loss = F.cross_entropy(self.model(xt), yt)
        loss.backward()
        grads = OrderedDict(
            (k, p.grad.detach().cpu().numpy().copy())  # type: ignore[union-attr]  # set by backward() above
            for k, p in self.model.named_parameters()
        )
        return float(loss.detach()), grads

    def sgd(
        self,
        data: LocalData,
        *,
        steps: int,
        batch_size: int,
        lr: float,
        rng: np.random.Generator,
        weight_decay: float = 0.0,
        prox_mu: float = 0.0,
        momentum: float = 0.0,
        grad_transform: GradTransform | None = None,
    ) -> TrainStats:
        if not self.model.training:  # (walks every module: only after loss / evaluate)
            self.model.train()
        xt, yt = self._tensors(data.x, data.y)
        params = self._params
        start = [p.detach().clone() for p in params] if prox_mu else []  # FedProx: w_0
        bufs = [torch.zeros_like(p) for p in params] if momentum else []
        state = transform_state(grad_transform, self._named, self.device)
        losses, sizes = [], []
        for idx in batches(len(data), batch_size, steps, rng):
            it = torch.from_numpy(idx).to(self.device)
            loss = F.cross_entropy(self.model(xt.index_select(0, it)), yt.index_select(0, it))  # cheaper than xt[it]
            for p in params:
                p.grad = None
            loss.backward()
            with torch.no_grad():
                for p in params:
                    if weight_decay:
                        p.grad.add_(p, alpha=weight_decay)  # type: ignore[union-attr]  # set by backward() above
                if prox_mu:
                    for p, p0 in zip(params, start):
                        p.grad.add_(p - p0, alpha=prox_mu)  # type: ignore[union-attr]  # set by backward() above
                if grad_transform is not None:
                    grads = grad_transform.fn([p.grad for p in params], list(params), state)  # type: ignore[misc]  # set by backward() above
                    for p, g in zip(params, grads):
                        p.grad = g
                for b, p in zip(bufs, params):  # heavy ball: the step follows b = beta * b + g
                    p.grad = b.mul_(momentum).add_(p.grad)  # type: ignore[arg-type]  # set by backward() above
                # p += -lr * grad for each p: one call (on CPU, the same add_ per tensor as a loop)
                torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)  # type: ignore[arg-type,misc]  # grads set by backward(); Parameters are Tensors
            losses.append(loss.detach())
            sizes.append(len(idx))
        w = torch.tensor(sizes, dtype=torch.float32, device=self.device)
        samples = int(sum(sizes))
        return TrainStats(float((torch.stack(losses) * w).sum()) / max(1, samples), steps, samples)
