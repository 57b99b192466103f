"""Participation (availability) models: which devices are available in each round.

Each model is built over a fixed ordered list of device ids and a seed; ``participants(round)`` returns a
``frozenset`` of ids that depends only on ``(seed, round)`` (and the construction parameters), never on the
order or number of earlier calls: each round's draw comes from ``rng(seed, round, "participation", <model>)``.
The Markov model's state at round ``r`` depends on earlier rounds, so its chain is computed forward from
round 0 (each step keyed by its round), its last states kept. ``expected_rate(device)`` is the long-run fraction of
rounds in which the device participates (``None`` where not meaningful).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from protocols.config import DeviceIds
from protocols.seeding import rng

from .trace_file import read_trace

__all__ = [
    "ParticipationModel",
    "Always",
    "UniformSample",
    "Bernoulli",
    "CyclicGroups",
    "RegularizedPermutation",
    "Markov",
    "Trace",
    "make_participation",
    "MODELS",
]


def _check_round(r: Any) -> int:
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
        raise ValueError(f"round must be a non-negative integer, got {r!r}")
    return int(r)


def _check_int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or (hi is not None and v > hi):
        rng_txt = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be an integer {rng_txt}, got {v!r}")
    return int(v)


def _check_prob(name: str, v: Any) -> float:
    try:
        p = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a probability in [0, 1], got {v!r}") from None
    if not 0.0 <= p <= 1.0:  # also rejects NaN
        raise ValueError(f"{name} must be a probability in [0, 1], got {v!r}")
    return p


class ParticipationModel:
    """Base class: ``participants(round) -> frozenset[str]`` over ``devices``, seeded by ``seed``."""

    name = "base"

    def __init__(self, devices: Sequence[str], seed: int = 0) -> None:
        self.seed = int(seed)
        if isinstance(devices, DeviceIds):  # a topology's ids: unique, made when read (large populations)
            if not len(devices):
                raise ValueError("devices must be a non-empty list of device ids")
            self.devices: Sequence[str] = devices
            self.index: Mapping[str, int] = _Positions(devices)
            return
        devs = tuple(str(d) for d in devices)
        if not devs:
            raise ValueError("devices must be a non-empty list of device ids")
        if len(set(devs)) != len(devs):
            raise ValueError("devices must be unique")
        self.devices = devs
        self.index = {d: i for i, d in enumerate(devs)}

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def mask(self, round: int) -> np.ndarray:
        """Boolean availability vector aligned with ``devices``."""
        raise NotImplementedError

    def participants(self, round: int) -> frozenset[str]:
        m = self.mask(_check_round(round))
        return frozenset(self.devices[i] for i in np.flatnonzero(m).tolist())

    def expected_rate(self, device: str) -> float | None:
        """Long-run participation frequency of ``device`` (``None`` if not meaningful)."""
        return None

    def _rng(self, round: int, *keys: Any) -> np.random.Generator:
        return rng(self.seed, round, "participation", self.name, *keys)

    def _i(self, device: str) -> int:
        try:
            return self.index[device]
        except KeyError:
            raise KeyError(f"unknown device {device!r}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.num_devices}, seed={self.seed})"


class _Positions(Mapping[str, int]):
    """``device -> position`` of a :class:`DeviceIds`, computed (no table)."""

    def __init__(self, ids: DeviceIds) -> None:
        self.ids = ids

    def __getitem__(self, device: str) -> int:
        at = self.ids.position(device)
        if at is None:
            raise KeyError(device)
        return at

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def _per_device(name: str, value: Any, devices: Sequence[str]) -> np.ndarray:
    """A scalar, a mapping device -> value, or a sequence aligned with ``devices`` -> float array."""
    if isinstance(value, Mapping):
        missing = [d for d in devices if d not in value]
        extra = sorted(set(map(str, value)) - set(devices))
        if missing or extra:
            raise ValueError(
                f"{name}: mapping must cover exactly the devices (missing {missing[:5]}, unknown {extra[:5]})"
            )
        vals = [value[d] for d in devices]
    elif isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, str):
        vals = list(value)
        if len(vals) != len(devices):
            raise ValueError(f"{name}: expected {len(devices)} values (one per device), got {len(vals)}")
    else:
        vals = [value] * len(devices)
    return np.array([_check_prob(name, v) for v in vals], dtype=np.float64)


class Always(ParticipationModel):
    """Every device in every round."""

    name = "always"

    def mask(self, round: int) -> np.ndarray:
        return np.ones(self.num_devices, dtype=bool)

    def expected_rate(self, device: str) -> float:
        self._i(device)
        return 1.0


class UniformSample(ParticipationModel):
    """Exactly ``s`` of the ``N`` devices, uniformly without replacement, each round."""

    name = "uniform"

    def __init__(self, devices: Sequence[str], s: int, seed: int = 0) -> None:
        super().__init__(devices, seed)
        self.s = _check_int("per_round", s, 1, self.num_devices)

    def mask(self, round: int) -> np.ndarray:
        m = np.zeros(self.num_devices, dtype=bool)
        m[self._rng(round).choice(self.num_devices, size=self.s, replace=False)] = True
        return m

    def expected_rate(self, device: str) -> float:
        self._i(device)
        return self.s / self.num_devices


class Bernoulli(ParticipationModel):
    """Device ``i`` is available independently with probability ``p_i`` each round."""

    name = "bernoulli"

    def __init__(
        self, devices: Sequence[str], probs: float | Mapping[str, float] | Sequence[float], seed: int = 0
    ) -> None:
        super().__init__(devices, seed)
        self.probs = _per_device("probs", probs, self.devices)

    def mask(self, round: int) -> np.ndarray:
        return self._rng(round).random(self.num_devices) < self.probs

    def expected_rate(self, device: str) -> float:
        return float(self.probs[self._i(device)])


class CyclicGroups(ParticipationModel):
    """Periodic availability (Wang & Ji, generalized FedAvg under arbitrary participation).

    Devices are split into ``groups`` near-equal groups by a seeded permutation; each group stays available
    for ``period`` consecutive rounds (K; the paper's E1 uses K = 100), so the cycle has ``groups * period``
    rounds; in round ``r`` the groups ``((r + offset) // period + j) mod groups`` for ``j < active`` are
    available. ``offset`` is drawn once from the seed, uniform in ``[0, cycle)``, if ``random_offset`` (so
    the first group gets a random remainder of its period, as in the paper), else 0. With ``per_round``
    set, exactly that many of the available devices take part each round: sampled uniformly
    (``selection = "uniform"``), or by the paper's regularized selection (``"permutation"``): the available
    devices are cut by a fresh seeded permutation into ``ceil(m / per_round)`` near-equal batches taken in
    turn, so each available device takes part once per pass.
    """

    name = "cyclic"

    def __init__(
        self,
        devices: Sequence[str],
        groups: int,
        seed: int = 0,
        active: int = 1,
        random_offset: bool = True,
        per_round: int | None = None,
        period: int = 1,
        selection: str = "uniform",
    ) -> None:
        super().__init__(devices, seed)
        self.groups = _check_int("groups", groups, 1, self.num_devices)
        self.period = _check_int("period", period, 1)
        if selection not in ("uniform", "permutation"):
            raise ValueError(f"selection must be 'uniform' or 'permutation', got {selection!r}")
        self.selection = selection
        self.active = _check_int("active", active, 1, self.groups)
        perm = rng(self.seed, "participation", self.name, "groups").permutation(self.num_devices)
        self.group_of = np.empty(self.num_devices, dtype=np.int64)
        for g, members in enumerate(np.array_split(perm, self.groups)):
            self.group_of[members] = g
        self.offset = (
            int(rng(self.seed, "participation", self.name, "offset").integers(self.cycle)) if random_offset else 0
        )
        sizes = np.bincount(self.group_of, minlength=self.groups)
        self._avail_sizes = np.array(
            [sum(sizes[(p + j) % self.groups] for j in range(self.active)) for p in range(self.groups)]
        )
        self.per_round = (
            None if per_round is None else _check_int("per_round", per_round, 1, int(self._avail_sizes.min()))
        )

    @property
    def cycle(self) -> int:
        """Rounds after which the availability pattern repeats: ``groups * period``."""
        return self.groups * self.period

    def available_groups(self, round: int) -> list[int]:
        return [((round + self.offset) // self.period + j) % self.groups for j in range(self.active)]

    def mask(self, round: int) -> np.ndarray:
        m = np.isin(self.group_of, self.available_groups(round))
        if self.per_round is not None:
            avail = np.flatnonzero(m)
            m = np.zeros(self.num_devices, dtype=bool)
            if self.selection == "uniform":
                m[self._rng(round).choice(avail, size=self.per_round, replace=False)] = True
            else:  # regularized: passes of ceil(m / s) rounds, counted from the start of this stint
                stint, pos = divmod(round + self.offset, self.period)
                passes = math.ceil(len(avail) / self.per_round)
                k, j = divmod(pos, passes)
                perm = rng(self.seed, stint, k, "participation", self.name, "pass").permutation(avail)
                m[np.array_split(perm, passes)[j]] = True
        return m

    def expected_rate(self, device: str) -> float:
        g = int(self.group_of[self._i(device)])
        total = 0.0
        for phase in range(self.groups):  # phase = ((round + offset) // period) mod groups
            if g in [(phase + j) % self.groups for j in range(self.active)]:
                total += 1.0 if self.per_round is None else self.per_round / self._avail_sizes[phase]
        return total / self.groups  # (permutation selection: exact when per_round divides the group size)


class RegularizedPermutation(ParticipationModel):
    """Each block of ``B = ceil(N / s)`` rounds is a fresh seeded permutation of the devices cut into ``B``
    disjoint groups (``np.array_split``: exactly ``s`` each when ``s`` divides ``N``, otherwise near-equal
    groups of at most ``s``); round ``r`` uses group ``r mod B`` of block ``r // B``, so every device
    participates exactly once per block."""

    name = "permutation"

    def __init__(self, devices: Sequence[str], s: int, seed: int = 0) -> None:
        super().__init__(devices, seed)
        self.s = _check_int("per_round", s, 1, self.num_devices)
        self.block = math.ceil(self.num_devices / self.s)

    def mask(self, round: int) -> np.ndarray:
        b, j = divmod(round, self.block)
        perm = rng(self.seed, b, "participation", self.name).permutation(self.num_devices)
        m = np.zeros(self.num_devices, dtype=bool)
        m[np.array_split(perm, self.block)[j]] = True
        return m

    def expected_rate(self, device: str) -> float:
        self._i(device)
        return 1.0 / self.block


class Markov(ParticipationModel):
    """Per-device two-state on/off Markov chain.

    Round 0: on with probability ``start_on_prob`` (default: the stationary rate). Round ``r > 0``: an on
    device turns off with ``p_on_to_off``, an off device turns on with ``p_off_to_on``; the uniforms for round
    ``r`` come from ``rng(seed, r, "participation", "markov")``. Parameters are scalars or per device.
    """

    name = "markov"
    KEPT_ROUNDS = 8  # a consumer a few rounds behind another costs nothing; an older round is computed from round 0

    def __init__(
        self, devices: Sequence[str], p_on_to_off: Any, p_off_to_on: Any, start_on_prob: Any = None, seed: int = 0
    ) -> None:
        super().__init__(devices, seed)
        self.p_off = _per_device("p_off", p_on_to_off, self.devices)
        self.p_on = _per_device("p_on", p_off_to_on, self.devices)
        total = self.p_off + self.p_on
        self.stationary = np.where(total > 0, self.p_on / np.where(total > 0, total, 1.0), np.nan)
        if start_on_prob is None:
            if np.isnan(self.stationary).any():
                raise ValueError("start_on must be given when p_on = p_off = 0 (no stationary rate)")
            self.start = self.stationary.copy()
        else:
            self.start = _per_device("start_on", start_on_prob, self.devices)
        self._recent: dict[int, np.ndarray] = {}  # the chain's states of the last KEPT_ROUNDS rounds computed

    def mask(self, round: int) -> np.ndarray:
        if round not in self._recent:  # (every round's state was kept: 1e6 devices over 10,000 rounds took 10 GB)
            r = max((k for k in self._recent if k < round), default=-1)
            state, self._recent = self._recent.get(r), self._recent if r >= 0 else {}
            for step in range(r + 1, round + 1):
                u = self._rng(step).random(self.num_devices)
                state = u < self.start if state is None else np.where(state, u >= self.p_off, u < self.p_on)
                self._recent[step] = state
                if len(self._recent) > self.KEPT_ROUNDS:
                    del self._recent[min(self._recent)]
        return self._recent[round].copy()

    def expected_rate(self, device: str) -> float:
        i = self._i(device)
        s = self.stationary[i]
        return float(self.start[i] if np.isnan(s) else s)


class Trace(ParticipationModel):
    """Replay of a CSV availability trace with header ``device,start,end``.

    Each row makes ``device`` available in rounds ``[start, end)`` (0-based, half-open, ``start < end``);
    a device may have several rows (overlaps are merged); devices without rows are never available. Rows
    naming a device not in ``devices`` are refused unless ``strict=False`` (then they are ignored). A file that
    cannot be used raises :class:`~protocols.config.UnusableFile` (a ``ValueError``: :mod:`sim.trace_file`).
    """

    name = "trace"

    def __init__(self, devices: Sequence[str], path: str | Path, seed: int = 0, strict: bool = True) -> None:
        super().__init__(devices, seed)
        self.path = Path(path)
        self.intervals = read_trace(self.path, self.devices, strict)
        for d, iv in self.intervals.items():
            self.intervals[d] = self._merge(iv)
        ends = [e for iv in self.intervals.values() for _, e in iv]
        self.horizon = max(ends) if ends else 0

    @staticmethod
    def _merge(iv: list[tuple[int, int]]) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], e))
            else:
                out.append((s, e))
        return out

    def mask(self, round: int) -> np.ndarray:
        return np.array([any(s <= round < e for s, e in self.intervals[d]) for d in self.devices], dtype=bool)

    def expected_rate(self, device: str) -> float | None:
        """Fraction of rounds ``[0, horizon)`` the device is available (``horizon`` = last ``end``)."""
        self._i(device)
        if self.horizon == 0:
            return None
        return sum(e - s for s, e in self.intervals[device]) / self.horizon


# ---------------------------------------------------------------------------------------------- factory
MODELS = ("always", "uniform", "bernoulli", "cyclic", "permutation", "markov", "trace")

_SPEC_KEYS = {
    "always": set(),
    "uniform": {"per_round"},
    "bernoulli": {"prob", "probs"},
    "cyclic": {"groups", "per_round", "random_offset", "active", "period", "selection"},
    "permutation": {"per_round"},
    "markov": {"p_off", "p_on", "start_on"},
    "trace": {"path", "strict"},
}


def check_spec(spec: Mapping[str, Any] | Any) -> tuple[str, dict[str, Any]]:
    """The model name and parameters of ``spec`` (as :func:`make_participation` takes it); ``ValueError`` for an
    unknown model or a parameter it never reads (``prob`` with ``always``)."""
    if hasattr(spec, "model_dump"):
        spec = spec.model_dump()
    if not isinstance(spec, Mapping):
        raise ValueError(f"participation spec must be a mapping or pydantic model, got {type(spec).__name__}")
    params = {k: v for k, v in spec.items() if v is not None}
    name = params.pop("model", None)
    if name is None:
        raise ValueError(f"participation spec needs 'model', one of {list(MODELS)}")
    name = str(name).strip().lower()
    if name not in _SPEC_KEYS:
        raise ValueError(f"unknown participation model {name!r}; expected one of {list(MODELS)}")
    extra = sorted(set(params) - _SPEC_KEYS[name])
    if extra:
        raise ValueError(
            f"participation model {name!r} has no parameter(s) {extra}; allowed: {sorted(_SPEC_KEYS[name])}"
        )
    return name, params


def make_participation(spec: Mapping[str, Any] | Any, devices: Sequence[str], seed: int) -> ParticipationModel:
    """Build a model from ``{"model": name, **params}`` (a dict or a pydantic model; ``None`` = unset).

    ``always``; ``uniform``: ``per_round``; ``bernoulli``: ``prob`` (scalar) or ``probs`` (dict/list);
    ``cyclic``: ``groups``, ``per_round``, ``random_offset``, ``active``, ``period``, ``selection``;
    ``permutation``: ``per_round``;
    ``markov``: ``p_off`` (on->off), ``p_on`` (off->on), ``start_on``; ``trace``: ``path``, ``strict``.
    """
    name, params = check_spec(spec)

    def need(key: str) -> Any:
        if key not in params:
            raise ValueError(f"participation model {name!r} needs parameter {key!r}")
        return params[key]

    if name == "always":
        return Always(devices, seed)
    if name == "uniform":
        return UniformSample(devices, need("per_round"), seed)
    if name == "bernoulli":
        if ("prob" in params) == ("probs" in params):
            raise ValueError("participation model 'bernoulli' needs exactly one of 'prob' or 'probs'")
        if "prob" in params:
            return Bernoulli(devices, _check_prob("prob", params["prob"]), seed)
        return Bernoulli(devices, params["probs"], seed)
    if name == "cyclic":
        ro = params.get("random_offset", True)
        if not isinstance(ro, bool):
            raise ValueError(f"random_offset must be a boolean, got {ro!r}")
        return CyclicGroups(
            devices,
            need("groups"),
            seed,
            active=params.get("active", 1),
            random_offset=ro,
            per_round=params.get("per_round"),
            period=params.get("period", 1),
            selection=params.get("selection", "uniform"),
        )
    if name == "permutation":
        return RegularizedPermutation(devices, need("per_round"), seed)
    if name == "markov":
        return Markov(devices, need("p_off"), need("p_on"), params.get("start_on"), seed)
    return Trace(devices, need("path"), seed, strict=params.get("strict", True))
