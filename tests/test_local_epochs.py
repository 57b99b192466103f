"""``local_epochs = E`` means E full passes over a device's data, whatever its size: an epoch is
``ceil(n / batch)`` batches (the last one short), and a fractional E rounds up to the next batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from protocols.trainer import batches, num_steps


@pytest.mark.parametrize("n", [1, 17, 63, 64, 65, 100, 1000])
@pytest.mark.parametrize("epochs", [1, 3, 10])
def test_whole_epochs_visit_every_sample_exactly_epochs_times(n, epochs):
    steps = num_steps(n, 64, epochs=epochs)
    assert steps == epochs * math.ceil(n / 64)
    seen = np.bincount(np.concatenate(list(batches(n, 64, steps, np.random.default_rng(0)))), minlength=n)
    assert seen.tolist() == [epochs] * n  # e.g. n = 17 at E = 10 ran 3 epochs (3 steps) before the fix


@pytest.mark.parametrize("n", [17, 65, 100])
def test_fractional_epochs_round_up_to_the_next_batch(n):
    per_epoch = math.ceil(n / 64)
    steps = num_steps(n, 64, epochs=2.5)
    assert steps == math.ceil(2.5 * per_epoch)
    seen = np.bincount(np.concatenate(list(batches(n, 64, steps, np.random.default_rng(1)))), minlength=n)
    assert seen.min() >= 2 and seen.max() <= 3 and seen.sum() >= 2.5 * n


def test_local_steps_win_and_bad_sizes_are_refused():
    assert num_steps(17, 64, steps=5, epochs=10) == 5
    with pytest.raises(ValueError, match="positive"):
        num_steps(17, 64)
    with pytest.raises(ValueError, match="samples"):
        num_steps(0, 64, epochs=1)
