"""Pairwise all-to-all(v), linear gather / scatter and the counted barrier."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from collectives import all_to_all, all_to_allv, barrier, cost, gather, reference, scatter

from .helpers import SETTINGS, assert_close, bytes_of, dtypes, inputs, run, world_sizes


@SETTINGS
@given(p=world_sizes, k=st.integers(0, 4), dtype=dtypes)
def test_all_to_all(p, k, dtype):
    xs = inputs(p, (p * k, 3), dtype, seed=k)

    def fn(comm):
        return all_to_all(comm, xs[comm.rank]), bytes_of(comm, "all_to_all")

    want = reference.all_to_all(xs)
    for r, (y, got) in enumerate(run(fn, p)):
        assert_close(y, want[r], 1, f"all_to_all p={p} k={k} rank {r}")
        assert got == cost.pairwise_all_to_all(p * k * 3, p, np.dtype(dtype).itemsize, r)


@SETTINGS
@given(p=world_sizes, seed=st.integers(0, 10**6), dtype=dtypes, given_counts=st.booleans())
def test_all_to_allv_uneven(p, seed, dtype, given_counts):
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 4, size=(p, p))  # rows[src][dst]
    sends = [
        [inputs(1, (int(rows[s, d]), 2), dtype, seed=s * p + d)[0] for d in range(p)]
        for s in range(p)
    ]

    def fn(comm):
        counts = [int(rows[s, comm.rank]) for s in range(p)] if given_counts else None
        return all_to_allv(comm, sends[comm.rank], recv_counts=counts), bytes_of(
            comm, "all_to_allv"
        )

    want = reference.all_to_allv(sends)
    w = np.dtype(dtype).itemsize
    for r, (ys, got) in enumerate(run(fn, p)):
        for s in range(p):
            assert_close(ys[s], want[r][s], 1, f"all_to_allv p={p} from {s} to {r}")
        sc, rc = (rows[r] * 2).tolist(), (rows[:, r] * 2).tolist()
        assert got == cost.pairwise_all_to_allv(sc, rc, w, r, exchange=not given_counts)


@SETTINGS
@given(
    p=world_sizes,
    sizes=st.lists(st.integers(0, 5), min_size=16, max_size=16),
    root=st.integers(0, 15),
    dtype=dtypes,
)
def test_gather_uneven_and_scatter(p, sizes, root, dtype):
    sizes, root = sizes[:p], root % p
    xs = [x[: sizes[r]] for r, x in enumerate(inputs(p, (5, 2), dtype, seed=p))]
    chunks = inputs(p, (3,), dtype, seed=p + 1)

    def fn(comm):
        g = gather(comm, xs[comm.rank], root=root, sizes=sizes)
        mine = chunks if comm.rank == root else None
        s = scatter(comm, mine, root=root, shape=(3,), dtype=dtype)
        return g, s, bytes_of(comm, "gather"), bytes_of(comm, "scatter")

    w = np.dtype(dtype).itemsize
    for r, (g, s, gb, sb) in enumerate(run(fn, p)):
        if r == root:
            assert_close(g, reference.gather(xs, root)[root], 1, "gather")
        else:
            assert g is None
        assert_close(s, chunks[r], 1, f"scatter rank {r}")
        assert gb == cost.linear_gather([n * 2 for n in sizes], w, r, root)
        assert sb == cost.linear_scatter(3, p, w, r, root)


def test_barrier_is_counted():
    for p in (1, 2, 5, 16):
        got = run(lambda comm: (barrier(comm), bytes_of(comm, "barrier"))[1], p)
        assert all(g == cost.dissemination_barrier(p) for g in got), (p, got)


def test_256_virtual_ranks_all_reduce_small_buffer():
    from collectives import all_reduce

    ys = run(lambda comm: all_reduce(comm, np.full(4, comm.rank, np.int64)), 256)
    assert all(np.array_equal(y, np.full(4, 255 * 256 // 2)) for y in ys)
