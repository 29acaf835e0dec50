"""Double binary tree all-reduce vs reference.py and cost.py; the trees and the schedule."""

from __future__ import annotations

from collections import deque

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives import all_reduce, cost, double_tree, reference
from collectives.ops import OPS

from .helpers import SETTINGS, assert_close, dtypes, inputs, lengths, run, world_sizes


def _ops(dtype):
    return [o for o in OPS if not (o == "avg" and np.dtype(dtype).kind in "iu")]


def _children(r, p, t):
    return [c for c in cost.double_tree_links(r, p, t)[1:] if c is not None]


def _root(p, t):
    return next(r for r in range(p) if cost.double_tree_links(r, p, t)[0] is None)


def _in_order(v, p, t):
    _, left, right = cost.double_tree_links(v, p, t)
    before = [] if left is None else _in_order(left, p, t)
    return before + [v] + ([] if right is None else _in_order(right, p, t))


@SETTINGS
@given(p=world_sizes, n=lengths, cols=st.integers(1, 3), dtype=dtypes)
def test_all_reduce_matches_reference_and_bytes(p, n, cols, dtype):
    xs = inputs(p, (n, cols), dtype, seed=n * 17 + p)
    before = [x.copy() for x in xs]
    itemsize = np.dtype(dtype).itemsize
    for op in _ops(dtype):

        def fn(comm, op=op):
            mark = comm.ledger.mark()
            y = all_reduce(comm, xs[comm.rank], op=op, algorithm="double_tree")
            rec = comm.ledger.since(mark)
            return y, comm.ledger.sent(rec, op="all_reduce"), comm.ledger.received(rec)

        want = reference.reduce_all(xs, op)
        for r, (y, sent, recv) in enumerate(run(fn, p)):
            assert_close(y, want, p, f"all_reduce {op} double_tree p={p} n={n}x{cols} rank {r}")
            assert not np.shares_memory(y, xs[r])
            expect = cost.double_tree_all_reduce(n * cols, p, itemsize, r)
            assert (sent, recv) == expect, f"rank {r}: ledger {(sent, recv)} != cost {expect}"
            assert expect == cost.all_reduce(n * cols, p, itemsize, r, "double_tree")
    for x, b in zip(xs, before):
        assert np.array_equal(x, b), "double_tree all_reduce modified its input"


def test_two_complementary_binary_trees():
    """Both trees span the p ranks with <= 2 children each and depth ceil(log2 p); tree 0 read
    in order is 0..p-1, tree 1 its mirror (p even) or shift (p odd); no rank is a leaf twice."""
    for p in range(1, 300):
        for t in (0, 1):
            roots = [r for r in range(p) if cost.double_tree_links(r, p, t)[0] is None]
            assert roots == [_root(p, t)], (p, t, roots)
            for r in range(p):
                for c in _children(r, p, t):
                    assert cost.double_tree_links(c, p, t)[0] == r, (p, t, r, c)
            depth, level = 0, _children(_root(p, t), p, t)
            while level:
                depth, level = depth + 1, [c for v in level for c in _children(v, p, t)]
            assert depth == (p - 1).bit_length(), (p, t, depth)
        assert _in_order(0, p, 0) == list(range(p))
        mirror = [p - 1 - r for r in range(p)] if p % 2 == 0 else [(r + 1) % p for r in range(p)]
        assert _in_order(_root(p, 1), p, 1) == mirror, p
        leaves = [sum(not _children(r, p, t) for t in (0, 1)) for r in range(p)]
        assert p == 1 or max(leaves) == 1, (p, leaves)


def test_schedule_keeps_each_pair_in_order_and_cannot_deadlock():
    """Replay every rank's messages, in the order double_tree.all_reduce issues them, with eager
    sends and blocking receives: each receive must find the message of its own (step, tree) at
    the head of its FIFO (the shapes of the halves differ when N is odd), and all ranks finish."""
    for p in range(1, 130):
        program = []
        for r in range(p):
            mine = []
            for step, t in double_tree.schedule(r, p):
                parent, left, right = cost.double_tree_links(r, p, t)
                kids = [c for c in (left, right) if c is not None]
                if step == "up":
                    mine += [("recv", c, step, t) for c in kids]
                    mine += [] if parent is None else [("send", parent, step, t)]
                else:
                    mine += [] if parent is None else [("recv", parent, step, t)]
                    mine += [("send", c, step, t) for c in kids]
            program.append(deque(mine))
        fifo = {}
        moved = True
        while moved:
            moved = False
            for r in range(p):
                while program[r]:
                    verb, peer, step, t = program[r][0]
                    if verb == "send":
                        fifo.setdefault((r, peer), deque()).append((step, t))
                    elif fifo.get((peer, r)):
                        got = fifo[(peer, r)].popleft()
                        assert got == (step, t), f"p={p}: rank {r} wants {(step, t)}, got {got}"
                    else:
                        break
                    program[r].popleft()
                    moved = True
        assert not any(program), f"p={p}: deadlock, stuck at {[list(q)[:1] for q in program]}"


def _tree_sum(halves, v, p, t):
    """float32 (partial(left) + own) + partial(right), up tree t from v."""
    _, left, right = cost.double_tree_links(v, p, t)
    acc = halves[v][t].copy()
    if left is not None:
        acc = _tree_sum(halves, left, p, t) + acc
    return acc if right is None else acc + _tree_sum(halves, right, p, t)


@pytest.mark.parametrize("p", [5, 8])  # tree 1 shifted, then mirrored
def test_sum_order_is_each_trees_in_order_bracketing(p):
    rng = np.random.default_rng(p)
    n = 33
    xs = [
        (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
        for _ in range(p)
    ]
    halves = [np.array_split(x, 2) for x in xs]
    mine = np.concatenate([_tree_sum(halves, _root(p, t), p, t) for t in (0, 1)])
    for _ in range(2):  # and the same bits again
        ys = run(lambda c: all_reduce(c, xs[c.rank], algorithm="double_tree"), p)
        assert all(y.tobytes() == mine.tobytes() for y in ys), f"p={p}: not the tree order"


def test_load_is_balanced_and_total_equals_the_binomial_trees():
    """Every rank moves <= 2S + w each way (the binomial root moves L S); the sum over ranks is
    2 (p-1) S for both trees: the double tree spreads the same traffic evenly."""
    for p in range(2, 65):
        for n in (1000, 1001):
            w, size = 4, 4 * n
            mine = [cost.double_tree_all_reduce(n, p, w, r) for r in range(p)]
            binomial = [cost.tree_all_reduce(n, p, w, r) for r in range(p)]
            assert all(s == rcv <= 2 * size + w for s, rcv in mine), (p, n)
            assert sum(s for s, _ in mine) == sum(s for s, _ in binomial) == 2 * (p - 1) * size
            assert binomial[0] == ((p - 1).bit_length() * size,) * 2


def test_model_time_never_beats_the_binomial_tree_so_auto_leaves_it_out():
    for p in range(2, 257):
        for nbytes in (0, 1 << 10, 1 << 20, 1 << 30):
            dt = cost.double_tree_all_reduce_time(nbytes, p)
            assert dt >= cost.tree_all_reduce_time(nbytes, p)
            assert cost.auto_all_reduce(nbytes, p) in ("ring", "tree")


def test_world_size_one_and_bfloat16_avg():
    x = np.arange(5.0)

    def one(comm):
        return all_reduce(comm, x, algorithm="double_tree"), comm.ledger.sent()

    y, sent = run(one, 1)[0]
    assert sent == 0 and np.array_equal(y, x) and not np.shares_memory(y, x)
    bf = ml_dtypes.bfloat16
    xs = [np.full(7, 1 + r / 8, bf) for r in range(6)]
    ys = run(lambda c: all_reduce(c, xs[c.rank], op="avg", algorithm="double_tree"), 6)
    assert ys[0].dtype == bf
    assert_close(ys[0], reference.reduce_all(xs, "avg"), 6, "bf16 avg double_tree")
