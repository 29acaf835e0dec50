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

On a backend whose messages are handed over (`comm.hands_over`: virtual ranks, where a message
is the sender's private copy) each partial is received as that copy itself, reduced or stored
where it arrived, and passed on with `sendrecv(..., give=True)` (no eager copy: the ring never
touches it again): a reduce-scatter step then copies nothing, an all-gather step once (into
the result). The same messages, bytes and records in the same order; the same arithmetic.
"""

from __future__ import annotations

import functools

import numpy as np

from .cost import _counts, offsets
from .ops import combine, exchange, finalize


@functools.lru_cache(maxsize=1024)
def _steps(counts: tuple, r: int, gather: bool) -> tuple:
    """Rank r's p-1 steps, cached (every all-reduce of a bucket asks again): per step the
    (start, stop) of the chunk it sends and of the chunk it receives. Reduce-scatter step s
    sends chunk r-s-1 and receives r-s-2; all-gather step s sends r-s and receives r-s-1."""
    p, off = len(counts), offsets(counts)
    first = 0 if gather else 1
    return tuple(
        (off[cs], off[cs + 1], off[cr], off[cr + 1])
        for cs, cr in (((r - s - first) % p, (r - s - first - 1) % p) for s in range(p - 1))
    )


def reduce_scatter(comm, x: np.ndarray, counts, op: str) -> np.ndarray:
    """x: (N,) contiguous, never written. Returns the reduced chunk r, (counts[r],), new array."""
    p, r = comm.world_size, comm.rank
    if p == 1:
        return x.copy()
    counts = tuple(counts)
    dst, src = (r + 1) % p, (r - 1) % p
    # Two receive buffers, used in turn: step s receives into one while it sends the other's
    # partial (step s-1's, complete once that step returned), so p-1 steps allocate two.
    if comm.hands_over:
        return _reduce_scatter_handed(comm, x, _steps(counts, r, False), dst, src, op)
    big = max(counts)
    bufs = (np.empty(big, x.dtype), np.empty(big, x.dtype)) if p > 2 else (np.empty(big, x.dtype),)
    acc = None  # the partial received last step: it is the one we forward next
    for s, (a, b, c, d) in enumerate(_steps(counts, r, False)):
        send = x[a:b] if s == 0 else acc
        into = bufs[s % 2][: d - c]
        if b > a and d > c:  # both ways (every step of an even split): exchange's last case
            got = comm.sendrecv(send, dst, src, out=into)
        else:
            got = exchange(comm, send if b > a else None, dst, src, d - c, x.dtype, into)
        acc = combine(op, got, x[c:d])  # (counts[cr],) we own `got`
    return acc


def _reduce_scatter_handed(comm, x: np.ndarray, steps, dst: int, src: int, op: str):
    """reduce_scatter's steps where messages are handed over: each partial arrives as the
    sender's copy, is reduced in place, and is given to the next rank (no buffers, no copies
    but step 0's of our own input)."""
    acc = None  # the partial received last step: it is the one we forward next
    for s, (a, b, c, d) in enumerate(steps):
        got = _handed_step(comm, s, (a, b, c, d), x[a:b], acc, dst, src, x.dtype)
        acc = combine(op, got, x[c:d])  # (counts[cr],) we own `got`
    return acc


def _handed_step(comm, s: int, step, first: np.ndarray, held, dst: int, src: int, dt):
    """One ring step where messages are handed over: send ``first`` (step 0: our own data,
    copied) or give on ``held`` (what the last step received: no copy), receive the next."""
    a, b, c, d = step
    if b > a and d > c:
        if s:
            return comm.sendrecv(held, dst, src, shape=(d - c,), dtype=dt, give=True)
        return comm.sendrecv(first, dst, src, shape=(d - c,), dtype=dt)
    send = (held if s else first) if b > a else None
    return exchange(comm, send, dst, src, d - c, dt)


def all_gather(comm, mine: np.ndarray, counts) -> np.ndarray:
    """mine: (counts[r],). Returns the (N,) concatenation of every rank's chunk, new array."""
    p, r = comm.world_size, comm.rank
    counts = tuple(counts)
    steps = _steps(counts, r, True)
    out = np.empty(sum(counts), mine.dtype)  # (N,)
    lo = steps[0][0] if steps else 0  # step 0 sends our own chunk r
    out[lo : lo + counts[r]] = mine
    dst, src = (r + 1) % p, (r - 1) % p
    if comm.hands_over:
        return _all_gather_handed(comm, out, steps, dst, src)
    for a, b, c, d in steps:
        if b > a and d > c:  # both ways (every step of an even split): exchange's last case
            comm.sendrecv(out[a:b], dst, src, out=out[c:d])
        else:
            exchange(comm, out[a:b] if b > a else None, dst, src, d - c, out.dtype, out=out[c:d])
    return out


def _all_gather_handed(comm, out: np.ndarray, steps, dst: int, src: int) -> np.ndarray:
    """all_gather's steps where messages are handed over: each chunk arrives as the sender's
    copy, is stored in `out`, and is given on as it is (step s sends the chunk step s-1
    received), so a step copies once instead of twice."""
    held = None  # the chunk received last step = the one we send next
    for s, (a, b, c, d) in enumerate(steps):
        held = _handed_step(comm, s, (a, b, c, d), out[a:b], held, dst, src, out.dtype)
        out[c:d] = held
    return out


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    """x: (N,) contiguous. Every rank gets the (N,) reduction; chunks as np.array_split."""
    counts = _counts(x.size, comm.size)
    mine = finalize(op, reduce_scatter(comm, x, counts, op), comm.size)
    return all_gather(comm, mine, counts)


# -- along an inner axis ------------------------------------------------------------------------
# x viewed as (pre, n, post), chunk i = x3[:, off_i:off_i + rows_i, :] (rows chunked along the
# middle axis). Each message is that chunk made contiguous, so it holds exactly counts[i] =
# pre * rows_i * post elements: the messages, bytes and records of the axis-0 call on the
# moved-axis array, in the same order, with the same arithmetic per element. The sender's copy
# is the one the backend makes anyway (virtual ranks: the message is the sender's private copy;
# MPI: the send buffer is made contiguous); receives arrive as new contiguous arrays (handed
# over, or the buffer MPI receives into) and are stored once into the strided slot.


def _rows_step(comm, send, dst: int, src: int, shape: tuple, dt, give: bool):
    """One ring step of chunks (pre, rows, post): send ``send`` (skipped if empty), receive a
    ``shape`` chunk (skipped if empty). Both ends know every count, as in ops.exchange."""
    if shape[0] * shape[1] * shape[2] == 0:
        if send.size:
            comm.send(np.ascontiguousarray(send), dst)
        return np.empty(shape, dt)
    if send.size == 0:
        return comm.recv(src, shape=shape, dtype=dt)
    return comm.sendrecv(send, dst, src, shape=shape, dtype=dt, give=give)


def reduce_scatter_rows(comm, x3: np.ndarray, rows, op: str) -> np.ndarray:
    """x3: (pre, n, post), any strides, never written; rows[i]: rows of chunk i along axis 1.
    Returns the reduced chunk r, (pre, rows[r], post), a new C-contiguous array."""
    p, r = comm.world_size, comm.rank
    if p == 1:
        return x3.copy()
    dst, src = (r + 1) % p, (r - 1) % p
    pre, post, dt = x3.shape[0], x3.shape[2], x3.dtype
    acc = None  # the partial received last step: it is the one we forward next (we own it)
    for s, (a, _b, c, d) in enumerate(_steps(tuple(rows), r, False)):
        send = x3[:, a:_b] if s == 0 else acc
        got = _rows_step(comm, send, dst, src, (pre, d - c, post), dt, s > 0)
        acc = combine(op, got, x3[:, c:d])
    return acc


def all_gather_rows(comm, mine: np.ndarray, rows) -> np.ndarray:
    """mine: (pre, rows[r], post). Returns (pre, sum(rows), post), chunk j along axis 1 from
    rank j, a new C-contiguous array."""
    p, r = comm.world_size, comm.rank
    rows = tuple(rows)
    pre, post, dt = mine.shape[0], mine.shape[2], mine.dtype
    out = np.empty((pre, sum(rows), post), dt)
    lo = offsets(rows)[r]
    out[:, lo : lo + rows[r]] = mine
    dst, src = (r + 1) % p, (r - 1) % p
    held = mine  # step 0 sends our own chunk; step s sends the chunk step s-1 received
    for s, (_a, _b, c, d) in enumerate(_steps(rows, r, True)):
        held = _rows_step(comm, held, dst, src, (pre, d - c, post), dt, s > 0)
        out[:, c:d] = held
    return out
