"""Ring reduce-scatter, all-gather and all-reduce (= reduce-scatter + all-gather), any chunking.

Thakur, Rabenseifner & Gropp 2005, sec. 4 (MPICH); Patarasuk & Yuan 2009 (bandwidth-optimal
all-reduce); the algorithm behind Baidu's/Horovod's all-reduce and NCCL's "ring".
Letters: p ranks, r this rank, N elements of the flat array, counts[i] = elements of chunk i.
Rank r sends to r+1 and receives from r-1. Byte counts: see collectives/cost.py.

Reduction order (deterministic, the same on every backend): chunk c starts at rank c+1 and
each rank adds its own contribution to the partial it receives, so chunk c is
  ((x[c+1] + x[c+2]) + x[c+3]) + ... + x[c]      (indices mod p)
which differs in the last bits from np.sum's order x[0] + x[1] + ... for floats.
These functions move bytes only; call them through collectives.api, which labels the call.
"""

from __future__ import annotations

import functools

import numpy as np

from .cost import chunk_counts, offsets
from .ops import combine, exchange, finalize


@functools.lru_cache(maxsize=1024)
def _offsets(counts: tuple) -> tuple:  # cached: every all-reduce of a bucket asks again
    return tuple(offsets(counts))


def reduce_scatter(comm, x: np.ndarray, counts, op: str) -> np.ndarray:
    """x: (N,) contiguous, never written. Returns the reduced chunk r, (counts[r],), new array."""
    p, r = comm.size, comm.rank
    if p == 1:
        return x.copy()
    off = _offsets(tuple(counts))
    dst, src = (r + 1) % p, (r - 1) % p
    # Two receive buffers, used in turn: step s receives into one while it sends the other's
    # partial (step s-1's, complete once that step returned), so p-1 steps allocate two.
    big = max(counts)
    bufs = [np.empty(big, x.dtype) for _ in range(min(p - 1, 2))]
    acc = None  # the partial received last step: it is the one we forward next
    for s in range(p - 1):
        cs, cr = (r - s - 1) % p, (r - s - 2) % p
        send = x[off[cs] : off[cs + 1]] if s == 0 else acc
        into = bufs[s % 2][: counts[cr]]
        got = exchange(comm, send if counts[cs] else None, dst, src, counts[cr], x.dtype, into)
        acc = combine(op, got, x[off[cr] : off[cr + 1]])  # (counts[cr],) we own `got`
    return acc


def all_gather(comm, mine: np.ndarray, counts) -> np.ndarray:
    """mine: (counts[r],). Returns the (N,) concatenation of every rank's chunk, new array."""
    p, r = comm.size, comm.rank
    off = _offsets(tuple(counts))
    out = np.empty(off[-1], mine.dtype)  # (N,)
    out[off[r] : off[r + 1]] = mine
    dst, src = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        cs, cr = (r - s) % p, (r - s - 1) % p
        send = out[off[cs] : off[cs + 1]] if counts[cs] else None
        exchange(comm, send, dst, src, counts[cr], out.dtype, out=out[off[cr] : off[cr + 1]])
    return out


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    """x: (N,) contiguous. Every rank gets the (N,) reduction; chunks as np.array_split."""
    counts = chunk_counts(x.size, comm.size)
    mine = finalize(op, reduce_scatter(comm, x, counts, op), comm.size)
    return all_gather(comm, mine, counts)
