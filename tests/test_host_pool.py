"""A node's host passes in threads (protocols.host_pool): the weighted mean cut into slices computed side by
side gives the same bits as one thread's, whatever the cut, the weights' types or the values' magnitudes."""

from collections import OrderedDict

import numpy as np
import pytest

from protocols import host_pool
from protocols import params as P


def _serial(items):
    """The weighted mean's definition, one tensor after another (float64 products summed in order)."""
    total = float(sum(w for w, _ in items))
    acc: OrderedDict = OrderedDict()
    for w, p in items:
        for k, v in p.items():
            term = v.astype(np.float64) * w
            if k in acc:
                acc[k] += term
            else:
                acc[k] = term
    return OrderedDict((k, (v / total).astype(np.float32)) for k, v in acc.items()), total


@pytest.fixture
def threads():
    before = host_pool.threads()
    yield host_pool.set_threads
    host_pool.set_threads(before)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 8])
def test_a_weighted_mean_in_slices_is_bit_identical_to_one_threads(threads, n_threads, monkeypatch):
    threads(n_threads)
    monkeypatch.setattr(host_pool, "MIN_WORK", 1)  # this small test's passes cut into slices too
    rng = np.random.default_rng(n_threads)
    shapes = {"w1": (784, 61), "b1": (61,), "w2": (3, 5, 4099), "one": ()}
    items = []
    for i in range(23):
        # weights of every type a role passes (sample counts, float32 from a report, Python floats); values
        # of wildly different magnitudes so that any change of the summation order shows in the last bits
        w = [int(rng.integers(1, 10**6)), np.float32(rng.random() * 50), float(rng.random())][i % 3]
        items.append(
            (
                w,
                {
                    k: (rng.standard_normal(s) * 10.0 ** rng.integers(-8, 9, s)).astype(np.float32)
                    for k, s in shapes.items()
                },
            )
        )
    want, total = _serial(items)
    got, got_total = P.weighted_mean(items)
    assert got_total == total and list(got) == list(want)
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape
        assert got[k].tobytes() == want[k].tobytes(), k
    sliced = host_pool.bounds(784 * 61, 784 * 61 * len(items))
    assert len(sliced) == min(n_threads, 784 * 61 // host_pool.MIN_SLICE)


def test_a_slice_that_fails_fails_the_whole_pass(threads):
    threads(4)
    seen = []

    def work(lo, hi):
        seen.append((lo, hi))
        if lo > 0:
            raise RuntimeError("slice failed")

    with pytest.raises(RuntimeError, match="slice failed"):
        host_pool.run_sliced(4 * host_pool.MIN_SLICE, work, host_pool.MIN_WORK)
    assert sorted(seen) == host_pool.bounds(4 * host_pool.MIN_SLICE, host_pool.MIN_WORK) and len(seen) == 4


def test_a_small_pass_stays_in_the_calling_thread(threads):
    threads(8)
    assert host_pool.bounds(1 << 20, host_pool.MIN_WORK - 1) == [(0, 1 << 20)]
    assert len(host_pool.bounds(1 << 20, host_pool.MIN_WORK)) == 8


def test_threads_must_be_at_least_one():
    with pytest.raises(ValueError, match=">= 1"):
        host_pool.set_threads(0)
