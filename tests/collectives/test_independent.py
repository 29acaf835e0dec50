"""Expectations that do not come from the code under test: the chunking rule against
np.array_split itself, the `auto` policy pinned by sizes on both sides of its closed-form
threshold (reaching the ring branch, which the drawn sizes of test_ring.py never do), and
op="avg" on a sub-group dividing by the group's size."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives import all_reduce, cost, reduce_scatter

from .helpers import run


@given(n=st.integers(0, 200), p=st.integers(1, 17))
def test_chunk_counts_are_np_array_split(n, p):
    want = [len(c) for c in np.array_split(np.arange(n), p)]
    assert cost.chunk_counts(n, p) == want
    assert cost.offsets(want)[1:] == list(np.cumsum(want))


def test_reduce_scatter_keeps_np_array_split_of_the_sum():
    xs = [np.arange(11.0) * (r + 1) for r in range(4)]  # 11 rows over 4 ranks: 3, 3, 3, 2
    out = run(lambda c: reduce_scatter(c, xs[c.rank]), 4)
    want = np.array_split(np.arange(11.0) * 10, 4)  # (1 + 2 + 3 + 4) x
    assert [len(y) for y in out] == [3, 3, 3, 2]
    assert all(np.array_equal(y, w) for y, w in zip(out, want))


def threshold(p: int, alpha: float = 5e-6, bandwidth: float = 25e9) -> float:
    """Closed form, solved by hand from T_tree = 2L(alpha + S/B) < T_ring = 2(p-1) alpha +
    2 (p-1)/p S/B (L = ceil(log2 p)): S < (p-1-L) alpha B / (L - (p-1)/p)."""
    L = math.ceil(math.log2(p))
    return (p - 1 - L) * alpha * bandwidth / (L - (p - 1) / p)


def test_threshold_numbers_are_the_documented_ones():
    assert threshold(4) == pytest.approx(100_000)  # README: about 100 KB at p = 4
    assert threshold(8) == pytest.approx(4 * 125_000 / 2.125)  # 235 KB
    assert threshold(16) == pytest.approx(11 * 125_000 / (4 - 15 / 16))  # 449 KB
    assert threshold(2) == threshold(3) == 0.0  # p <= 3: never the tree


@pytest.mark.parametrize("p", [2, 4, 8])
def test_auto_picks_tree_below_and_ring_above_the_threshold(p):
    """float64 sizes one element either side of S* (at least 1 element): the ledger's bytes
    are the tree's formula below and the ring's above, and the recorded algorithm says so."""
    star = threshold(p)
    below, above = max(1, math.floor(star / 8) - 1), math.floor(star / 8) + 1
    for n, algo in ((below, "tree" if star > 8 else "ring"), (above, "ring")):
        x = np.ones(n)

        def fn(comm, x=x):
            y = all_reduce(comm, x, algorithm="auto")
            recs = [r for r in comm.ledger.records if r.op == "all_reduce"]
            return y, {r.algorithm for r in recs}, comm.ledger.sent(), comm.ledger.received()

        formula = cost.tree_all_reduce if algo == "tree" else cost.ring_all_reduce
        for r, (y, algos, sent, recv) in enumerate(run(fn, p)):
            assert np.array_equal(y, np.full(n, float(p)))
            assert algos == {algo}, (p, n, algos)
            assert (sent, recv) == formula(n, p, 8, r)


def test_avg_on_a_sub_group_divides_by_the_group_size():
    """World of 5; group [4, 1, 3] (3 members): avg = (5 + 2 + 4) / 3 for x = rank + 1, not
    / 5. Ring, tree and double tree; 7 elements so the ring's chunks are uneven."""

    def fn(comm):
        if comm.rank not in (4, 1, 3):
            return None
        g = comm.group([4, 1, 3])
        x = np.full(7, comm.rank + 1.0)
        return [all_reduce(g, x, op="avg", algorithm=a) for a in ("ring", "tree", "double_tree")]

    for r, out in enumerate(run(fn, 5)):
        if r in (4, 1, 3):
            for y in out:
                np.testing.assert_allclose(y, np.full(7, 11.0 / 3), rtol=1e-15)
