"""The synthetic task is deterministic and the batch splitting is exact and loud."""

import numpy as np
import pytest

from emulator.data import shard_batch, split_microbatches, synthetic_batch


def test_pure_function_of_seed_and_step():
    a, b = synthetic_batch(3, 7, 4, 9, 11), synthetic_batch(3, 7, 4, 9, 11)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], synthetic_batch(3, 8, 4, 9, 11)[0])
    assert not np.array_equal(a[0], synthetic_batch(4, 7, 4, 9, 11)[0])
    tokens, targets = a
    assert tokens.shape == targets.shape == (4, 9) and tokens.dtype == np.int64
    assert tokens.min() >= 0 and tokens.max() < 11


def test_targets_copy_the_token_lag_positions_back():
    tokens, targets = synthetic_batch(0, 0, 3, 6, 50, lag=2)
    for b in range(3):
        for s in range(6):
            assert targets[b, s] == tokens[b, max(s - 2, 0)]


def test_split_and_shard():
    t, y = np.arange(24).reshape(6, 4), -np.arange(24).reshape(6, 4)
    mbs = split_microbatches(t, y, 3)
    assert len(mbs) == 3 and np.array_equal(np.concatenate([m[0] for m in mbs]), t)
    assert np.array_equal(mbs[1][1], y[2:4])
    assert np.array_equal(shard_batch(t, y, 1, 2)[0], t[3:])
    with pytest.raises(ValueError, match="B=6 into 4"):
        split_microbatches(t, y, 4)
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_batch(t, y, 2, 2)
