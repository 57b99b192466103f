"""Model parameters held as one float32 vector with views of it by name (the seeded-direction algorithms' fast
path, ``protocols/directions.py``), and their shapes in model order with what the directions' caches key on."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, MutableMapping

import numpy as np

Shaped = Mapping[str, tuple[int, ...]]  # parameter shapes by name, in model order


class Shapes(dict):
    """Parameter shapes by name, in model order (:func:`shapes_of`), with what the caches key on computed once."""

    @functools.cached_property
    def key(self) -> tuple:
        return tuple((n, tuple(s)) for n, s in self.items())

    @functools.cached_property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.values())


class Packed(dict):
    """Parameters held as one float32 vector (:attr:`flat`, model order) and, by name, views of it: the steps
    update the vector in a few operations instead of a few per tensor (the same bits either way)."""

    flat: np.ndarray
    shapes: Shapes


def packed(params: Mapping[str, np.ndarray]) -> Packed:
    """A :class:`Packed` copy of ``params`` (float32, model order)."""
    flat = np.concatenate([np.asarray(v, np.float32).ravel() for v in params.values()] or [np.zeros(0, np.float32)])
    return flat_packed(flat, shapes_of(params))


def flat_packed(flat: np.ndarray, shapes: Shapes) -> Packed:
    """A :class:`Packed` over the vector ``flat`` itself (its views read-only where ``flat`` is)."""
    out = Packed(views(flat, shapes))
    out.flat, out.shapes = flat, shapes
    return out


def views(flat: np.ndarray, shapes: Shaped) -> dict[str, np.ndarray]:
    """The tensors of ``shapes`` (in order) as views of the vector ``flat``."""
    out, at = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        out[name] = flat[at : at + n].reshape(shape)
        at += n
    return out


def shapes_key(shapes: Shaped) -> tuple:
    """What the caches key ``shapes`` on (:attr:`Shapes.key`)."""
    return shapes.key if isinstance(shapes, Shapes) else Shapes(shapes).key


def shapes_of(params: Mapping[str, np.ndarray]) -> Shapes:
    """The shapes of ``params`` by name, in order (a :class:`Packed`'s are kept with it)."""
    if isinstance(params, Packed):
        return params.shapes
    return Shapes((k, tuple(v.shape)) for k, v in params.items())


def writable(state: MutableMapping[str, np.ndarray], values: np.ndarray | None) -> Packed:
    """``state`` as arrays a replica may write (its own, or a copy of a shared one), holding ``values`` if given."""
    assert isinstance(state, Packed), "a replay that shares its states holds packed parameters"
    if state.flat.flags.writeable:
        if values is not None:
            np.copyto(state.flat, values)
        return state
    return flat_packed((values if values is not None else state.flat).copy(), state.shapes)


def frozen(state: Packed) -> Packed:
    """``state``'s vector (a replica's own), read-only from now on, with views made after (read-only too)."""
    state.flat.flags.writeable = False
    return flat_packed(state.flat, state.shapes)
