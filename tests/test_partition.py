"""Partitioners: exact cover, skew, label limits, hierarchy, determinism, validation."""

from __future__ import annotations

import numpy as np
import pytest

from sim.partition import cell_shards_partition, hierarchical_partition, label_histogram, partition, partition_hierarchy


def _labels(n: int = 6000, classes: int = 10, seed: int = 0, balanced: bool = False) -> np.ndarray:
    if balanced:
        return np.random.default_rng(seed).permutation(np.arange(n) % classes)  # test fixture only
    return np.random.default_rng(seed).integers(0, classes, n)


def _assert_exact_cover(parts, n: int) -> None:
    allidx = np.concatenate(parts)
    assert allidx.size == n, "samples lost or duplicated"
    assert np.array_equal(np.sort(allidx), np.arange(n)), "overlap or missing samples"
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0), "each part sorted, no duplicates"


def _skew(hist: np.ndarray) -> float:
    """Mean total-variation distance between each part's label distribution and the global one."""
    glob = hist.sum(0) / hist.sum()
    dist = hist / hist.sum(1, keepdims=True)
    return float(0.5 * np.abs(dist - glob).sum(1).mean())


FLAT = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.1}),
    ("dirichlet", {"alpha": 10.0}),
    ("shards", {"shards_per_device": 2}),
    ("shards", {"shards_per_device": 3}),
]


@pytest.mark.parametrize("scheme,params", FLAT)
@pytest.mark.parametrize("n,devices", [(6000, 50), (1001, 7), (97, 13)])
def test_exact_cover(scheme, params, n, devices):
    y = _labels(n)
    parts = partition(y, devices, scheme, seed=3, **params)
    assert len(parts) == devices
    _assert_exact_cover(parts, n)
    assert min(p.size for p in parts) >= 1


@pytest.mark.parametrize("scheme,params", FLAT)
def test_determinism(scheme, params):
    y = _labels(3000)
    a = partition(y, 20, scheme, seed=1, **params)
    b = partition(y, 20, scheme, seed=1, **params)
    c = partition(y, 20, scheme, seed=2, **params)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert any(not np.array_equal(u, v) for u, v in zip(a, c))


def test_iid_sizes_and_balance():
    y = _labels(1003)
    parts = partition(y, 10, "iid", seed=0)
    assert [p.size for p in parts] == [101, 101, 101] + [100] * 7
    assert _skew(label_histogram(y, parts)) < 0.15


def test_dirichlet_skew_measured():
    y = _labels(20000)
    skews = {a: _skew(label_histogram(y, partition(y, 20, "dirichlet", seed=0, alpha=a))) for a in (0.05, 0.5, 100.0)}
    iid = _skew(label_histogram(y, partition(y, 20, "iid", seed=0)))
    assert skews[0.05] > 0.6  # nearly one or two classes per device
    assert skews[0.5] > 0.3
    assert skews[100.0] < 0.08 and iid < 0.08  # near-uniform like iid
    assert skews[0.05] > skews[0.5] > skews[100.0]
    # small alpha: most devices are dominated by few classes
    h = label_histogram(y, partition(y, 20, "dirichlet", seed=0, alpha=0.05))
    assert np.median(h.max(1) / h.sum(1)) > 0.5


def test_dirichlet_min_size_and_bounded_failure():
    y = _labels(2000)
    parts = partition(y, 20, "dirichlet", seed=0, alpha=0.1, min_size=30)
    _assert_exact_cover(parts, 2000)
    assert min(p.size for p in parts) >= 30
    with pytest.raises(ValueError, match="min_size"):
        partition(y, 20, "dirichlet", seed=0, alpha=0.01, min_size=99, max_attempts=5)
    with pytest.raises(ValueError, match="min_size"):
        partition(y, 20, "dirichlet", seed=0, alpha=1.0, min_size=101)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_shards_at_most_k_labels(k):
    for y in (_labels(6000), _labels(6000, balanced=True), np.sort(_labels(997, classes=7))):
        parts = partition(y, 30, "shards", seed=5, shards_per_device=k)
        _assert_exact_cover(parts, y.size)
        h = label_histogram(y, parts)
        assert (h > 0).sum(1).max() <= k
        sizes = np.array([p.size for p in parts])
        assert sizes.max() <= 1.5 * sizes.min()  # near-equal shards


def test_shards_fewer_than_classes_still_cover():
    y = _labels(500, classes=10)
    parts = partition(y, 2, "shards", seed=0, shards_per_device=2)  # 4 shards < 10 classes
    _assert_exact_cover(parts, 500)


def test_hierarchical_skew_across_and_within():
    y = _labels(20000)
    hp = hierarchical_partition(y, cells=4, devices_per_cell=10, seed=0, alpha_cells=0.1, alpha_devices=0.1)
    assert len(hp) == 4 and all(len(c) == 10 for c in hp)
    _assert_exact_cover([p for c in hp for p in c], 20000)
    cell_hist = np.stack([label_histogram(y, c).sum(0) for c in hp])
    assert _skew(cell_hist) > 0.4  # cells are skewed across
    for c in hp:  # devices skewed relative to their own cell
        assert _skew(label_histogram(y, c)) > 0.3
    mild = hierarchical_partition(y, 4, 10, seed=0, alpha_cells=100.0, alpha_devices=100.0)
    assert _skew(np.stack([label_histogram(y, c).sum(0) for c in mild])) < 0.08
    again = hierarchical_partition(y, 4, 10, seed=0, alpha_cells=0.1, alpha_devices=0.1)
    other = hierarchical_partition(y, 4, 10, seed=1, alpha_cells=0.1, alpha_devices=0.1)
    flat = lambda h: [p for c in h for p in c]  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(flat(hp), flat(again)))
    assert any(not np.array_equal(a, b) for a, b in zip(flat(hp), flat(other)))


def test_cell_shards_cells_iid_devices_non_iid():
    """HIST's split (ii): cells hold iid, equal parts; inside a cell every device has <= 2 labels."""
    y = _labels(12000, balanced=True)
    hp = partition_hierarchy(y, 4, 5, "cell_shards", seed=3, shards_per_device=2)
    assert len(hp) == 4 and all(len(c) == 5 for c in hp)
    _assert_exact_cover([p for c in hp for p in c], 12000)
    assert [sum(len(p) for p in c) for c in hp] == [3000] * 4  # equal cells
    assert _skew(np.stack([label_histogram(y, c, 10).sum(0) for c in hp])) < 0.05  # iid across cells
    for c in hp:
        assert all((h > 0).sum() <= 2 for h in label_histogram(y, c, 10))  # non-iid within a cell
    flat = partition_hierarchy(y, 4, 5, "shards", seed=3, shards_per_device=2)  # split (i) for contrast
    assert _skew(np.stack([label_histogram(y, c, 10).sum(0) for c in flat])) > 0.2
    again = cell_shards_partition(y, 4, 5, seed=3, shards_per_device=2)
    assert all(np.array_equal(a, b) for ca, cb in zip(hp, again) for a, b in zip(ca, cb))
    with pytest.raises(ValueError, match="shards_per_device"):
        partition_hierarchy(y, 4, 5, "cell_shards", seed=3)


def test_partition_hierarchy_groups_consecutive():
    y = _labels(3000)
    flat = partition(y, 12, "dirichlet", seed=4, alpha=0.5)
    hier = partition_hierarchy(y, 3, 4, "dirichlet", seed=4, alpha=0.5)
    assert [len(c) for c in hier] == [4, 4, 4]
    assert all(np.array_equal(a, b) for a, b in zip(flat, [p for c in hier for p in c]))
    h2 = partition_hierarchy(y, 3, 4, "hierarchical", seed=4, alpha_cells=0.5, alpha_devices=0.5)
    _assert_exact_cover([p for c in h2 for p in c], 3000)


def test_label_histogram():
    y = np.array([0, 1, 1, 2, 2, 2])
    h = label_histogram(y, [np.array([0, 1]), np.array([2, 3, 4, 5])], num_classes=4)
    assert h.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda y: partition(y, 101, "iid", 0), "num_devices"),
        (lambda y: partition(y, 0, "iid", 0), "num_devices"),
        (lambda y: partition(y, 5, "dirichlet", 0, alpha=0.0), "alpha"),
        (lambda y: partition(y, 5, "dirichlet", 0, alpha=-1), "alpha"),
        (lambda y: partition(y, 5, "dirichlet", 0), "alpha"),
        (lambda y: partition(y, 5, "dirichlet", 0, alpha=1, min_size=0), "min_size"),
        (lambda y: partition(y, 5, "shards", 0, shards_per_device=0), "shards_per_device"),
        (lambda y: partition(y, 50, "shards", 0, shards_per_device=3), "shards_per_device"),
        (lambda y: partition(y, 5, "shards", 0, shards_per_device=1.5), "shards_per_device"),
        (lambda y: partition(y, 5, "iid", 0, alpha=1), "alpha"),
        (lambda y: partition(y, 5, "bogus", 0), "scheme"),
        (lambda y: partition(y.reshape(10, 10), 5, "iid", 0), "labels"),
        (lambda y: hierarchical_partition(y, 5, 30, 0, 1.0, 1.0), "devices_per_cell"),
        (lambda y: hierarchical_partition(y, 2, 3, 0, 0.0, 1.0), "alpha_cells"),
        (lambda y: hierarchical_partition(y, 2, 3, 0, 1.0, -2), "alpha_devices"),
        (lambda y: partition_hierarchy(y, 0, 3, "iid", 0), "cells"),
    ],
)
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call(_labels(100))


@pytest.mark.parametrize("n, k", [(10, 3), (3_000_000, 7), (2_500_000, 1_000_000)])
def test_iid_parts_are_views_of_one_array_equal_to_sorted_array_splits(n, k):
    """The IID split is ``np.array_split`` of the seeded permutation with each part sorted, held as
    one flat index array (parts are views; a million parts cost two arrays). ``np.array_split``'s rule (the first
    ``n % k`` parts have ``n // k + 1`` items, the rest ``n // k``) gives the parts' bounds, checked against
    ``np.array_split`` itself where ``k`` is small: its million views cost ~5 s at load 10, the split itself 0.8."""
    from protocols.seeding import rng
    from sim.partition import Parts

    parts = partition(np.zeros(n, dtype=np.int64), k, "iid", seed=3)
    assert isinstance(parts, Parts) and len(parts) == k and parts.flat.size == n
    perm = rng(3, "partition", "iid").permutation(n)
    bounds = np.arange(k + 1) * (n // k) + np.minimum(np.arange(k + 1), n % k)
    picks = range(k) if k < 100 else (0, 1, k // 2, k - 1)
    if k < 100:
        assert all(np.array_equal(a, perm[bounds[i] : bounds[i + 1]]) for i, a in enumerate(np.array_split(perm, k)))
    expected = lambda i: np.sort(perm[bounds[i] : bounds[i + 1]])  # noqa: E731
    assert all(np.array_equal(parts[i], expected(i)) and parts[i].base is not None for i in picks)
    assert all(np.array_equal(a, b) for a, b in zip(parts[2:5], parts[2:5][0:3]))
