"""``protocols.seeding``: every party regenerates the same draws from the same keys."""

from __future__ import annotations

import numpy as np

from protocols.seeding import _as_int, derive_seed, rng, seed_sequence


def test_a_seed_sequence_is_numpys_of_the_keys_list_bit_for_bit() -> None:
    """``seed_sequence`` hands numpy the keys' uint32 words (faster than its list of Python integers): the same
    sequence for every kind of key (0, None, strings, 32-, 33- and 63-bit integers, numpy integers, no keys)."""
    g = np.random.default_rng(0)
    pool = [0, 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**63 - 1, None, "c0", "c12-d3", "batches", np.int64(5)]
    for _ in range(300):
        keys = [pool[int(i)] for i in g.integers(0, len(pool), int(g.integers(0, 7)))]
        seed = int(g.choice([0, 1, 2**32 + 5, 2**62, int(g.integers(0, 2**63 - 1))]))
        numpys = np.random.SeedSequence([_as_int(seed), *(_as_int(k) for k in keys)])
        assert np.array_equal(
            seed_sequence(seed, *keys).generate_state(8, np.uint64), numpys.generate_state(8, np.uint64)
        )
        same = np.random.Generator(np.random.PCG64(numpys))
        assert np.array_equal(rng(seed, *keys).permutation(50), same.permutation(50))
    assert derive_seed(7, 1, "x") == int(
        np.random.SeedSequence([7, 1, _as_int("x")]).generate_state(1, np.uint64)[0]
    ) & ((1 << 63) - 1)
