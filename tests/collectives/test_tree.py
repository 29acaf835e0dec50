"""Binomial-tree broadcast and reduce (any root) vs reference.py and cost.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives import broadcast, cost, reduce, reference
from collectives.ops import OPS

from .helpers import SETTINGS, assert_close, bytes_of, dtypes, inputs, lengths, run, world_sizes


@SETTINGS
@given(p=world_sizes, n=lengths, dtype=dtypes, root=st.integers(0, 15))
def test_broadcast_any_root(p, n, dtype, root):
    root %= p
    xs = inputs(p, (n, 2), dtype, seed=p + n)

    def fn(comm):
        return broadcast(comm, xs[comm.rank], root=root), bytes_of(comm, "broadcast")

    w = np.dtype(dtype).itemsize
    for r, (y, got) in enumerate(run(fn, p)):
        assert_close(y, xs[root], 1, f"broadcast root={root} p={p} rank {r}")
        assert not np.shares_memory(y, xs[r])
        assert got == cost.tree_broadcast(2 * n, p, w, r, root)


@SETTINGS
@given(p=world_sizes, n=lengths, dtype=dtypes, root=st.integers(0, 15))
def test_reduce_any_root_every_op(p, n, dtype, root):
    root %= p
    xs = inputs(p, (n,), dtype, seed=3 * p + n)
    for op in OPS:
        if op == "avg" and np.dtype(dtype).kind == "i":
            continue

        def fn(comm, op=op):
            return reduce(comm, xs[comm.rank], root=root, op=op), bytes_of(comm, "reduce")

        want = reference.reduce(xs, root, op)
        for r, (y, got) in enumerate(run(fn, p)):
            if r == root:
                assert_close(y, want[r], p, f"reduce {op} root={root} p={p}")
            else:
                assert y is None
            assert got == cost.tree_reduce(n, p, np.dtype(dtype).itemsize, r, root)


def test_tree_children_cover_every_rank_once():
    for p in range(1, 40):
        seen = [c for v in range(p) for c in cost.tree_children(v, p)]
        assert sorted(seen) == list(range(1, p)), p
        assert all(cost.tree_parent(c) == v for v in range(p) for c in cost.tree_children(v, p))


@SETTINGS
@given(p=world_sizes, n=st.sampled_from([0, 1, 7, 40_000]), root=st.integers(0, 15),
       own=st.booleans())  # fmt: skip
def test_broadcast_into_out_is_broadcast(p, n, root, own):
    # out= (DDP's initial broadcast into the replica's buffer): every rank's out holds root's x
    # and is what returns; the root's x may be its out (no copy); the same records as without
    # out; 40,000 (2, ) float64 rows travel in two chunks (cost.TREE_CHUNK)
    root %= p
    xs = inputs(p, (n, 2), np.float64, seed=p + n)

    def fn(comm):
        plain = broadcast(comm, xs[comm.rank], root=root)
        x = xs[comm.rank].copy()
        out = x if own and comm.rank == root else np.full_like(x, np.nan)
        mark = comm.ledger.mark()
        got = broadcast(comm, x, root=root, out=out)
        recs = [dataclasses.astuple(r)[:-1] for r in comm.ledger.since(mark)]  # all but seq
        return plain, got, out, x, recs, comm.ledger.records[: len(recs)]

    for r, (plain, got, out, x, recs, first) in enumerate(run(fn, p)):
        assert got is out and got.tobytes() == plain.tobytes() == xs[root].tobytes(), r
        assert x.tobytes() == (xs[root] if own and r == root else xs[r]).tobytes()
        assert recs == [dataclasses.astuple(f)[:-1] for f in first]  # the same, in order


def test_broadcast_out_must_be_x_shape_dtype_and_contiguous():
    for bad in (np.zeros(5), np.zeros((4, 2), np.float32), np.zeros((2, 4)).T, [0.0] * 8):
        with pytest.raises(ValueError, match="out must be a C-contiguous ndarray of x's shape"):
            run(lambda c, bad=bad: broadcast(c, np.ones((4, 2)), out=bad), 2)
