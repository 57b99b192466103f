"""What a role may ask of a device's compute: parameter access, forward passes, gradients, SGD.

Roles use only this interface, so the same role runs on torch (``torch_trainer.py``) or on
onnxruntime (forward-only devices, ``edge_agent``). Batches are drawn by ``batches()`` from a seeded
generator, so every backend visits the same samples in the same order.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LocalData:
    """A device's private samples: features ``x`` [n, d] float32 and labels ``y`` [n] int64."""

    x: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} samples but {len(self.y)} labels")

    def __len__(self) -> int:
        return len(self.y)

    def batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``idx`` (features, labels): a minibatch."""
        return self.x[idx], self.y[idx]


class DatasetRows(LocalData):
    """A device's samples as rows ``rows`` of a shared data set (``x_all``, ``y_all``: ``fedtier sim``'s
    partitions): ``x`` and ``y`` are copied out of it when first read, and the cohort engine gathers its minibatches
    from the data set itself (never needing the copy). Nobody writes into a data set."""

    def __init__(self, x_all: np.ndarray, y_all: np.ndarray, rows: np.ndarray) -> None:  # (not the dataclass's)
        if len(x_all) != len(y_all):
            raise ValueError(f"{len(x_all)} samples but {len(y_all)} labels")
        object.__setattr__(self, "x_all", x_all)  # (frozen, as LocalData)
        object.__setattr__(self, "y_all", y_all)
        object.__setattr__(self, "rows", rows)

    x_all: np.ndarray
    y_all: np.ndarray
    rows: np.ndarray

    @cached_property
    def x(self) -> np.ndarray:
        return self.x_all[self.rows]

    @cached_property
    def y(self) -> np.ndarray:
        return self.y_all[self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``idx``, gathered from the data set: the device's samples are not copied out for it (a device
        that trains on one minibatch a round, DeComFL's, held all of them from its first round on: 1.9 MB of
        MNIST a device)."""
        rows = self.rows[idx]
        return self.x_all[rows], self.y_all[rows]

    @property
    def nbytes(self) -> int:
        """The bytes of ``x`` and ``y`` once copied out (whether or not they are yet)."""
        rows = max(1, len(self.x_all))
        return len(self.rows) * (self.x_all.nbytes // rows + self.y_all.nbytes // rows)


@dataclass(frozen=True)
class TrainStats:
    """What local training reports: mean training loss, steps taken, samples visited."""

    loss: float
    steps: int
    samples: int


GradFn = Callable[[list["torch.Tensor"], list["torch.Tensor"], list["torch.Tensor"]], list["torch.Tensor"]]
"""``fn(grads, params, state) -> grads``, each a list in parameter order: elementwise torch code that works on
one device's tensors (``[*shape]``) and on a cohort's stacked ones (``[D, *shape]``) alike."""


@dataclass(frozen=True)
class GradTransform:
    """A change to each SGD step's gradient (after weight decay and the proximal term, before momentum), with
    per-device ``state`` (``name -> array`` shaped like the parameter, e.g. SCAFFOLD's ``c - c_i``).

    The cohort engine runs the same ``fn`` for every device of a cohort at once on their stacked states, so
    ``fn`` must be elementwise (broadcasting over a leading device axis) and a module-level function (devices
    whose transforms share ``fn`` train together). :func:`correction` is SCAFFOLD's."""

    fn: GradFn
    state: Mapping[str, np.ndarray]


def add_state(grads: list[torch.Tensor], params: list[torch.Tensor], state: list[torch.Tensor]) -> list[torch.Tensor]:
    """``g + state``: a constant correction of every step's gradient."""
    return [g + c for g, c in zip(grads, state)]


def correction(offset: Mapping[str, np.ndarray]) -> GradTransform:
    """Add ``offset`` to every step's gradient (SCAFFOLD: ``offset = c - c_i``, the server's control variate
    less the device's)."""
    return GradTransform(add_state, offset)


def num_steps(n: int, batch_size: int, steps: int = 0, epochs: float = 0) -> int:
    """Local steps: ``steps`` if given, else ``epochs`` full passes over ``n`` samples.

    An epoch is ``ceil(n / batch_size)`` batches (the last one short, as :func:`batches` draws them), so
    ``epochs`` passes take ``ceil(epochs * ceil(n / batch_size))`` steps: a fractional ``epochs`` rounds up
    to the next batch."""
    if steps > 0:
        return steps
    if epochs > 0:
        if n <= 0 or batch_size <= 0:
            raise ValueError(f"epochs need samples and a batch size (n={n}, batch_size={batch_size})")
        return max(1, math.ceil(epochs * math.ceil(n / batch_size)))
    raise ValueError("either local_steps or local_epochs must be positive")


class Progress:
    """The training steps this process has run: each SGD step of a device (:func:`batches`), each evaluation batch
    (a device's forward-only evaluation, as FedALIGN's ``F_k``), each part of a cohort engine's compute call and each
    task of a sim worker's batch prepared. A watcher that sees the count stand still while the process owes results
    knows it is stuck, not slow (``fedtier sim``'s workers beat with it, ``sim/device_worker.py``). One add a step;
    an add two threads race on may be lost, which only delays a beat."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps = 0

    def tick(self) -> None:
        self.steps += 1


PROGRESS = Progress()
"""This process's :class:`Progress`."""


def batches(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """``steps`` index batches: consecutive slices of fresh permutations, one per epoch.

    The last batch of an epoch may be smaller (as a PyTorch DataLoader without drop_last).
    """
    if n <= 0:
        raise ValueError("no local data")
    produced = 0
    while produced < steps:
        perm = rng.permutation(n)
        for start in range(0, n, batch_size):
            PROGRESS.tick()
            yield perm[start : start + batch_size]
            produced += 1
            if produced == steps:
                return


class Trainer(ABC):
    """Device compute used by roles. Parameters are ``name -> float32 array`` dicts."""

    trains_in_cohorts: ClassVar[bool] = False
    """Whether the devices this trainer serves can train batched in cohorts (``runtime.engine = "cohort"``:
    the torch trainer); the others (forward-only onnx devices) train one by one."""

    @abstractmethod
    def get_params(self) -> dict[str, np.ndarray]:
        """A copy of the current parameters."""

    def params_view(self) -> Mapping[str, np.ndarray]:
        """The current parameters to read at once (e.g. a delta computed from them), without a copy where
        the backend holds them as arrays: read-only, valid until the next call that changes them. By
        default a copy (:meth:`get_params`)."""
        return self.get_params()

    @abstractmethod
    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Load parameters (copied)."""

    @abstractmethod
    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        """Mean loss of the current parameters on a batch (forward only)."""

    def losses(self, params: Sequence[Mapping[str, np.ndarray]], x: np.ndarray, y: np.ndarray) -> list[float]:
        """:meth:`loss` of each parameter set on one batch, in order (the last set stays loaded).
        Zeroth-order methods probe many perturbed models on a batch; a cohort backend runs them at once."""
        out = []
        for p in params:
            self.set_params(p)
            out.append(self.loss(x, y))
        return out

    def perturbed_losses(
        self,
        params: Mapping[str, np.ndarray],
        directions: Sequence[np.ndarray],
        mu: float,
        x: np.ndarray,
        y: np.ndarray,
    ) -> list[float]:
        """``f(params)`` then ``f(params + mu * z)`` for each ``z`` of ``directions`` (float32 vectors over the
        parameters in model order, :func:`protocols.directions.direction_vector`) on one batch: P + 1 losses.
        Zeroth-order methods probe so; a cohort backend builds the probes on its device. By default the probes
        are built here (``x + float32(mu) * z``, float32) and passed to :meth:`losses`; the parameters loaded
        after the call are unspecified."""
        from . import directions as Z

        shapes = Z.shapes_of(params)
        return self.losses([params] + [Z.perturbed(params, Z.views(z, shapes), mu) for z in directions], x, y)

    @abstractmethod
    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> tuple[float, float]:
        """(mean loss, accuracy) on a data set, forward only."""

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        """Mean loss and its gradient; forward-only backends raise ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} cannot compute gradients")

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
        """Plain minibatch SGD on ``data`` for ``steps`` steps; batches from :func:`batches`.

        Each step's gradient is the batch loss's, plus ``weight_decay * w``, plus the FedProx proximal
        term's ``prox_mu * (w - w_0)`` (``w_0``: the parameters when the call starts; 0: plain SGD).
        ``momentum`` beta > 0: torch's heavy ball, ``b = beta * b + g; w -= lr * b``, with ``b`` zero at
        the start of the call (momentum lives within one call: a device keeps no state across rounds).
        ``grad_transform``: applied to each step's gradient before momentum (:class:`GradTransform`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot run SGD")

    def for_model(self, spec: Any) -> Trainer:
        """A trainer of the same backend for another architecture (a ``ModelSpec``), e.g. a submodel
        with narrower hidden layers (HIST); backends cache one per spec."""
        raise NotImplementedError(f"{type(self).__name__} cannot build other architectures")
