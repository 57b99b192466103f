"""Partitioners: split a labelled training set over devices (flat) or over cells and their devices.

Every scheme returns one **sorted** ``int64`` index array per device; together they use every sample
exactly once (no overlap, nothing lost). All randomness comes from
``protocols.seeding.rng(seed, "partition", scheme, ...)``, so the same ``(labels, seed, params)`` always gives
the same partition in any process.

Schemes (:func:`partition`):

- ``iid``: a seeded permutation cut into ``num_devices`` near-equal parts (the first ``n % num_devices``
  devices get one extra sample).
- ``dirichlet`` (``alpha``, ``min_size=1``, ``max_attempts=1000``): the standard recipe (Hsu et al. 2019):
  for each class, proportions ``p ~ Dir(alpha * 1)`` over devices and the class's shuffled samples are cut at
  ``floor(cumsum(p) * n_class)``. The whole draw is redone (new keyed stream per attempt) until every
  device holds at least ``min_size`` samples; after ``max_attempts`` a ``ValueError`` is raised.
- ``shards`` (``shards_per_device=k``): samples are sorted by label (shuffled within each label) and cut
  into ``S = num_devices * k`` shards; a seeded permutation deals ``k`` shards to each device.
  Shards are label-pure whenever ``S >= #classes``: class ``c`` gets ``s_c`` shards, ``s_c`` apportioned to
  class sizes by largest remainder with ``s_c >= 1``, and its samples are split into ``s_c`` near-equal
  shards (``np.array_split``; the first ``n_c % s_c`` shards of a class get one extra sample), so no sample
  is left over and every device sees at most ``k`` labels. If ``S < #classes`` the sorted samples are
  cut into ``S`` near-equal shards instead (shards may then mix labels).

:func:`hierarchical_partition`: Dirichlet(``alpha_cells``) across cells, then, within each cell,
Dirichlet(``alpha_devices``) across that cell's devices. :func:`cell_shards_partition` (HIST's split (ii),
"cells iid, devices non-iid"): an ``iid`` split into one equal part per cell, then ``shards`` within each
cell. :func:`partition_hierarchy` dispatches on the scheme name; for flat schemes it partitions over
``cells * devices_per_cell`` devices and groups consecutive
devices into cells.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from protocols.seeding import rng

__all__ = [
    "Parts",
    "partition",
    "hierarchical_partition",
    "cell_shards_partition",
    "partition_hierarchy",
    "label_histogram",
    "SCHEMES",
]


class Parts(Sequence[np.ndarray]):
    """Index arrays of consecutive parts kept as one flat array and offsets: ``parts[i]`` is a view,
    ``parts[a:b]`` a ``Parts`` over the same array, so a million devices cost two arrays, not a
    million (the partitions of a population are index views)."""

    def __init__(self, flat: np.ndarray, offsets: np.ndarray) -> None:
        self.flat, self.offsets = flat, offsets

    @classmethod
    def of(cls, parts: Sequence[np.ndarray]) -> Parts:
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if len(parts) else np.zeros(0, np.int64)
        return cls(flat, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, i: slice) -> Parts: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | Parts:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return Parts.of([self[j] for j in range(start, stop, step)])
            return Parts(self.flat, self.offsets[start : max(start, stop) + 1])
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"part {i} of {n}")
        i %= n
        return self.flat[self.offsets[i] : self.offsets[i + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[i] for i in range(len(self)))


SCHEMES = ("iid", "dirichlet", "shards")


def _check_labels(labels: np.ndarray) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be a 1-D array, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and y.min() < 0:
        raise ValueError("labels must be non-negative")
    return y.astype(np.int64, copy=False)


def _check_count(name: str, value: Any, n: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if n is not None and value > n:
        raise ValueError(f"{name} ({value}) exceeds the number of samples ({n})")
    return int(value)


def _check_alpha(name: str, alpha: Any) -> float:
    try:
        a = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {alpha!r}") from None
    if not np.isfinite(a) or a <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {alpha!r}")
    return a


def _finish(parts: list[np.ndarray]) -> Parts:
    return Parts.of([np.sort(np.asarray(p, dtype=np.int64)) for p in parts])


# ---------------------------------------------------------------------------------------------- schemes
def _iid(y: np.ndarray, k: int, seed: int, *keys: Any) -> Parts:
    """``np.array_split`` of a seeded permutation into ``k`` parts, each sorted in place (the parts of one
    size are the rows of a matrix view, sorted in one call)."""
    n = y.size
    perm = rng(seed, "partition", "iid", *keys).permutation(n)
    small, extra = divmod(n, k)  # array_split's sizes: the first n % k parts one larger
    big = extra * (small + 1)
    perm[:big].reshape(extra, small + 1).sort(axis=1)
    perm[big:].reshape(k - extra, small).sort(axis=1)
    sizes = np.full(k, small, dtype=np.int64)
    sizes[:extra] += 1
    return Parts(perm, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def _dirichlet(
    y: np.ndarray, k: int, alpha: float, min_size: int, max_attempts: int, keys: tuple, alpha_name: str = "alpha"
) -> Parts:
    """Dirichlet split of positions ``0..len(y)-1`` over ``k`` parts; draws from ``rng(*keys, attempt)``."""
    n = y.size
    if min_size * k > n:
        raise ValueError(f"min_size ({min_size}) x parts ({k}) exceeds the number of samples ({n})")
    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    sizes = np.zeros(k, dtype=np.int64)
    for attempt in range(max_attempts):
        g = rng(*keys, attempt)
        buckets: list[list[np.ndarray]] = [[] for _ in range(k)]
        for idx in by_class:
            idx = g.permutation(idx)
            p = g.dirichlet(np.full(k, alpha))
            cuts = (np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            for j, chunk in enumerate(np.split(idx, cuts)):
                buckets[j].append(chunk)
        sizes = np.array([sum(c.size for c in b) for b in buckets])
        if sizes.min() >= min_size:
            return _finish([np.concatenate(b) if b else np.zeros(0, np.int64) for b in buckets])
    raise ValueError(
        f"dirichlet partition: no draw in max_attempts={max_attempts} gave every one of {k} parts at least "
        f"min_size={min_size} samples (smallest part had {int(sizes.min())}); increase {alpha_name} "
        f"(now {alpha}), lower min_size, use fewer parts, or raise max_attempts"
    )


def _apportion(counts: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder apportionment of ``total`` over ``counts`` with each share in ``[1, count]``."""
    quota = total * counts / counts.sum()
    share = np.clip(np.floor(quota).astype(np.int64), 1, counts)
    while share.sum() < total:  # add to the largest remainder that still has room
        rem = np.where(share < counts, quota - share, -np.inf)
        share[int(np.argmax(rem))] += 1
    while share.sum() > total:  # remove from the smallest remainder that can spare one
        rem = np.where(share > 1, quota - share, np.inf)
        share[int(np.argmin(rem))] -= 1
    return share


def _shards(y: np.ndarray, k: int, per_device: int, seed: int, *keys: Any) -> Parts:
    n_shards = k * per_device
    if n_shards > y.size:
        raise ValueError(
            f"shards_per_device ({per_device}) x num_devices ({k}) = {n_shards} shards "
            f"exceeds the number of samples ({y.size})"
        )
    g = rng(seed, "partition", "shards", *keys)
    perm = g.permutation(y.size)
    order = perm[np.argsort(y[perm], kind="stable")]  # sorted by label, random within a label
    classes, counts = np.unique(y, return_counts=True)
    if n_shards >= classes.size:
        per_class = _apportion(counts, n_shards)
        shards = []
        for idx_c, s_c in zip(np.split(order, np.cumsum(counts)[:-1]), per_class):
            shards.extend(np.array_split(idx_c, int(s_c)))
    else:
        shards = np.array_split(order, n_shards)
    deal = g.permutation(n_shards)
    return _finish([np.concatenate([shards[s] for s in deal[d * per_device : (d + 1) * per_device]]) for d in range(k)])


_REQUIRED = object()


def _take(params: dict[str, Any], scheme: str, allowed: dict[str, Any]) -> dict[str, Any]:
    bad = sorted(set(params) - set(allowed))
    if bad:
        raise ValueError(f"scheme {scheme!r} has no parameter(s) {bad}; allowed: {sorted(allowed)}")
    out = dict(allowed)
    out.update(params)
    missing = [k for k, v in out.items() if v is _REQUIRED]
    if missing:
        raise ValueError(f"scheme {scheme!r} needs parameter(s) {missing}")
    return out


def partition(labels: np.ndarray, num_devices: int, scheme: str, seed: int, **params: Any) -> Parts:
    """Split sample indices over ``num_devices``; returns one sorted index array per device.

    ``scheme``: ``iid``; ``dirichlet`` (``alpha``, ``min_size=1``, ``max_attempts=1000``); ``shards``
    (``shards_per_device``). Raises ``ValueError`` naming the offending parameter.
    """
    y = _check_labels(labels)
    k = _check_count("num_devices", num_devices, y.size)
    if scheme == "iid":
        _take(params, scheme, {})
        return _iid(y, k, seed)
    if scheme == "dirichlet":
        p = _take(params, scheme, {"alpha": _REQUIRED, "min_size": 1, "max_attempts": 1000})
        alpha = _check_alpha("alpha", p["alpha"])
        min_size = _check_count("min_size", p["min_size"])
        attempts = _check_count("max_attempts", p["max_attempts"])
        return _dirichlet(y, k, alpha, min_size, attempts, (seed, "partition", "dirichlet"))
    if scheme == "shards":
        p = _take(params, scheme, {"shards_per_device": _REQUIRED})
        return _shards(y, k, _check_count("shards_per_device", p["shards_per_device"]), seed)
    raise ValueError(
        f"unknown partition scheme {scheme!r}; expected one of {list(SCHEMES)} "
        f"(or 'hierarchical' via partition_hierarchy)"
    )


def hierarchical_partition(
    labels: np.ndarray,
    cells: int,
    devices_per_cell: int,
    seed: int,
    alpha_cells: float,
    alpha_devices: float,
    *,
    min_size: int = 1,
    max_attempts: int = 1000,
) -> list[Parts]:
    """Dirichlet(``alpha_cells``) across cells, then Dirichlet(``alpha_devices``) within each cell.

    Returns ``parts[cell][device]`` (global, sorted index arrays). Each device gets ``>= min_size`` samples.
    """
    y = _check_labels(labels)
    c = _check_count("cells", cells, y.size)
    d = _check_count("devices_per_cell", devices_per_cell)
    _check_count("cells x devices_per_cell", c * d, y.size)
    a_c = _check_alpha("alpha_cells", alpha_cells)
    a_d = _check_alpha("alpha_devices", alpha_devices)
    min_size = _check_count("min_size", min_size)
    attempts = _check_count("max_attempts", max_attempts)
    cell_parts = _dirichlet(
        y, c, a_c, min_size * d, attempts, (seed, "partition", "hierarchical", "cells"), "alpha_cells"
    )
    out = []
    for ci, idx in enumerate(cell_parts):
        local = _dirichlet(
            y[idx], d, a_d, min_size, attempts, (seed, "partition", "hierarchical", "cell", ci), "alpha_devices"
        )
        out.append(_finish([idx[p] for p in local]))
    return out


def cell_shards_partition(
    labels: np.ndarray, cells: int, devices_per_cell: int, seed: int, shards_per_device: int
) -> list[Parts]:
    """HIST's split (ii): an ``iid`` split into ``cells`` equal parts, then within each cell the ``shards``
    scheme over its devices (label-sorted shards, ``shards_per_device`` each). Returns ``parts[cell][device]``."""
    y = _check_labels(labels)
    c = _check_count("cells", cells, y.size)
    d = _check_count("devices_per_cell", devices_per_cell)
    k = _check_count("shards_per_device", shards_per_device)
    out = []
    for ci, idx in enumerate(_iid(y, c, seed, "cells")):
        local = _shards(y[idx], d, k, seed, "cell", ci)
        out.append(_finish([idx[p] for p in local]))
    return out


def partition_hierarchy(
    labels: np.ndarray, cells: int, devices_per_cell: int, scheme: str, seed: int, **params: Any
) -> list[Parts]:
    """``parts[cell][device]``: ``hierarchical`` (``alpha_cells``, ``alpha_devices``), ``cell_shards``
    (``shards_per_device``) or a flat scheme over ``cells * devices_per_cell`` devices grouped
    consecutively into cells."""
    c = _check_count("cells", cells)
    d = _check_count("devices_per_cell", devices_per_cell)
    if scheme == "hierarchical":
        return hierarchical_partition(labels, c, d, seed, **params)
    if scheme == "cell_shards":
        p = _take(params, scheme, {"shards_per_device": _REQUIRED})
        return cell_shards_partition(labels, c, d, seed, p["shards_per_device"])
    flat = partition(labels, c * d, scheme, seed, **params)
    return [flat[i * d : (i + 1) * d] for i in range(c)]  # views of one flat index array


def label_histogram(labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int | None = None) -> np.ndarray:
    """Counts ``[len(parts), num_classes]`` of each label in each part (int64)."""
    y = _check_labels(labels)
    k = int(num_classes) if num_classes is not None else (int(y.max()) + 1 if y.size else 0)
    return (
        np.stack([np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=k) for p in parts])
        if parts
        else np.zeros((0, k), dtype=np.int64)
    )
