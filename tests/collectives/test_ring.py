"""Ring (and tree) all-reduce, ring reduce-scatter and all-gather vs reference.py and cost.py."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from collectives import all_gather, all_reduce, cost, reduce_scatter, reference
from collectives.ops import OPS

from .helpers import SETTINGS, assert_close, bytes_of, dtypes, inputs, lengths, run, world_sizes


def _ops(dtype):
    return [o for o in OPS if not (o == "avg" and np.dtype(dtype).kind in "iu")]


@SETTINGS
@given(p=world_sizes, n=lengths, dtype=dtypes, algo=st.sampled_from(["ring", "tree", "auto"]))
def test_all_reduce_matches_reference_and_bytes(p, n, dtype, algo):
    xs = inputs(p, (n,), dtype, seed=n * 31 + p)
    for op in _ops(dtype):

        def fn(comm, op=op):
            mark = comm.ledger.mark()
            y = all_reduce(comm, xs[comm.rank], op=op, algorithm=algo)
            rec = comm.ledger.since(mark)
            return y, comm.ledger.sent(rec, op="all_reduce"), comm.ledger.received(rec)

        want = reference.reduce_all(xs, op)
        itemsize = np.dtype(dtype).itemsize
        for r, (y, sent, recv) in enumerate(run(fn, p)):
            assert_close(y, want, p, f"all_reduce {op} {algo} p={p} n={n} rank {r}")
            expect = cost.all_reduce(n, p, itemsize, r, algo)
            assert (sent, recv) == expect, f"rank {r}: ledger {(sent, recv)} != cost {expect}"
    assert all(np.array_equal(x, b) for x, b in zip(xs, inputs(p, (n,), dtype, seed=n * 31 + p)))


@SETTINGS
@given(p=world_sizes, rows=lengths, cols=st.integers(1, 3), dtype=dtypes)
def test_reduce_scatter_uneven_rows(p, rows, cols, dtype):
    xs = inputs(p, (rows, cols), dtype, seed=rows + 7 * p)
    before = [x.copy() for x in xs]
    for op in _ops(dtype):

        def fn(comm, op=op):
            y = reduce_scatter(comm, xs[comm.rank], op=op)
            return y, bytes_of(comm, "reduce_scatter")

        want = reference.reduce_scatter(xs, op)
        counts = [c * cols for c in cost.chunk_counts(rows, p)]
        for r, (y, got) in enumerate(run(fn, p)):
            assert_close(y, want[r], p, f"reduce_scatter {op} p={p} rows={rows} rank {r}")
            assert got == cost.ring_reduce_scatter(counts, np.dtype(dtype).itemsize, r)
    for x, b in zip(xs, before):
        assert np.array_equal(x, b), "reduce_scatter modified its input"


@SETTINGS
@given(p=world_sizes, sizes=st.lists(st.integers(0, 6), min_size=16, max_size=16), dtype=dtypes)
def test_all_gather_even_and_uneven(p, sizes, dtype):
    sizes = sizes[:p]
    xs = [x for x in inputs(p, (max(sizes), 2), dtype)]
    xs = [x[: sizes[r]] for r, x in enumerate(xs)]

    def fn(comm):
        y = all_gather(comm, xs[comm.rank], sizes=sizes)
        return y, bytes_of(comm, "all_gather")

    want = reference.all_gather(xs)[0]
    for r, (y, got) in enumerate(run(fn, p)):
        assert_close(y, want, 1, f"all_gather p={p} sizes={sizes} rank {r}")
        counts = [s * 2 for s in sizes]
        assert got == cost.ring_all_gather(counts, np.dtype(dtype).itemsize, r)


def test_world_size_one_returns_a_copy_and_sends_nothing():
    x = np.arange(5.0)

    def fn(comm):
        outs = [all_reduce(comm, x, algorithm=a) for a in ("ring", "tree")]
        outs += [reduce_scatter(comm, x), all_gather(comm, x)]
        return outs, comm.ledger.sent()

    outs, sent = run(fn, 1)[0]
    assert sent == 0
    for y in outs:
        assert np.array_equal(y, x) and not np.shares_memory(y, x)


def test_ring_sum_order_is_fixed_and_differs_from_np_sum():
    """float32: the ring adds chunk c as ((x[c+1] + x[c+2]) + ...) + x[c]; NumPy adds x[0] +
    x[1] + ... - the last bits differ, and the ring's own order reproduces it bitwise."""
    p, n = 8, 64
    rng = np.random.default_rng(3)
    xs = [
        (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
        for _ in range(p)
    ]
    ys = run(lambda comm: all_reduce(comm, xs[comm.rank], algorithm="ring"), p)
    off = cost.offsets(cost.chunk_counts(n, p))
    mine = np.empty(n, np.float32)
    for c in range(p):
        sl = slice(off[c], off[c + 1])
        acc = xs[(c + 1) % p][sl].copy()
        for k in range(2, p + 1):
            acc = acc + xs[(c + k) % p][sl]  # float32 + float32, one rounding per hop
        mine[sl] = acc
    assert all(np.array_equal(y, mine) for y in ys), "ring result is not its documented order"
    npsum = np.sum(np.stack(xs), axis=0)
    assert not np.array_equal(ys[0], npsum), "expected last-bit differences from np.sum"
    assert np.allclose(ys[0], npsum, rtol=1e-5, atol=1e-3)
    again = run(lambda comm: all_reduce(comm, xs[comm.rank], algorithm="ring"), p)
    assert all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(ys, again))


def test_ring_volume_is_2_p_minus_1_over_p_when_p_divides_n():
    for p in (2, 4, 8):
        n, w = 64, 4
        for r in range(p):
            assert cost.ring_all_reduce(n, p, w, r) == (2 * (p - 1) * n * w // p,) * 2


def test_bfloat16_sum_accumulates_per_hop_in_float32():
    bf = ml_dtypes.bfloat16
    xs = [np.full(6, 1 + r / 8, bf) for r in range(4)]
    ys = run(lambda comm: all_reduce(comm, xs[comm.rank], op="avg", algorithm="ring"), 4)
    assert ys[0].dtype == bf
    assert_close(ys[0], reference.reduce_all(xs, "avg"), 4, "bf16 avg")
