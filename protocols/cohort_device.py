"""A device's side of the cohort engine: :class:`CohortDeviceTrainer`, the ``Trainer`` a device role sees in a
cohort, turns every compute primitive into a :class:`Request` that a runner (``edge_agent/cohort.py``) answers for
all devices of the cohort at once (``protocols.cohort_trainer.CohortEngine``); parameter access stays local."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .algorithms.base import ModelSpec
from .trainer import DatasetRows, GradTransform, LocalData, Trainer, TrainStats, batches
from .wire.payload import immutable

DATA_SET_BYTES = 4 << 30
"""A data set larger than this is not gathered from whole (on a GPU it would be uploaded whole): its devices' samples
are copied out of it, each device's on its own."""


@dataclass
class Request:
    """One device's call of a compute primitive, answered by :meth:`CohortEngine.run`."""

    op: str  # sgd | loss | probe | evaluate | loss_and_grad
    spec: ModelSpec
    params: Mapping[str, np.ndarray]
    x: np.ndarray
    y: np.ndarray
    order: list[np.ndarray] = field(default_factory=list)  # sgd: index batches
    lr: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0  # sgd: FedProx proximal coefficient
    momentum: float = 0.0  # sgd: heavy-ball beta
    grad_transform: GradTransform | None = None  # sgd: applied to each step's gradient
    directions: Sequence[np.ndarray] = ()  # probe: the P direction vectors (shared by the cohort's devices)
    mu: float = 0.0  # probe: the perturbation radius
    rows: np.ndarray | None = None  # sgd: x, y are a shared data set and the device's samples these rows of it
    result: Any = None

    def key(self) -> tuple[str, ModelSpec, tuple[str, ...], Any]:
        """Requests with equal keys run as one array program (devices whose gradient transforms share their
        function together; probes along the same direction vectors together)."""
        same = self.grad_transform.fn if self.grad_transform else tuple(id(z) for z in self.directions)
        return self.op, self.spec, tuple(self.params), same


def one_point(reqs: Sequence[Request]) -> bool:
    """Whether the requests (two or more) probe at one point: the same parameters, bit for bit, and the same mu, so
    the same P + 1 probes (DeComFL's replicas, all at x_r). A packed vector (``directions.Packed``) is compared
    whole."""
    first, flat = reqs[0], getattr(reqs[0].params, "flat", None)
    if len(reqs) < 2 or any(r.mu != first.mu for r in reqs):
        return False
    if flat is not None and all(getattr(r.params, "shapes", None) == first.params.shapes for r in reqs):  # type: ignore[attr-defined]
        # (replicas holding the state a process shares, directions.replay: the same array, not compared)
        return all(r.params.flat is flat or np.array_equal(r.params.flat, flat) for r in reqs[1:])  # type: ignore[attr-defined]
    return all(
        r.params.keys() == first.params.keys() and all(np.array_equal(r.params[k], v) for k, v in first.params.items())
        for r in reqs[1:]
    )


class CohortDeviceTrainer(Trainer):
    """One device's view of the cohort: a ``Trainer`` whose compute primitives are batched.

    ``call(request)`` blocks until the cohort runner answered the request (with all devices that
    reached a primitive at the same time) and returns ``request.result``; ``call([requests])``
    answers several at once (a list of results).
    """

    def __init__(self, spec: ModelSpec, call: Callable[[Request | list[Request]], Any]) -> None:
        self.spec, self.call = spec, call
        self.params: OrderedDict[str, np.ndarray] = OrderedDict()
        self._others: dict[ModelSpec, CohortDeviceTrainer] = {}

    def get_params(self) -> OrderedDict[str, np.ndarray]:
        return OrderedDict((k, v.copy()) for k, v in self.params.items())

    def params_view(self) -> OrderedDict[str, np.ndarray]:
        """Read-only views of the parameters (a device's trained parameters are its rows of its cohort's
        result arrays): no copy of 800 KB a device for a delta read once."""
        return OrderedDict((k, _read_only(v)) for k, v in self.params.items())

    def set_params(self, params: Mapping[str, np.ndarray]) -> None:
        """Load ``params``: copied, except float32 arrays that can never change (a received task's tensors, views
        of its message): the cohort's engine copies them into its batch anyway, so a copy here was 800 KB a
        device for nothing."""
        self.params = OrderedDict(
            (k, v if _frozen_float32(v) else np.array(v, dtype=np.float32)) for k, v in params.items()
        )

    def for_model(self, spec: Any) -> CohortDeviceTrainer:
        if spec not in self._others:
            self._others[spec] = CohortDeviceTrainer(spec, self.call)
        return self._others[spec]

    def loss(self, x: np.ndarray, y: np.ndarray) -> float:
        return self.call(Request("loss", self.spec, self.params, x, y))

    def losses(self, params: Sequence[Mapping[str, np.ndarray]], x: np.ndarray, y: np.ndarray) -> list[float]:
        if not params:
            return []
        self.set_params(params[-1])
        return self.call([Request("loss", self.spec, p, x, y) for p in params])

    def perturbed_losses(
        self,
        params: Mapping[str, np.ndarray],
        directions: Sequence[np.ndarray],
        mu: float,
        x: np.ndarray,
        y: np.ndarray,
    ) -> list[float]:
        """One request: the engine builds the P + 1 probes on its device (no copies here)."""
        return self.call(Request("probe", self.spec, params, x, y, directions=tuple(directions), mu=float(mu)))

    def evaluate(self, x: np.ndarray, y: np.ndarray, batch_size: int = 2048) -> tuple[float, float]:
        return self.call(Request("evaluate", self.spec, self.params, x, y))

    def loss_and_grad(self, x: np.ndarray, y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
        return self.call(Request("loss_and_grad", self.spec, self.params, x, y))

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
        order = list(batches(len(data), batch_size, steps, rng))  # this device's seeded order
        x, y, rows = _gathered_from(data)
        request = Request("sgd", self.spec, self.params, x, y, order, lr, weight_decay, prox_mu, momentum)
        request.rows = rows
        request.grad_transform = grad_transform
        params, stats = self.call(request)
        self.params = params
        return stats


def _gathered_from(data: LocalData) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """What an sgd call gathers its minibatches from: the data set and the device's rows in it where ``data`` is rows
    of a float32 data set with int64 labels (used as they are: no copy on the CPU, one upload kept on a GPU) of at most
    :data:`DATA_SET_BYTES`; else the device's own samples (``rows`` ``None``)."""
    if (
        isinstance(data, DatasetRows)
        and data.x_all.dtype == np.float32
        and data.y_all.dtype == np.int64
        and data.x_all.flags.c_contiguous
        and data.y_all.flags.c_contiguous
        and data.x_all.nbytes + data.y_all.nbytes <= DATA_SET_BYTES
    ):
        return data.x_all, data.y_all, data.rows
    return data.x, data.y, None


def _frozen_float32(a: Any) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and immutable(a)


def _read_only(a: np.ndarray) -> np.ndarray:
    view = a.view()
    view.flags.writeable = False
    return view
