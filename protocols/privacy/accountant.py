"""Privacy accounting for fedtier's differential privacy (``[privacy] dp``), on Google's ``dp-accounting``.

The guarantee is **device-level**: two runs are neighbours when one device's whole data set is added,
removed (cell-level DP) or replaced (local DP). With ``z`` the noise multiplier, ``C`` the clip norm, ``E``
edge rounds per cloud round and ``q`` a device's probability of taking part in a cloud round:

* ``dp = "cell"``: a device that takes part adds its clipped update (L2 norm <= C) to its cell's sum in each
  of the E edge rounds, and each sum gets N(0, (zC)^2) noise. The E Gaussian releases of a cloud round
  compose exactly into one Gaussian mechanism of noise multiplier ``z / sqrt(E)``; the device takes part
  in a cloud round with probability ``q`` (Poisson sampling), so a cloud round is the Poisson-subsampled
  Gaussian mechanism and a run of R cloud rounds is its R-fold composition.
* ``dp = "local"``: each device's own noisy update is released to its cell, who knows who took part: no
  amplification by sampling (q = 1), and under replacement a clipped update moves by up to ``2C``, so a
  release is a Gaussian mechanism of multiplier ``z / 2`` and a cloud round one of ``z / (2 sqrt(E))``;
  R rounds compose. This bounds the worst device, one that took part in every round.

The RDP accountant converts the composed Renyi-DP curve into (epsilon, delta).

**What a run records** (``RunConfig.dp_accountant``): ``known_participation``. Who takes part in a round is
drawn from ``run.seed`` (which every node's config holds) or is plain availability, and the records name
the participants: nobody's participation is secret, so sampling amplifies nothing (``q = 1``), and since a
device's taking part is known, its neighbouring runs differ by its data *replaced*, not removed: a clipped
update moves a sum by up to ``2C``, and a release is the Gaussian mechanism of multiplier ``z / 2`` at
every tier (the noise of cell DP, the noise of each device in local DP, the noise left in a securely
aggregated sum of at least ``dp_min_survivors`` devices). :meth:`Accountant.by_party` states epsilon
against the cloud, the cell and the other devices separately: the cloud and the other devices see the
cells' noisy reports and the models built from them; a cell sees what its devices send, which under
cell DP without secure aggregation are the clipped updates themselves (no guarantee against the cell).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

DpMode = Literal["local", "cell"]


def _quiet(record: logging.LogRecord) -> bool:
    """dp-accounting warns (through absl) for every fractional RDP order whose series does not converge at
    large sampling rates; it leaves those orders out, which keeps the bound valid: not worth a log line."""
    return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_quiet)


@dataclass(frozen=True)
class Accountant:
    """(epsilon, delta) of a run after a number of cloud rounds (see the module for the mechanism)."""

    mode: DpMode
    noise_multiplier: float
    sampling_rate: float  # q: a device's probability of taking part in a cloud round (cell mode)
    edge_rounds: int
    delta: float
    orders: Sequence[float] | None = None  # RDP orders; None: the library's defaults
    known_participation: bool = False  # participation is public: q = 1 and replace-one neighbours (the module)
    cell_sees_updates: bool = False  # cell DP without secure aggregation: the cell sees each clipped update

    def __post_init__(self) -> None:
        if self.mode not in ("local", "cell"):
            raise ValueError(f"dp mode must be local or cell, got {self.mode!r}")
        if not (
            self.noise_multiplier >= 0 and 0 < self.sampling_rate <= 1 and self.edge_rounds >= 1 and 0 < self.delta < 1
        ):
            raise ValueError(f"bad accountant parameters {self}")

    @property
    def round_multiplier(self) -> float:
        """The noise multiplier of the Gaussian mechanism one cloud round amounts to."""
        z = self.noise_multiplier / math.sqrt(self.edge_rounds)
        return z / 2 if self.mode == "local" or self.known_participation else z

    @property
    def round_sampling(self) -> float:
        """The Poisson sampling rate the accountant applies per cloud round (1 for local DP and for a
        participation that is not secret)."""
        return 1.0 if self.mode == "local" or self.known_participation else self.sampling_rate

    @property
    def basis(self) -> str:
        """What the epsilon assumes, in words (records carry it)."""
        if self.round_sampling == 1:
            q = "q = 1 (participation drawn from run.seed or observed: no amplification)"
        else:
            q = f"q = {self.round_sampling:g} (Poisson sampling from a secret)"
        replace = self.mode == "local" or self.known_participation
        neighbours = "replace-one (sensitivity 2C)" if replace else "add/remove-one (sensitivity C)"
        return f"{q}; {neighbours}; z {self.noise_multiplier:g} per edge round, E = {self.edge_rounds}"

    def by_party(self, rounds: int) -> dict[str, float]:
        """Epsilon after ``rounds`` cloud rounds against the cloud, a device's cell, and the other devices
        (``inf``: no guarantee against that party)."""
        eps = self.epsilon(rounds)
        return {"cloud": eps, "cell": math.inf if self.cell_sees_updates and rounds > 0 else eps, "devices": eps}

    @functools.cached_property
    def _one_round(self):  # -> RdpAccountant
        """The library's accountant of one cloud round, computed once: a subsampled Gaussian's RDP costs ~0.2 s
        (a series at every fractional order), and R rounds are R times it (what the library's ``compose(event, R)``
        computes, bit for bit)."""
        import dp_accounting
        from dp_accounting.rdp import rdp_privacy_accountant as rdp

        accountant = rdp.RdpAccountant(**({"orders": list(self.orders)} if self.orders else {}))
        gaussian = dp_accounting.GaussianDpEvent(self.round_multiplier)
        q = self.round_sampling
        accountant.compose(gaussian if q == 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian))
        return accountant

    def rdp(self, rounds: int) -> list[float]:
        """The composed Renyi-DP of ``rounds`` cloud rounds at the accountant's orders."""
        return [float(x) for x in rounds * self._one_round._rdp]

    def epsilon(self, rounds: int) -> float:
        """Epsilon after ``rounds`` cloud rounds (0 before any; ``inf`` without noise)."""
        if rounds <= 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        one = self._one_round
        return float(compute_epsilon(one._orders, rounds * one._rdp, self.delta)[0])

    def max_rounds(self, budget: float, upto: int) -> int:
        """The most cloud rounds, at most ``upto``, whose epsilon stays within ``budget``."""
        if self.epsilon(upto) <= budget:
            return upto
        lo, hi = 0, upto  # epsilon(lo) <= budget < epsilon(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.epsilon(mid) <= budget else (lo, mid)
        return lo


def calibrate(
    target_epsilon: float,
    rounds: int,
    *,
    mode: DpMode,
    sampling_rate: float,
    edge_rounds: int,
    delta: float,
    tolerance: float = 1e-3,
    known: bool = False,
) -> float:
    """The smallest noise multiplier (to ``tolerance``, relative) whose run of ``rounds`` cloud rounds
    spends at most ``target_epsilon``."""
    if not target_epsilon > 0 or math.isinf(target_epsilon):
        raise ValueError(f"target epsilon must be positive and finite, got {target_epsilon}")

    def eps(z: float) -> float:
        return Accountant(mode, z, sampling_rate, edge_rounds, delta, known_participation=known).epsilon(rounds)

    lo, hi = 0.0, 1.0
    while eps(hi) > target_epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            raise ValueError(f"no noise multiplier reaches epsilon {target_epsilon} in {rounds} rounds")
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi
