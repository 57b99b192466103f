"""``[privacy]``: secure aggregation and differential privacy settings, and the noise calibration that turns
a target epsilon into a noise multiplier."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..algorithms.base import non_defaults
from ..limits import MAX_SECONDS
from .errors import ConfigError
from .sections import Section


class PrivacySection(Section):
    """Secure aggregation inside each cell (``protocols/privacy/secagg/``), and differential privacy
    (``protocols/privacy/dp.py``): per-device clipping and Gaussian noise, with its accountant."""

    secure_aggregation: bool = Field(
        default=False,
        description="SecAgg+: a cell learns only the sum of its devices' (clipped, quantised) updates; fedavg and hist",
    )
    secagg_threshold: float = Field(
        default=0.5,
        ge=0,
        lt=1,
        description="t = floor(threshold x degree) + 1 "
        "neighbours' shares recover a device's secret (0.5: t > degree / 2, so a lying cell can never get "
        "both secrets of a device from two halves of its neighbours; below 0.5 it can: docs/concepts/privacy.md)",
    )
    secagg_neighbours: int = Field(
        default=0,
        ge=0,
        description="degree of each device in the sparse neighbour "
        "graph; 0: the least even degree from 4 log2(n) at which a round with 30% of the devices dropping "
        "after sharing fails with probability <= 1% (about 10 log2(n) at threshold 0.5), capped at n - 1 "
        "(n - 1: SecAgg's complete graph)",
    )
    secagg_bound: float = Field(
        default=1.0,
        gt=0,
        description="every update value is clipped to [-bound, bound] before quantisation to 32-bit fixed point",
    )
    secagg_deadline: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="seconds a cell waits in each extra "
        "phase (keys, shares, unmasking) before going on without the silent "
        "devices; none: runtime.device_deadline / 4 (the key and share phases "
        "run inside the device deadline)",
    )
    dp: Literal["off", "local", "cell"] = Field(
        default="off",
        description="local: each device noises its clipped "
        "update; cell: the cell noises the sum of its devices' clipped "
        "updates once (central DP at the cell)",
    )
    clip: float = Field(default=1.0, gt=0, description="L2 bound of a device's update (its delta per edge round)")
    noise_multiplier: float | None = Field(default=None, ge=0, description="z: noise std = z x clip")
    target_epsilon: float | None = Field(
        default=None,
        gt=0,
        description="instead of noise_multiplier: the smallest z whose run.rounds spend at most this epsilon",
    )
    delta: float = Field(default=1e-5, gt=0, lt=1, description="the delta of the (epsilon, delta) guarantee")
    epsilon_budget: float | None = Field(default=None, gt=0, description="the most epsilon a run may spend")
    federation_epsilon_budget: float | None = Field(
        default=None,
        gt=0,
        description="federations (the cloud's bundle): the most epsilon any device's data may spend over all "
        "jobs (protocols/privacy/ledger.py); a job that would exceed it, or runs without DP, is refused at "
        "submission",
    )
    on_budget: Literal["refuse", "stop"] = Field(
        default="refuse",
        description="refuse: a run whose rounds would "
        "exceed the budget does not start; stop: it runs the rounds that "
        "fit and stops cleanly before the first that would not",
    )
    dp_min_survivors: int | None = Field(
        default=None,
        ge=1,
        description="dp = cell with secure aggregation: each "
        "device adds noise of variance (z clip)^2 / dp_min_survivors and no sum of "
        "fewer survivors is unmasked; none: what the participation model lets survive, 70% of a cell's "
        "expected participants less two standard deviations (a trace needs it set)",
    )
    noise_seed: int | Literal["system"] | None = Field(
        default=None,
        description="seed of the DP noise; none: run.seed in fedtier sim/run (reproducible), drawn "
        "from the OS by each noising party in deployments (fedtier provision, cloud, cell, agent); system: "
        "drawn from the OS everywhere; an integer: reproducible everywhere, so anyone holding the config can "
        "regenerate the noise and subtract it (deployments warn)",
    )

    @model_validator(mode="after")
    def _noise_set(self) -> PrivacySection:
        if isinstance(self.noise_seed, int) and self.noise_seed < 0:
            raise ValueError('noise_seed must be a non-negative integer or "system"')
        if self.dp != "off" and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(f'dp = "{self.dp}" needs exactly one of noise_multiplier or target_epsilon')
        return self

    @model_validator(mode="after")
    def _keys_apply(self) -> PrivacySection:
        """A key the other settings make ineffective is refused: noise_multiplier without dp ran with no privacy."""
        dp_keys = ("clip", "noise_multiplier", "target_epsilon", "delta", "epsilon_budget", "on_budget", "noise_seed")
        idle = dict.fromkeys(dp_keys, 'dp = "local" or "cell"') if self.dp == "off" else {}
        if not self.secure_aggregation:
            keys = ("secagg_threshold", "secagg_neighbours", "secagg_bound", "secagg_deadline")
            idle |= dict.fromkeys(keys, "secure_aggregation = true")
        if self.dp != "cell" or not self.secure_aggregation:
            idle["dp_min_survivors"] = 'dp = "cell" with secure_aggregation = true'
        wrong = [
            f"{k} = {value!r} has no effect without {needs}" for k, (value, needs) in non_defaults(self, idle).items()
        ]
        if wrong:
            raise ValueError("; ".join(wrong) + " (remove it, or set what it needs)")
        return self


def calibrated_noise(
    target: float, rounds: int, mode: Literal["local", "cell"], q: float, edge_rounds: int, delta: float
) -> float:
    """The noise multiplier whose ``rounds`` spend ``target`` epsilon; :class:`ConfigError` if none does."""
    from ..privacy.accountant import calibrate

    try:
        return calibrate(
            target,
            rounds,
            mode=mode,
            sampling_rate=q,
            edge_rounds=edge_rounds,
            delta=delta,
            known=True,
        )
    except ValueError as exc:
        raise ConfigError(f"privacy.target_epsilon: {exc}") from None
