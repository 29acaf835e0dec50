"""Pairwise-exchange all-to-all and all-to-allv; linear gather and scatter; dissemination barrier.

All-to-all (Thakur, Rabenseifner & Gropp 2005, sec. 5): p-1 steps; at step i rank r sends its
block for r+i and receives the block from r-i, so every step is a permutation and no rank is
hot. This is what expert-parallel MoE dispatch and combine run.
Barrier: dissemination (Hensgen, Finkel & Manber 1988), ceil(log2 p) rounds of 1-byte tokens.
Byte counts: collectives/cost.py.
"""

from __future__ import annotations

import numpy as np

from .cost import offsets


def all_to_all(comm, x: np.ndarray) -> np.ndarray:
    """x: (p*k, ...) contiguous; block j = rows j*k:(j+1)*k goes to rank j. Returns (p*k, ...)
    whose block j came from rank j."""
    p, r = comm.size, comm.rank
    k = x.shape[0] // p
    out = np.empty_like(x)
    out[r * k : (r + 1) * k] = x[r * k : (r + 1) * k]
    if k == 0 or x.size == 0:
        return out
    for i in range(1, p):
        dst, src = (r + i) % p, (r - i) % p
        comm.sendrecv(x[dst * k : (dst + 1) * k], dst, src, out=out[src * k : (src + 1) * k])
    return out


def exchange_counts(comm, send_rows) -> list[int]:
    """A counted pairwise all-to-all of one int64 per peer: how many rows each rank will send."""
    p, r = comm.size, comm.rank
    recv = [0] * p
    recv[r] = int(send_rows[r])
    for i in range(1, p):
        dst, src = (r + i) % p, (r - i) % p
        got = comm.sendrecv(
            np.array([send_rows[dst]], np.int64), dst, src, shape=(1,), dtype=np.int64
        )
        recv[src] = int(got[0])
    return recv


def all_to_allv(comm, sends, recv_rows, row_shape, dtype) -> list[np.ndarray]:
    """sends[j]: (rows_j, *row_shape) for rank j. Returns a list whose entry j came from rank j."""
    p, r = comm.size, comm.rank
    out = [None] * p
    out[r] = np.array(sends[r], copy=True)
    for i in range(1, p):
        dst, src = (r + i) % p, (r - i) % p
        send = sends[dst] if sends[dst].shape[0] else None
        shape = (recv_rows[src], *row_shape)
        if recv_rows[src] == 0:
            if send is not None:
                comm.send(send, dst)
            out[src] = np.empty(shape, dtype)
        elif send is None:
            out[src] = comm.recv(src, shape=shape, dtype=dtype)
        else:
            out[src] = comm.sendrecv(send, dst, src, shape=shape, dtype=dtype)
    return out


def gather(comm, x: np.ndarray, rows, root: int):
    """Linear gather: root gets the concatenation along axis 0 (rows[j] from rank j), else None."""
    p, r = comm.size, comm.rank
    if r != root:
        if x.shape[0]:
            comm.send(x, root)
        return None
    off = offsets(rows)
    out = np.empty((off[-1], *x.shape[1:]), x.dtype)  # (sum rows, ...)
    out[off[r] : off[r + 1]] = x
    for j in range(p):
        if j != root and rows[j]:
            comm.recv(j, out=out[off[j] : off[j + 1]])
    return out


def scatter(comm, chunks, shape, dtype, root: int) -> np.ndarray:
    """Linear scatter: rank j gets chunks[j] (root's list); every chunk has `shape`."""
    p, r = comm.size, comm.rank
    if r == root:
        for j in range(p):
            if j != root and chunks[j].size:
                comm.send(chunks[j], j)
        return np.array(chunks[root], copy=True)
    if int(np.prod(shape)) == 0:
        return np.empty(shape, dtype)
    return comm.recv(root, shape=shape, dtype=dtype)


def barrier(comm) -> None:
    p, r = comm.size, comm.rank
    token = np.zeros(1, np.uint8)
    d = 1
    while d < p:
        comm.sendrecv(token, (r + d) % p, (r - d) % p, shape=(1,), dtype=np.uint8)
        d *= 2
