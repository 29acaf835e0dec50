"""Pipelined trees on virtual ranks: with chunks far below the array, every algorithm that
chunks (binomial tree all-reduce / broadcast / reduce, double tree) gives the same bits as with
one message per edge, the bytes of cost.py, and ceil(S / chunk) messages per edge."""

from __future__ import annotations

import contextlib
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from collectives import all_reduce, broadcast, cost, reduce

from .helpers import SETTINGS, dtypes, inputs, run


@contextlib.contextmanager
def chunked(nbytes: int):
    """cost.TREE_CHUNK = nbytes inside (every virtual rank shares the module)."""
    old, cost.TREE_CHUNK = cost.TREE_CHUNK, nbytes
    try:
        yield
    finally:
        cost.TREE_CHUNK = old


def _calls(p, n, dtype, algo, root):
    xs = inputs(p, (n,), dtype, seed=p * 100 + n)

    def fn(comm):
        x, mark = xs[comm.rank], comm.ledger.mark()
        if algo == "broadcast":
            y = broadcast(comm, x, root=root)
        elif algo == "reduce":
            y = reduce(comm, x, root=root)
        else:
            y = all_reduce(comm, x, algorithm=algo)
        rec = comm.ledger.since(mark)
        return y, comm.ledger.sent(rec), comm.ledger.received(rec), [r.nbytes for r in rec]

    return run(fn, p)


def _formula(p, n, w, r, algo, root):
    if algo == "broadcast":
        return cost.tree_broadcast(n, p, w, r, root)
    if algo == "reduce":
        return cost.tree_reduce(n, p, w, r, root)
    return cost.all_reduce(n, p, w, r, algo)


@SETTINGS
@given(
    p=st.integers(1, 9),
    n=st.integers(0, 60),
    dtype=dtypes,
    algo=st.sampled_from(["tree", "double_tree", "broadcast", "reduce"]),
    root=st.integers(0, 8),
    chunk=st.integers(1, 48),
)
def test_chunking_keeps_bits_and_bytes(p, n, dtype, algo, root, chunk):
    root %= p
    w = np.dtype(dtype).itemsize
    whole = _calls(p, n, dtype, algo, root)
    with chunked(chunk):
        parts = _calls(p, n, dtype, algo, root)
    per = max(1, chunk // w) * w  # bytes of a full message
    for r, ((y0, s0, r0, m0), (y, s, rv, m)) in enumerate(zip(whole, parts, strict=True)):
        assert (y is None) == (y0 is None) and (y is None or y.tobytes() == y0.tobytes()), r
        assert (s, rv) == (s0, r0) == _formula(p, n, w, r, algo, root), (r, s, rv)
        assert max(m, default=0) <= per, (r, m, per)
        # each unchunked message of b bytes became ceil(b / per) messages (one if empty)
        assert len(m) == sum(max(1, math.ceil(b / per)) for b in m0), (r, m0, m)
