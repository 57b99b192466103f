"""Cloud-side optimizer shared by the algorithms whose cloud produces a model delta (FedAvg, HIST).

Each cloud round the cloud turns the aggregated delta ``Delta_t`` (the weighted mean of the cells'
progress, a pseudo-gradient pointing downhill) into a step with ``algorithm.server_optimizer``:

* ``sgd`` (default): ``x <- x + server_lr * Delta`` (``server_lr = 1``: plain FedAvg averaging).
* ``fedavgm`` (Hsu et al. 2019, server momentum ``beta = server_momentum``):
  ``m <- beta m + Delta;  x <- x + server_lr * m``.
* ``fedadagrad``, ``fedadam``, ``fedyogi`` (Reddi et al. 2021, "Adaptive Federated Optimization",
  Algorithm 2; ``beta1, beta2 = server_beta1, server_beta2``; ``tau = server_tau``):
  ``m <- beta1 m + (1 - beta1) Delta`` and

  - Adagrad: ``v <- v + Delta^2``
  - Adam:    ``v <- beta2 v + (1 - beta2) Delta^2``
  - Yogi:    ``v <- v - (1 - beta2) Delta^2 sign(v - Delta^2)``

  then ``x <- x + server_lr * m / (sqrt(v) + tau)``, with ``m_{-1} = 0`` and ``v_{-1} = tau^2`` (the
  paper requires ``v_{-1} >= tau^2``), no bias correction (as in the paper). ``tau`` bounds the
  adaptivity: the smaller, the more adaptive. Adaptive optimizers want a small ``server_lr``
  (the paper's best lie around 10^-2 to 10^-1), not the default 1.

State (``m``, ``v``) is kept in float64 and checkpointed with the model; a round in which no cell
reported leaves it untouched.

Amplified updates (Wang & Ji, "A unified analysis of federated learning with arbitrary client
participation", Algorithm 1): every cloud round is a plain step ``x <- x + server_lr * delta``; the
progress ``u = x_t - x_{t0}`` accumulated over an interval of ``P`` cloud rounds is amplified at the
interval end by ``x <- x + (eta - 1) * u`` (not ``eta * u``: ``x`` already moved by ``u``), then the next
interval starts from there. Devices always train from the current, un-amplified ``x_t``.

The optimizer stores the interval start ``x_{t0}`` (the "anchor") rather than a running sum of deltas:
``u`` is exactly the progress that was applied. ``eta = 1`` or ``amplify_period = 0`` is plain FedAvg,
bit for bit. Rounds before ``amplify_start`` are a plain warm-up; the first interval starts there.
A round in which no cell reported still counts towards ``P`` (rounds are wall-clock time).

Amplification composes with the ``sgd`` step only. Its analysis needs the interval's progress to be
the *equally weighted* sum of the interval's aggregated updates, so that over a participation cycle
every client's update is amplified by the same ``eta``. Server momentum spreads each update over later
rounds with weights that depend on its position in the interval (and leaks it into the next interval);
the adaptive optimizers rescale every coordinate by a state that depends on who took part before.
Either breaks that equal weighting, so such configs are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from .. import params as P
from ..wire.payload import Payload
from .base import TrainParams
from .traits import Layer

ANCHOR = "amplify_anchor/"
MOMENT = "server_opt.m/"
SECOND = "server_opt.v/"
STATE_PREFIXES = (ANCHOR, MOMENT, SECOND)
OptimizerName = Literal["sgd", "fedavgm", "fedadagrad", "fedadam", "fedyogi"]
ADAPTIVE = ("fedadagrad", "fedadam", "fedyogi")


class ServerParams(TrainParams):
    """:class:`TrainParams` plus the cloud's server optimizer and the amplification of its update."""

    server_optimizer: OptimizerName = Field(
        default="sgd",
        description="sgd | fedavgm | fedadagrad | fedadam | "
        "fedyogi: how the cloud steps the global model with the mean delta",
    )
    server_momentum: float = Field(default=0.9, ge=0, lt=1, description="fedavgm: server momentum beta")
    server_beta1: float = Field(default=0.9, ge=0, lt=1, description="fedadam/fedyogi/fedadagrad: first moment decay")
    server_beta2: float = Field(default=0.99, ge=0, lt=1, description="fedadam/fedyogi: second moment decay")
    server_tau: float = Field(
        default=1e-3, gt=0, description="fedadam/fedyogi/fedadagrad: adaptivity tau (v starts at tau^2)"
    )
    amplify_eta: float = Field(default=1.0, gt=0, description="eta: amplification factor (1 = plain FedAvg)")
    amplify_period: int = Field(default=0, ge=0, description="P: cloud rounds per interval (0 = off)")
    amplify_start: int = Field(default=0, ge=0, description="first cloud round of the first interval")

    def layers(self) -> tuple[Layer, ...]:
        out = list(super().layers())
        if self.server_optimizer != "sgd":
            out.append(Layer("algorithm.server_optimizer", self.server_optimizer, why="steps the global model"))
        if self.amplify_period > 0 and self.amplify_eta != 1.0:
            out.append(Layer("algorithm.amplify_eta", f"{self.amplify_eta:g}", why="amplifies the cloud's update"))
        return tuple(out)

    def idle_keys(self) -> dict[str, str]:
        out = super().idle_keys()
        uses = {
            "server_momentum": ("fedavgm",),
            "server_beta1": ADAPTIVE,
            "server_beta2": ("fedadam", "fedyogi"),
            "server_tau": ADAPTIVE,
        }
        for key, optimizers in uses.items():
            if self.server_optimizer not in optimizers:
                out[key] = "server_optimizer = " + " | ".join(f'"{o}"' for o in optimizers)
        if self.amplify_period == 0:
            out.update(dict.fromkeys(("amplify_eta", "amplify_start"), "amplify_period > 0"))
        return out

    @model_validator(mode="after")
    def _amplification_composes(self) -> ServerParams:
        if self.server_optimizer != "sgd" and self.amplify_period > 0 and self.amplify_eta != 1.0:
            raise ValueError(
                f"server_optimizer = {self.server_optimizer!r} cannot be combined with amplification "
                "(amplify_eta, amplify_period): amplification needs every round's update weighted "
                "equally over its interval, which momentum and adaptive steps do not give; use "
                'server_optimizer = "sgd" with amplification, or set amplify_period = 0'
            )
        return self


class ServerOptimizer:
    """Applies each round's aggregated delta to the global model (``server_optimizer``), with optional
    amplification (``sgd`` only)."""

    def __init__(self, params: TrainParams) -> None:
        self.lr = params.server_lr
        p = params if isinstance(params, ServerParams) else ServerParams(name=params.name)  # its defaults: plain sgd
        self.name: str = p.server_optimizer
        self.momentum, self.beta1, self.beta2, self.tau = (
            p.server_momentum,
            p.server_beta1,
            p.server_beta2,
            p.server_tau,
        )
        self.eta, self.period, self.start = p.amplify_eta, p.amplify_period, p.amplify_start
        self.anchor: dict[str, np.ndarray] | None = None
        self.t0 = -1
        self.m: dict[str, np.ndarray] | None = None  # first moment (fedavgm: the momentum buffer)
        self.v: dict[str, np.ndarray] | None = None  # second moment (adaptive optimizers)

    @property
    def active(self) -> bool:
        return self.period > 0 and self.eta != 1.0

    def step(
        self, round: int, model: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray] | None
    ) -> tuple[dict[str, np.ndarray], bool]:
        """The model after cloud round ``round`` (``delta`` None: nobody reported); True if amplified."""
        if self.active and round >= self.start and self.anchor is None:
            self.anchor, self.t0 = P.copy(model), round  # first interval (or first round after a warm-up)
        if delta is not None:
            new = self._apply(model, delta)
        else:  # nobody reported: the model itself, untouched (a dict already, as the cloud keeps it)
            new = model if isinstance(model, dict) else dict(model)
        if not self.active or self.anchor is None or round + 1 - self.t0 < self.period:
            return new, False
        amplified = {
            k: (v.astype(np.float64) + (self.eta - 1.0) * (v.astype(np.float64) - self.anchor[k])).astype(v.dtype)
            for k, v in new.items()
        }
        self.anchor, self.t0 = P.copy(amplified), round + 1
        return amplified, True

    def _apply(self, model: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step of the configured optimizer (``sgd``: exactly the historical ``P.add``)."""
        if self.name == "sgd":
            return P.add(model, delta, self.lr)
        d = {k: np.asarray(v, dtype=np.float64) for k, v in delta.items()}
        if self.m is None:
            self.m = {k: np.zeros_like(v) for k, v in d.items()}
        if self.name == "fedavgm":
            self.m = {k: self.momentum * self.m[k] + d[k] for k in d}
            step = self.m
        else:
            if self.v is None:
                self.v = {k: np.full_like(v, self.tau**2) for k, v in d.items()}
            b1, b2 = self.beta1, self.beta2
            self.m = {k: b1 * self.m[k] + (1.0 - b1) * d[k] for k in d}
            sq = {k: d[k] * d[k] for k in d}
            if self.name == "fedadagrad":
                self.v = {k: self.v[k] + sq[k] for k in d}
            elif self.name == "fedadam":
                self.v = {k: b2 * self.v[k] + (1.0 - b2) * sq[k] for k in d}
            else:  # fedyogi
                self.v = {k: self.v[k] - (1.0 - b2) * sq[k] * np.sign(self.v[k] - sq[k]) for k in d}
            step = {k: self.m[k] / (np.sqrt(self.v[k]) + self.tau) for k in d}
        return {k: (v.astype(np.float64) + self.lr * step[k]).astype(v.dtype) for k, v in model.items()}

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> Payload:
        """Optimizer state (prefixed tensors, meta) to merge into the cloud role's state."""
        meta: dict = {"server_optimizer": self.name}
        tensors: dict[str, np.ndarray] = {}
        if self.anchor is not None:
            meta["amplify_t0"] = self.t0
            tensors.update({ANCHOR + k: v for k, v in self.anchor.items()})
        for prefix, moment in ((MOMENT, self.m), (SECOND, self.v)):
            if moment is not None:
                tensors.update({prefix + k: v for k, v in moment.items()})
        return Payload(meta, tensors)

    def load_state(self, state: Payload, reference: Mapping[str, np.ndarray]) -> None:
        """Restore from a cloud state; raise ``ValueError`` if it belongs to another optimizer or does not
        match ``reference`` (the model). Without an anchor the next round starts a new interval."""
        saved = state.meta.get("server_optimizer", "sgd")
        if saved != self.name:
            raise ValueError(
                f"checkpoint: its server optimizer is {saved!r} but algorithm.server_optimizer is "
                f"{self.name!r}; resume with the same optimizer or start a new run"
            )
        part = {p: {k[len(p) :]: v for k, v in state.tensors.items() if k.startswith(p)} for p in STATE_PREFIXES}
        for prefix, what in ((MOMENT, "server optimizer first moment"), (SECOND, "server optimizer second moment")):
            if part[prefix]:
                P.check_like(part[prefix], reference, f"checkpoint: {what}")
        wants_v = self.name in ADAPTIVE
        if bool(part[MOMENT]) != bool(part[SECOND]) and wants_v:
            raise ValueError(f"checkpoint: {self.name} state is incomplete (it needs both moments m and v)")
        if part[SECOND] and not wants_v:
            raise ValueError(f"checkpoint: holds a second moment that {self.name} does not use")
        self.m = {k: v.astype(np.float64) for k, v in part[MOMENT].items()} or None
        self.v = {k: v.astype(np.float64) for k, v in part[SECOND].items()} or None
        anchor = part[ANCHOR]
        if not anchor:
            self.anchor, self.t0 = None, -1
            return
        P.check_like(anchor, reference, "amplification anchor")
        self.anchor, self.t0 = P.copy(anchor), int(state.meta["amplify_t0"])


def split_state(state: Payload) -> dict[str, np.ndarray]:
    """The model tensors of a cloud state (everything that is not optimizer state)."""
    return {k: v for k, v in state.tensors.items() if not k.startswith(STATE_PREFIXES)}
