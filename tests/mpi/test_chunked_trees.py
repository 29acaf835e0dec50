"""Pipelined (chunked) trees under MPI: small chunks force many messages per edge, and still
the result equals mpi4py's native collective, the bits equal the unchunked tree and the
virtual backend's, and each rank's bytes equal cost.py's formula (chunking splits messages,
never bytes); each edge carries exactly ceil(S / chunk) messages (cost.chunk_spans)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import collectives as C
from collectives import cost

from .test_vs_native import close, inputs, same_bits, virtual

pytestmark = pytest.mark.mpi
CASES = [(np.float64, 1001), (np.float32, 4099), (np.int64, 37), (np.float32, 1), (np.int64, 0)]
CHUNK = 40  # bytes: 5 float64 / 10 float32 per message, so even 37 elements are chunked


def _edges(algo: str, n: int, p: int, itemsize: int, rank: int) -> list[int]:
    """Elements on each of this rank's sent edges (messages per edge = their chunk count)."""
    if algo == "tree":
        v = rank
        up = [n] if v else []
        return up + [n] * len(cost.tree_children(v, p))
    halves = (n - n // 2, n // 2)
    return [
        h for t, h in enumerate(halves) for v in cost.double_tree_links(rank, p, t) if v is not None
    ]


@pytest.mark.parametrize("dtype,n", CASES)
@pytest.mark.parametrize("algo", ["tree", "double_tree"])
def test_chunked_all_reduce(comm, MPI, monkeypatch, dtype, n, algo):
    p, r = comm.size, comm.rank
    xs = inputs(p, n, dtype, seed=n + 7)
    native = np.empty_like(xs[r])
    MPI.COMM_WORLD.Allreduce(xs[r], native, op=MPI.SUM)
    whole = C.all_reduce(comm, xs[r], algorithm=algo)  # 512 KiB chunks: one message per edge
    monkeypatch.setattr(cost, "TREE_CHUNK", CHUNK)
    mark = comm.ledger.mark()
    ours = C.all_reduce(comm, xs[r], algorithm=algo)
    rec = comm.ledger.since(mark)
    virt = virtual(lambda c: C.all_reduce(c, xs[c.rank], algorithm=algo), p)[r]
    w = np.dtype(dtype).itemsize
    sends = [x.nbytes for x in rec if x.direction == "send"]
    per = max(1, CHUNK // w) * w  # bytes per full message
    want = sum(max(1, math.ceil(k * w / per)) for k in _edges(algo, n, p, w, r))
    assert close(ours, native, dtype), f"{algo}: chunked vs native Allreduce"
    assert same_bits(ours, whole), f"{algo}: chunking changed the bits"
    assert same_bits(ours, virt), f"{algo}: MPI and virtual backends differ bitwise"
    assert (comm.ledger.sent(rec), comm.ledger.received(rec)) == cost.all_reduce(n, p, w, r, algo)
    assert len(sends) == want and max(sends, default=0) <= per, (sends, want)


@pytest.mark.parametrize("root", [0, -1])
def test_chunked_broadcast_and_reduce(comm, MPI, monkeypatch, root):
    p, r = comm.size, comm.rank
    root %= p
    n = 203
    xs = inputs(p, n, np.float64, seed=root + 3)
    bcast, red = xs[r].copy(), np.empty_like(xs[r])
    MPI.COMM_WORLD.Bcast(bcast, root=root)
    MPI.COMM_WORLD.Reduce(xs[r], red, op=MPI.SUM, root=root)
    monkeypatch.setattr(cost, "TREE_CHUNK", CHUNK)
    mark = comm.ledger.mark()
    got_b = C.broadcast(comm, xs[r], root=root)
    got_r = C.reduce(comm, xs[r], root=root)
    rec = comm.ledger.since(mark)
    sb = cost.tree_broadcast(n, p, 8, r, root)
    sr = cost.tree_reduce(n, p, 8, r, root)
    assert np.array_equal(got_b, bcast)
    assert (got_r is None) == (r != root) and (got_r is None or close(got_r, red, np.float64))
    assert (comm.ledger.sent(rec), comm.ledger.received(rec)) == (sb[0] + sr[0], sb[1] + sr[1])
