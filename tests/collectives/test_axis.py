"""reduce_scatter / all_gather with axis= against NumPy's definitions (np.array_split,
np.concatenate, np.sum / reference.reduce_all), the axis-0 call on the moved-axis array
(bitwise: the same ring order), and an independent count of each rank's bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import emulator
from collectives import all_gather, cost, reduce_scatter, reference

from .helpers import SETTINGS, assert_close, inputs, run

AXES = (0, 1, 2, -1)
dims = st.integers(0, 4)


def _split_counts(n: int, p: int) -> list[int]:
    return [len(a) for a in np.array_split(np.arange(n), p)]  # NumPy's rule, not cost.py's


def _ring_bytes(counts, k: int, w: int, r: int, gather: bool) -> tuple[int, int]:
    """Rank r's ring bytes counted from the algorithm: a reduce-scatter sends every chunk but
    its own and receives every chunk but r-1's; an all-gather sends all but r+1's and receives
    all but its own (k elements per row, w bytes per element)."""
    p, n = len(counts), sum(counts)
    if p == 1:
        return 0, 0
    if gather:
        return (n - counts[(r + 1) % p]) * k * w, (n - counts[r]) * k * w
    return (n - counts[r]) * k * w, (n - counts[(r - 1) % p]) * k * w


def _with_and_without_axis(fn_axis, fn_zero):
    """Run fn_axis then fn_zero on one rank; each: (result, its records without seq)."""

    def body(comm):
        out = []
        for f in (fn_axis, fn_zero):
            mark = comm.ledger.mark()
            y = f(comm)
            recs = [(x.op, x.peer, x.direction, x.nbytes) for x in comm.ledger.since(mark)]
            out.append((y, recs))
        return out

    return body


@SETTINGS
@given(p=st.integers(1, 5), a=dims, n=st.integers(0, 9), b=dims, axis=st.sampled_from(AXES),
       dtype=st.sampled_from([np.float64, np.float32, np.int64]), op=st.sampled_from(["sum", "max"]))  # fmt: skip
def test_reduce_scatter_along_axis(p, a, n, b, axis, dtype, op):
    shape = [a, b]
    shape.insert(axis % 3, n)  # n: the cut axis's length (uneven over p)
    xs = inputs(p, tuple(shape), dtype, seed=7 * p + n)
    before = [x.copy() for x in xs]
    ax = axis % 3

    body = _with_and_without_axis(
        lambda c: reduce_scatter(c, xs[c.rank], op=op, axis=axis),
        lambda c: reduce_scatter(c, np.moveaxis(xs[c.rank], ax, 0), op=op),
    )
    want = np.array_split(reference.reduce_all(xs, op), p, axis=ax)
    counts = _split_counts(n, p)
    k, w = a * b, np.dtype(dtype).itemsize  # k: elements per index of the cut axis
    for r, ((y, recs), (y0, recs0)) in enumerate(run(body, p)):
        what = f"reduce_scatter {op} axis={axis} p={p} shape={shape} rank {r}"
        assert_close(y, want[r], p, what)
        assert y.flags.c_contiguous, what
        assert np.moveaxis(y0, 0, ax).tobytes() == y.tobytes(), f"{what}: != the axis-0 call"
        assert recs == recs0, f"{what}: messages differ from the axis-0 call"
        sent = sum(x[3] for x in recs if x[2] == "send")
        recv = sum(x[3] for x in recs if x[2] == "recv")
        assert (sent, recv) == _ring_bytes(counts, k, w, r, False), what
        assert (sent, recv) == cost.ring_reduce_scatter([c * k for c in counts], w, r), what
    assert all(np.array_equal(x, y) for x, y in zip(xs, before)), "an input was written"


@SETTINGS
@given(p=st.integers(1, 5), a=dims, b=dims, axis=st.sampled_from(AXES), seed=st.integers(0, 99),
       dtype=st.sampled_from([np.float64, np.float32, np.int64, ml_dtypes.bfloat16]))  # fmt: skip
def test_all_gather_along_axis_uneven_sizes(p, a, b, axis, seed, dtype):
    ax = axis % 3
    sizes = [int(s) for s in np.random.default_rng(seed).integers(0, 4, p)]
    xs = []
    for r in range(p):
        shape = [a, b]
        shape.insert(ax, sizes[r])
        xs.append(inputs(1, tuple(shape), dtype, seed=seed + r)[0])

    body = _with_and_without_axis(
        lambda c: all_gather(c, xs[c.rank], sizes=sizes, axis=axis),
        lambda c: all_gather(c, np.moveaxis(xs[c.rank], ax, 0), sizes=sizes),
    )
    want = np.concatenate(xs, axis=ax)
    k, w = a * b, np.dtype(dtype).itemsize
    for r, ((y, recs), (y0, recs0)) in enumerate(run(body, p)):
        what = f"all_gather axis={axis} p={p} sizes={sizes} rank {r}"
        assert y.dtype == want.dtype and y.tobytes() == want.tobytes(), what  # exact: copies
        assert y.shape == want.shape and y.flags.c_contiguous, what
        assert recs == recs0, f"{what}: messages differ from the axis-0 call"
        sent = sum(x[3] for x in recs if x[2] == "send")
        recv = sum(x[3] for x in recs if x[2] == "recv")
        assert (sent, recv) == _ring_bytes(sizes, k, w, r, True), what
        assert (sent, recv) == cost.ring_all_gather([s * k for s in sizes], w, r), what


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("axis", AXES)
def test_round_trip_of_a_strided_input(p, axis):
    """A non-contiguous input (a transposed view): reduce-scatter then all-gather (sizes= when
    the split is uneven) gives np.sum back, exactly for ints."""
    xs = [x.transpose(1, 0, 2) for x in inputs(p, (3, 2 * p, 5), np.int64, seed=p)]  # (2p, 3, 5)
    ax = axis % 3
    sizes = _split_counts(xs[0].shape[ax], p)

    def body(c):
        y = reduce_scatter(c, xs[c.rank], axis=axis)
        even = len(set(sizes)) == 1
        return y, all_gather(c, y, axis=axis, sizes=None if even else sizes)

    total = np.sum(np.stack(xs), axis=0)
    for r, (y, g) in enumerate(run(body, p)):
        assert np.array_equal(y, np.array_split(total, p, axis=ax)[r]), f"axis={axis} rank {r}"
        assert np.array_equal(g, total) and g.flags.c_contiguous, f"axis={axis} rank {r}"


def test_axis_zero_records_and_texts_are_unchanged():
    x = np.ones((4, 3))

    def body(c):
        reduce_scatter(c, x)
        reduce_scatter(c, x, axis=0)
        all_gather(c, x)
        all_gather(c, x, axis=-2)  # -2 is axis 0 of a 2-d array: the same call
        reduce_scatter(c, x, axis=-1)
        all_gather(c, x, axis=1, sizes=[3, 3])
        return [(k.op, k.shape, k.extra) for k in c.state.calls]

    calls = run(body, 2)[0]
    assert (
        calls[:4] == [("reduce_scatter", (4, 3), "op=sum")] * 2 + [("all_gather", (4, 3), "")] * 2
    )
    assert calls[4] == ("reduce_scatter", (4, 3), "op=sum, axis=1")  # normalised like NumPy
    assert calls[5] == ("all_gather", (), "float64, row=(4,), sizes=[3, 3], axis=1")


def test_axis_out_of_range_and_not_an_integer():
    x = np.ones((4, 3))
    for f, name in ((reduce_scatter, "reduce_scatter"), (all_gather, "all_gather")):
        for bad in (2, -3):
            with pytest.raises(ValueError, match=rf"{name}: axis {bad} is out of range for an "
                               r"array with ndim 2; use -2\.\.1"):  # fmt: skip
                run(lambda c, f=f, bad=bad: f(c, x, axis=bad), 2)
        with pytest.raises(ValueError, match=f"{name}: axis must be an integer; got 'x'"):
            run(lambda c, f=f: f(c, x, axis="x"), 2)
        with pytest.raises(ValueError, match=f"{name}: axis 1 is out of range .* ndim 0"):
            run(lambda c, f=f: f(c, np.float64(1.0), axis=1), 2)


def test_ranks_calling_with_different_axes_are_reported():
    x = np.ones((4, 4))
    for f in (reduce_scatter, all_gather):
        with pytest.raises(emulator.CollectiveMismatch, match="axis=1"):
            run(lambda c, f=f: f(c, x, axis=c.rank % 2), 3)
        with pytest.raises(emulator.CollectiveMismatch, match="axis=1"):
            run(lambda c, f=f: f(c, x, axis=-1 if c.rank else 0), 2)  # -1: normalised to 1
