"""Error paths: each asserts on the text a user would read."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    reduce,
    reduce_scatter,
    scatter,
)

from .helpers import run


def _mismatch(fn, p=3, match=""):
    with pytest.raises(emulator.CollectiveMismatch, match=match):
        run(fn, p)


def test_different_op_across_ranks():
    x = np.ones(4)
    _mismatch(lambda c: all_reduce(c, x, op="max" if c.rank == 1 else "sum"), match="op=max")


def test_different_algorithm_across_ranks():
    x = np.ones(4)
    _mismatch(lambda c: all_reduce(c, x, algorithm="tree" if c.rank else "ring"), match="tree")


def test_different_shape_or_dtype_across_ranks():
    _mismatch(lambda c: all_reduce(c, np.ones(4 + c.rank), algorithm="ring"), match=r"float64\[5\]")
    _mismatch(
        lambda c: reduce_scatter(c, np.ones(4, np.float32 if c.rank else np.float64)),
        match="float32",
    )


def test_different_collective_across_ranks():
    x = np.ones(6)
    _mismatch(lambda c: all_gather(c, x) if c.rank else reduce_scatter(c, x), match="all_gather")


def test_one_rank_skipping_a_call_is_reported_not_hung():
    def fn(comm):
        if comm.rank != 2:
            all_reduce(comm, np.ones(8), algorithm="ring")

    with pytest.raises((emulator.CommTimeout, emulator.CollectiveMismatch)) as info:
        emulator.spawn(fn, 3, timeout=1)
    assert "flight recorder" in str(info.value) or "mismatch" in str(info.value)
    assert "all_reduce" in str(info.value)


def test_unsupported_op_and_dtype():
    with pytest.raises(ValueError, match="unknown op 'prod'"):
        run(lambda c: all_reduce(c, np.ones(3), op="prod"), 2)
    with pytest.raises(TypeError, match="op='avg' on integer dtype int64 would truncate"):
        run(lambda c: all_reduce(c, np.ones(3, np.int64), op="avg"), 2)
    with pytest.raises(TypeError, match="dtype <U1 is not supported"):
        run(lambda c: all_reduce(c, np.array(["a"])), 2)
    with pytest.raises(TypeError, match="undefined for complex"):
        run(lambda c: all_reduce(c, np.ones(2, np.complex64), op="max"), 2)
    with pytest.raises(ValueError, match="unknown algorithm 'butterfly'"):
        run(lambda c: all_reduce(c, np.ones(3), algorithm="butterfly"), 2)


def test_bad_root():
    with pytest.raises(ValueError, match="root 3 is not a rank of group 'world' of size 3"):
        run(lambda c: broadcast(c, np.ones(2), root=3), 3)
    with pytest.raises(ValueError, match="root -1 is not a rank"):
        run(lambda c: reduce(c, np.ones(2), root=-1), 3)
    with pytest.raises(ValueError, match="non-root ranks must pass shape= and dtype="):
        run(lambda c: scatter(c, [np.ones(1)] * 2 if c.rank == 0 else None), 2)


def test_shape_errors_are_explained():
    with pytest.raises(ValueError, match="not divisible by the group size 3"):
        run(lambda c: all_to_all(c, np.ones(4)), 3)
    with pytest.raises(ValueError, match=r"sizes\[1\] = 5"):
        run(lambda c: all_gather(c, np.ones(2), sizes=[2, 5]), 2)
    with pytest.raises(ValueError, match="0-d array"):
        run(lambda c: reduce_scatter(c, np.float64(1.0)), 2)


def test_non_contiguous_input_is_handled():
    base = [np.arange(24.0).reshape(4, 6) * (r + 1) for r in range(3)]

    def fn(comm):
        x = base[comm.rank][:, ::2]  # (4, 3), not contiguous
        return (
            all_reduce(comm, x, algorithm="ring"),
            reduce_scatter(comm, x.T),
            all_gather(comm, x.T),
        )

    total = sum(b[:, ::2] for b in base)  # (4, 3)
    for r, (y, rs, ag) in enumerate(run(fn, 3)):
        assert np.array_equal(y, total)
        # rank r keeps row r of the (3, 4) sum of the transposes (np.array_split over 3 ranks)
        assert np.array_equal(rs, np.array_split(total.T, 3)[r])
        assert np.array_equal(ag, np.concatenate([b[:, ::2].T for b in base]))  # (9, 4)
    assert all(
        np.array_equal(b, np.arange(24.0).reshape(4, 6) * (r + 1)) for r, b in enumerate(base)
    )
