"""Binomial-tree broadcast and reduce (any root) vs reference.py and cost.py."""

from __future__ import annotations

import numpy as np
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
