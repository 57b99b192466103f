"""Shared random directions for zeroth-order training: one CPU scheme every party regenerates bit for bit.

The scheme (DeComFL and any other seeded-direction algorithm use exactly this):

* A **round seed** is ``derive_seed(run_seed, round, "zo-round")``: a 63-bit integer, sent on the wire
  as ``uint64`` (one per round; the K x P directions of the round derive from it).
* Direction ``z(round_seed, k, p)`` for local step ``k`` and perturbation ``p`` comes from ONE numpy
  PCG64 generator, ``protocols.seeding.rng(round_seed, k, p, "zo-direction")``, that walks the
  parameters **in model order** (the order of the parameter dict, i.e. torch ``named_parameters``)
  and draws, for each tensor of ``n`` values, ``standard_normal(n, dtype=float32)`` (``gaussian``) or
  ``2 * integers(0, 2, n, dtype=int8) - 1`` as float32 (``rademacher``), reshaped to the tensor.
* A step update is ``x -= c * z`` per tensor in float32, with ``c = float32((lr / P) * g)``
  (``lr / P * g`` computed in float64, then rounded once to float32). A zero ``g`` is skipped.
  Local steps, catch-up replay and the cloud's model all call :func:`apply_step`, so the operation
  order (rounds oldest first, k ascending, p ascending) and rounding are the same everywhere; the
  elementwise float32 multiply and subtract are correctly rounded IEEE operations, so the result
  does not depend on the machine.
* With **momentum** beta > 0 (torch's heavy ball, which the DeComFL repository runs: its SGD steps on the
  ZO estimate), a step keeps a buffer ``b`` beside ``x``: ``b *= float32(beta)``, then for p = 0..P-1
  ``b += float32(g[p] / P) * z_p``, then ``x -= float32(lr) * b`` (:func:`apply_momentum_step`). The
  buffer is part of the global trajectory: a device reverts it with ``x`` after its local steps and
  replays it with ``x`` when it catches up, so both stay bit-identical to the cloud's.

:func:`fingerprint` hashes a small direction: parties can compare it at start-up to catch a numpy
whose generator stream differs.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping
from typing import Literal

import numpy as np

from .seeding import derive_seed, rng

Kind = Literal["gaussian", "rademacher"]
KINDS: tuple[str, ...] = ("gaussian", "rademacher")


def round_seed(run_seed: int, round: int) -> int:
    """The seed the cloud picks for ``round`` (the directions of all its steps derive from it)."""
    return derive_seed(run_seed, round, "zo-round")


CACHE_BYTES = 64 << 20  # directions kept for reuse within a process (bounds memory)
_cache: OrderedDict[tuple, dict[str, np.ndarray]] = OrderedDict()
_cached_bytes = 0
_lock = threading.Lock()  # agents may run as threads of one process (fedtier run)


def direction(
    round_seed: int, k: int, p: int, shapes: Mapping[str, tuple[int, ...]], kind: Kind = "gaussian"
) -> dict[str, np.ndarray]:
    """z(round_seed, k, p): float32 arrays of ``shapes``, drawn in the order of ``shapes``; read-only.

    Every device of a round (and its cell, and the cloud) needs the same directions: a process draws
    each once and hands out the same arrays while they fit in ``CACHE_BYTES`` (least recently used
    dropped first), so a cohort of simulated devices costs one draw, not one per device."""
    global _cached_bytes
    key = (int(round_seed), int(k), int(p), kind, tuple((n, tuple(s)) for n, s in shapes.items()))
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _cache.move_to_end(key)
            return dict(hit)
    out = _draw(int(round_seed), int(k), int(p), shapes, kind)
    size = sum(v.nbytes for v in out.values())
    if size <= CACHE_BYTES:
        for v in out.values():
            v.flags.writeable = False
        with _lock:
            if key not in _cache:
                _cache[key] = out
                _cached_bytes += size
            while _cached_bytes > CACHE_BYTES:
                _, old = _cache.popitem(last=False)
                _cached_bytes -= sum(v.nbytes for v in old.values())
    return dict(out)


def _draw(round_seed: int, k: int, p: int, shapes: Mapping[str, tuple[int, ...]], kind: Kind) -> dict[str, np.ndarray]:
    gen = rng(round_seed, k, p, "zo-direction")
    out: dict[str, np.ndarray] = {}
    for name, shape in shapes.items():
        n = int(np.prod(shape, dtype=np.int64))
        if kind == "gaussian":
            z = gen.standard_normal(n, dtype=np.float32)
        elif kind == "rademacher":
            z = (2 * gen.integers(0, 2, n, dtype=np.int8) - 1).astype(np.float32)
        else:
            raise ValueError(f"unknown direction kind {kind!r} (choose {', '.join(KINDS)})")
        out[name] = z.reshape(shape)
    return out


def shapes_of(params: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in params.items()}


def perturbed(params: Mapping[str, np.ndarray], z: Mapping[str, np.ndarray], mu: float) -> dict[str, np.ndarray]:
    """``x + mu * z`` as new float32 arrays (``params`` is not touched)."""
    m = np.float32(mu)
    return {k: (v + m * z[k]).astype(np.float32, copy=False) for k, v in params.items()}


def step_coefficient(lr: float, perturbations: int, g: float) -> np.float32:
    """``float32((lr / P) * g)``: the one rounding every party applies."""
    return np.float32(float(lr) / int(perturbations) * float(g))


def apply_step(
    params: MutableMapping[str, np.ndarray], round_seed: int, k: int, g: np.ndarray, lr: float, kind: Kind = "gaussian"
) -> None:
    """In place: ``x -= (lr / P) * g[p] * z(round_seed, k, p)`` for p = 0..P-1 (``g`` holds P scalars)."""
    g = np.asarray(g)
    shapes = shapes_of(params)
    for p in range(g.shape[0]):
        c = step_coefficient(lr, g.shape[0], g[p])
        if c == 0:
            continue
        z = direction(round_seed, k, p, shapes, kind)
        for name, v in params.items():
            v -= c * z[name]


def apply_momentum_step(
    params: MutableMapping[str, np.ndarray],
    buf: MutableMapping[str, np.ndarray],
    round_seed: int,
    k: int,
    g: np.ndarray,
    lr: float,
    momentum: float,
    kind: Kind = "gaussian",
) -> None:
    """In place, heavy ball on the ZO estimate: ``b = beta * b + sum_p (g[p] / P) z_p; x -= lr * b``."""
    g = np.asarray(g)
    shapes = shapes_of(params)
    beta, rate = np.float32(momentum), np.float32(lr)
    for v in buf.values():
        v *= beta
    for p in range(g.shape[0]):
        c = np.float32(float(g[p]) / g.shape[0])
        if c == 0:
            continue
        z = direction(round_seed, k, p, shapes, kind)
        for name, v in buf.items():
            v += c * z[name]
    for name, v in params.items():
        v -= rate * buf[name]


def apply_round(
    params: MutableMapping[str, np.ndarray],
    round_seed: int,
    g: np.ndarray,
    lr: float,
    kind: Kind = "gaussian",
    buf: MutableMapping[str, np.ndarray] | None = None,
    momentum: float = 0.0,
) -> None:
    """In place: one round's global update from its K x P averaged scalars (k ascending); with
    ``momentum`` > 0 the heavy-ball buffer ``buf`` is stepped too."""
    for k in range(g.shape[0]):
        if momentum:
            assert buf is not None, "momentum needs its buffer"
            apply_momentum_step(params, buf, round_seed, k, g[k], lr, momentum, kind)
        else:
            apply_step(params, round_seed, k, g[k], lr, kind)


def fingerprint(kind: Kind = "gaussian") -> str:
    """A short hash of z(123, 0, 0) over a (4, 4) tensor: equal on every party that agrees on the scheme."""
    z = direction(123, 0, 0, {"w": (4, 4)}, kind)["w"]
    return hashlib.sha256(z.astype("<f4").tobytes()).hexdigest()[:16]
