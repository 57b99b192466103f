"""Model parameters as they travel between tiers: an ordered dict of name -> float32 numpy array."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import numpy as np

from .rejections import Rejected, RejectKind
from .wire.payload import all_finite
from .wire.wire_record import WireRecord, wire_record

Params = "OrderedDict[str, np.ndarray]"


def zeros_like(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return OrderedDict((k, np.zeros_like(v)) for k, v in params.items())


def copy(params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return OrderedDict((k, np.array(v, copy=True)) for k, v in params.items())


def sub(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return OrderedDict((k, a[k] - b[k]) for k in a)


def sub_for_wire(
    a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], WireRecord | None]:
    """:func:`sub`, each difference written where its message will be (a :class:`WireRecord`'s arrays, the same
    values: a result framed once is then framed without copying them, ``Messenger.frame_once``), and the record (set
    it as the payload's ``headroom``); the plain :func:`sub` and ``None`` where a difference is not an array of the
    wire's dtypes as they are."""
    specs = []
    for k in a:
        x, y = a[k], b[k]
        if type(k) is not str or not isinstance(x, np.ndarray) or not isinstance(y, np.ndarray) or x.shape != y.shape:
            return sub(a, b), None
        specs.append((k, x.shape, np.result_type(x, y)))
    record = wire_record(specs)
    if record is None:
        return sub(a, b), None
    for k, out in record.arrays.items():
        np.subtract(a[k], b[k], out=out)
    return OrderedDict(record.arrays), record


def add(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], scale: float = 1.0) -> dict[str, np.ndarray]:
    """``a + scale * b`` in ``a``'s dtype."""
    if scale == 1.0:
        return OrderedDict((k, (a[k] + b[k]).astype(a[k].dtype, copy=False)) for k in a)
    return OrderedDict((k, (a[k] + np.asarray(scale, dtype=np.float64) * b[k]).astype(a[k].dtype)) for k in a)


Items = Sequence[tuple[float, Mapping[str, np.ndarray]]]
"""``(weight, parameters)`` pairs, summed in the order given."""


class Sums(Protocol):
    """Where weighted sums run (:func:`sums_on`); the host (numpy) unless a runtime installs another place."""

    def weighted_sum(self, items: Items) -> dict[str, np.ndarray] | None:
        """:func:`host_weighted_sum`'s result, bit for bit, as float64 host arrays, computed here; ``None``: not
        here (the host sums them)."""


_SUMS: ContextVar[Sums | None] = ContextVar("fedtier_sums", default=None)


@contextmanager
def sums_on(where: Sums | None) -> Iterator[None]:
    """Run the weighted sums of the enclosed code (:func:`weighted_sum`, :func:`weighted_mean`) on ``where``
    (``None``: the host). A runtime sets it around a role's aggregation (``fedtier sim``'s cells: on the cohort
    engine's device); roles stay unaware of it."""
    token = _SUMS.set(where)
    try:
        yield
    finally:
        _SUMS.reset(token)


SUM_BLOCK = 32768
"""Elements of a tensor that :func:`host_weighted_sum` sums at a time, every term of them before the next block: the
sum's block and the term being added (256 KiB each in float64) stay in a core's cache, where summing whole tensors
wrote a new model-sized term twice a result (converted, then weighted) and read the sum from memory again."""


class HostSum(OrderedDict[str, np.ndarray]):
    """A sum :func:`host_weighted_sum` made: its arrays are new, held by nothing else."""


def host_weighted_sum(items: Items) -> dict[str, np.ndarray]:
    """Per tensor, ``sum(float64(p) * w)`` in the order given, in float64: each term converted, multiplied by
    its weight, then added to the sum (no fused multiply-add); the definition every other place reproduces.
    Items of the same tensors (names, order, shapes: a cell's results) are summed by blocks of :data:`SUM_BLOCK`
    elements: each element sees the same operations in the same order, so the same bits."""
    blocked = _blocked_sum(items)
    if blocked is not None:
        return blocked
    acc = HostSum()
    for w, p in items:
        for k, v in p.items():
            term = np.asarray(v, dtype=np.float64) * w
            if k in acc:
                acc[k] += term
            else:
                acc[k] = term
    return acc


def _blocked_sum(items: Items) -> HostSum | None:
    """:func:`host_weighted_sum` block by block (:data:`SUM_BLOCK`), or ``None`` unless every item has the first
    one's tensors (names in order, shapes), all real numbers as numpy arrays."""
    if not items:
        return None
    first = items[0][1]
    shapes = [(k, v.shape) for k, v in first.items() if isinstance(v, np.ndarray) and v.dtype.kind in "fiub"]
    if len(shapes) != len(first):
        return None
    for _, p in items[1:]:
        if len(p) != len(shapes):
            return None
        for (k, shape), (name, v) in zip(shapes, p.items()):
            if name != k or not isinstance(v, np.ndarray) or v.shape != shape or v.dtype.kind not in "fiub":
                return None
    largest = max((math.prod(shape) for _, shape in shapes), default=0)
    term = np.empty(min(SUM_BLOCK, largest), np.float64)
    acc = HostSum()
    for k, shape in shapes:
        flat = [(w, p[k].reshape(-1)) for w, p in items]
        acc[k] = out = np.empty(shape, np.float64)
        whole = out.reshape(-1)
        for at in range(0, whole.size, SUM_BLOCK):
            block = whole[at : at + SUM_BLOCK]
            np.copyto(block, flat[0][1][at : at + SUM_BLOCK])  # the first term: converted, then weighted
            np.multiply(block, flat[0][0], out=block)
            t = term[: block.size]
            for w, v in flat[1:]:  # each next one: converted, weighted, then added
                np.copyto(t, v[at : at + SUM_BLOCK])
                np.multiply(t, w, out=t)
                np.add(block, t, out=block)
        if not shape:  # a 0-d tensor's sum is a numpy scalar, as the definition's
            acc[k] = out[()]
    return acc


def weighted_sum(items: Items) -> dict[str, np.ndarray]:
    """:func:`host_weighted_sum`, computed where :func:`sums_on` says (bit-identical everywhere)."""
    where = _SUMS.get()
    out = where.weighted_sum(items) if where is not None and items else None
    return out if out is not None else host_weighted_sum(items)


def weighted_mean(
    items: Iterable[tuple[float, Mapping[str, np.ndarray]]],
) -> tuple[dict[str, np.ndarray], float]:
    """Weighted mean of several parameter dicts, accumulated in float64 (:func:`weighted_sum`, where
    :func:`sums_on` says), divided on the host and returned as float32.

    Items are summed in the order given; callers pass them sorted by sender id so the result does
    not depend on arrival order. Returns (mean, total weight); raises on zero total weight.
    """
    items = list(items)
    total = float(sum(w for w, _ in items))
    if not items or total <= 0:
        raise ValueError("weighted mean of nothing (total weight is zero)")
    if len(items) == 1 and _alone_exact(*items[0]):  # its own values: the definition's bits, without its passes
        return OrderedDict((k, _float32_copy(v)) for k, v in items[0][1].items()), total
    acc = weighted_sum(items)
    mine = isinstance(acc, HostSum)  # new arrays nothing else holds: divided in place (no second float64 array)
    return OrderedDict((k, _divided(v, total, mine).astype(np.float32)) for k, v in acc.items()), total


ALONE_WEIGHT = 2**29
"""Integer weights below this times a float32 value are exact in float64 (24 + 29 bits < 53)."""


def _alone_exact(weight: float, params: Mapping[str, np.ndarray]) -> bool:
    """Whether the mean of ``params`` alone is ``params`` itself, bit for bit: an integer weight below
    :data:`ALONE_WEIGHT` and finite float32 tensors make ``float64(v) * w`` exact, so ``/ w`` gives ``v`` back exactly
    (-0.0 too) and so does its conversion to float32."""
    if not isinstance(weight, (int, float, np.integer, np.floating)) or not 1 <= weight < ALONE_WEIGHT:
        return False
    if not float(weight).is_integer():
        return False
    return all(isinstance(v, np.ndarray) and v.dtype == np.float32 and all_finite(v) for v in params.values())


def _float32_copy(v: np.ndarray) -> np.ndarray:
    """A float32 copy of ``v`` as the definition's mean gives it (a numpy scalar for a 0-d tensor)."""
    out = np.array(v, dtype=np.float32)
    return out if out.ndim else out[()]


def _divided(v: np.ndarray, total: float, in_place: bool) -> np.ndarray:
    return np.divide(v, total, out=v) if in_place and isinstance(v, np.ndarray) and v.ndim else v / total


def check_names_and_shapes(
    params: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]], what: str, *, ordered: bool
) -> None:
    """Raise :class:`Rejected` of kind shape unless ``params`` has exactly the names of ``shapes`` (in the same
    order where ``ordered``, in any order otherwise) and each tensor the shape given for its name."""
    same_names = (
        list(params) == list(shapes) if ordered else len(params) == len(shapes) and all(k in params for k in shapes)
    )
    if not same_names:
        missing = [k for k in shapes if k not in params]
        extra = [k for k in params if k not in shapes]
        raise Rejected(
            RejectKind.SHAPE, f"{what} has the wrong tensors (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    for k, shape in shapes.items():
        if tuple(np.shape(params[k])) != tuple(shape):
            raise Rejected(
                RejectKind.SHAPE,
                f"{what}: tensor {k!r} has shape {tuple(np.shape(params[k]))}, expected {tuple(shape)}",
            )


def check_like(params: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], what: str = "update") -> None:
    """Raise :class:`Rejected` (a ValueError) unless ``params`` has exactly ``reference``'s names (in order),
    shapes, float dtype, and finite values. Names and shapes are checked for every tensor before any value is
    read."""
    check_names_and_shapes(params, {k: v.shape for k, v in reference.items()}, what, ordered=True)
    for k, v in params.items():
        if v.dtype.kind != "f":
            raise Rejected(RejectKind.SHAPE, f"{what}: tensor {k!r} has dtype {v.dtype}, expected floats")
        if not all_finite(v):
            raise Rejected(RejectKind.NON_FINITE, f"{what}: tensor {k!r} has non-finite values")


def num_values(params: Mapping[str, np.ndarray]) -> int:
    return int(sum(v.size for v in params.values()))
