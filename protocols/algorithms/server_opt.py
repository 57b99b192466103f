"""Cloud-side optimizer shared by the algorithms whose cloud produces a model delta (FedAvg, HIST).

Amplified updates (Wang & Ji, "A unified analysis of federated learning with arbitrary client
participation", Algorithm 1): every cloud round is a plain step ``x <- x + server_lr * delta``; the
progress ``u = x_t - x_{t0}`` accumulated over an interval of ``P`` cloud rounds is amplified at the
interval end by ``x <- x + (eta - 1) * u`` (not ``eta * u``: ``x`` already moved by ``u``), then the next
interval starts from there. Devices always train from the current, un-amplified ``x_t``.

The optimizer stores the interval start ``x_{t0}`` (the "anchor") rather than a running sum of deltas:
``u`` is exactly the progress that was applied. ``eta = 1`` or ``amplify_period = 0`` is plain FedAvg,
bit for bit. Rounds before ``amplify_start`` are a plain warm-up; the first interval starts there.
A round in which no cell reported still counts towards ``P`` (rounds are wall-clock time).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
from pydantic import Field

from .. import params as P
from ..wire.payload import Payload
from .base import TrainParams

ANCHOR = "amplify_anchor/"


class AmplifiedParams(TrainParams):
    """:class:`TrainParams` plus the amplification of the cloud update."""

    amplify_eta: float = Field(default=1.0, gt=0, description="eta: amplification factor (1 = plain FedAvg)")
    amplify_period: int = Field(default=0, ge=0, description="P: cloud rounds per interval (0 = off)")
    amplify_start: int = Field(default=0, ge=0, description="first cloud round of the first interval")


class ServerOptimizer:
    """Applies each round's aggregated delta to the global model, with optional amplification."""

    def __init__(self, params: TrainParams) -> None:
        self.lr = params.server_lr
        self.eta = float(getattr(params, "amplify_eta", 1.0))
        self.period = int(getattr(params, "amplify_period", 0))
        self.start = int(getattr(params, "amplify_start", 0))
        self.anchor: "dict[str, np.ndarray] | None" = None
        self.t0 = -1

    @property
    def active(self) -> bool:
        return self.period > 0 and self.eta != 1.0

    def step(self, round: int, model: Mapping[str, np.ndarray],
             delta: Mapping[str, np.ndarray] | None) -> tuple["dict[str, np.ndarray]", bool]:
        """The model after cloud round ``round`` (``delta`` None: nobody reported); True if amplified."""
        if self.active and round >= self.start and self.anchor is None:
            self.anchor, self.t0 = P.copy(model), round  # first interval (or first round after a warm-up)
        new = P.add(model, delta, self.lr) if delta is not None else model
        if not self.active or self.anchor is None or round + 1 - self.t0 < self.period:
            return new, False
        amplified = {k: (v.astype(np.float64) + (self.eta - 1.0) * (v.astype(np.float64) - self.anchor[k]))
                     .astype(v.dtype) for k, v in new.items()}
        self.anchor, self.t0 = P.copy(amplified), round + 1
        return amplified, True

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> Payload:
        """Anchor tensors (prefixed) and the interval start, to merge into the cloud role's state."""
        if self.anchor is None:
            return Payload({}, {})
        return Payload({"amplify_t0": self.t0}, {ANCHOR + k: v for k, v in self.anchor.items()})

    def load_state(self, state: Payload, reference: Mapping[str, np.ndarray]) -> None:
        """Restore from a cloud state; without an anchor the next round starts a new interval."""
        anchor = {k[len(ANCHOR):]: v for k, v in state.tensors.items() if k.startswith(ANCHOR)}
        if not anchor:
            self.anchor, self.t0 = None, -1
            return
        P.check_like(anchor, reference, "amplification anchor")
        self.anchor, self.t0 = P.copy(anchor), int(state.meta["amplify_t0"])


def split_state(state: Payload) -> dict[str, np.ndarray]:
    """The model tensors of a cloud state (everything that is not optimizer state)."""
    return {k: v for k, v in state.tensors.items() if not k.startswith(ANCHOR)}
