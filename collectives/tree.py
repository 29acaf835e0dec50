"""Binomial-tree reduce and broadcast, and the tree all-reduce = reduce to 0 + broadcast from 0.

Thakur, Rabenseifner & Gropp 2005, sec. 3 (MPICH's binomial broadcast / reduce). Relative rank
v = (r - root) mod p; parent(v) = v - lowbit(v); children v + 2^k for 2^k < lowbit(v). Depth
L = ceil(log2 p), so a small message needs 2L steps instead of the ring's 2(p-1).
The binomial tree sends the whole array on each edge, and its root moves L S each way;
double_tree.py (NCCL's double binary tree) splits it in halves over two complementary trees.

Pipelined: the array travels in chunks of at most cost.TREE_CHUNK bytes (cost.chunk_spans), each
reduced and forwarded as soon as it is in, so the levels overlap as in NCCL's trees; sends go
out without an eager copy (`send_lent`: the buffers stay unwritten until the collective ends)
and each chunk is received where it is reduced. The bytes per edge, and so every count in
cost.py, are those of the unchunked tree.

Reduction order (deterministic): v's partial = x[v] (op) partial(v+1) (op) partial(v+2) (op)
partial(v+4) ... (children nearest first), elementwise, whatever the chunking.
Byte counts: collectives/cost.py.
"""

from __future__ import annotations

import functools

import numpy as np

from . import cost
from .cost import chunk_spans, tree_children, tree_parent
from .ops import combine, finalize


@functools.lru_cache(maxsize=1024)
def _links(r: int, p: int, root: int) -> tuple:
    """(v, children (reduce order: nearest first), parent) of rank r, as group ranks."""
    v = (r - root) % p
    return v, tuple((c + root) % p for c in tree_children(v, p)), (tree_parent(v) + root) % p


def spans(n: int, itemsize: int):
    """cost.chunk_spans(n, itemsize); a message that fits one chunk (every small one) without
    building the list: one span (0, n), as chunk_spans gives (n = 0 included)."""
    if n * itemsize <= cost.TREE_CHUNK:
        return ((0, n),)
    return chunk_spans(n, itemsize)


def reduce(comm, x: np.ndarray, op: str, root: int = 0):
    """x: (N,) contiguous, never written. The (N,) reduction on root (new array), else None."""
    v, kids, parent = _links(comm.rank, comm.size, root)
    parts = spans(x.size, x.itemsize)
    if not kids:  # a leaf (or p = 1): its own chunks go up as they are
        if v and len(parts) == 1:  # one chunk: the array itself, no view to make
            comm.send_lent(x, parent)
            return None
        for a, b in parts if v else ():
            comm.send_lent(x[a:b], parent)
        return None if v else x.copy()
    acc = np.empty_like(x)  # (N,) the partial, chunk by chunk: received into, then reduced
    tmp = np.empty(parts[0][1] - parts[0][0], x.dtype) if len(kids) > 1 else None
    if len(parts) == 1 and len(kids) == 1:  # one chunk, one child (p = 2's root): no views
        combine(op, comm.recv(kids[0], out=acc), x)
        if v:
            comm.send_lent(acc, parent)
        return None if v else acc
    for a, b in parts:
        part = comm.recv(kids[0], out=acc[a:b])
        combine(op, part, x[a:b])  # child (op) own; ops commute bitwise
        for c in kids[1:]:
            combine(op, part, comm.recv(c, out=tmp[: b - a]))  # (...) (op) next child
        if v:
            comm.send_lent(part, parent)
    return None if v else acc


def broadcast(comm, x: np.ndarray, root: int = 0, owned: bool = False, out=None) -> np.ndarray:
    """x: (N,) on every rank (its content matters on root only). Returns root's x, new array
    (on the root, x itself when `owned`: the caller's own buffer), or in `out` ((N,),
    contiguous; on the root it may be x's own memory: then nothing is copied)."""
    v, kids, parent = _links(comm.rank, comm.size, root)
    kids = kids[::-1]  # deepest subtree first
    if out is not None:
        buf = out
        if v == 0 and out.ctypes.data != x.ctypes.data:  # same start, shape, dtype: x itself
            buf[...] = x
    else:
        buf = (x if owned else x.copy()) if v == 0 else np.empty_like(x)
    parts = spans(x.size, x.itemsize)
    if len(parts) == 1:  # one chunk: the buffer itself, no views to make
        if v:
            comm.recv(parent, out=buf)
        for c in kids:
            comm.send_lent(buf, c)
        return buf
    for a, b in parts:
        if v:
            comm.recv(parent, out=buf[a:b])
        for c in kids:
            comm.send_lent(buf[a:b], c)
    return buf


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    acc = reduce(comm, x, op, root=0)
    if acc is None:
        return broadcast(comm, x, root=0)
    return broadcast(comm, finalize(op, acc, comm.size), root=0, owned=True)
