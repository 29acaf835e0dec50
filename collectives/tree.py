"""Binomial-tree reduce and broadcast, and the tree all-reduce = reduce to 0 + broadcast from 0.

Thakur, Rabenseifner & Gropp 2005, sec. 3 (MPICH's binomial broadcast / reduce). Relative rank
v = (r - root) mod p; parent(v) = v - lowbit(v); children v + 2^k for 2^k < lowbit(v). Depth
L = ceil(log2 p), so a small message needs 2L steps instead of the ring's 2(p-1).
The binomial tree sends the whole array on each edge, and its root moves L S each way;
double_tree.py (NCCL's double binary tree) splits it in halves over two complementary trees.

Reduction order (deterministic): v's partial = x[v] (op) partial(v+1) (op) partial(v+2) (op)
partial(v+4) ... (children nearest first). Byte counts: collectives/cost.py.
"""

from __future__ import annotations

import numpy as np

from .cost import tree_children, tree_parent
from .ops import combine, finalize


def reduce(comm, x: np.ndarray, op: str, root: int = 0):
    """x: (N,) contiguous, never written. The (N,) reduction on root (new array), else None."""
    p, r = comm.size, comm.rank
    v = (r - root) % p
    acc = None
    for c in tree_children(v, p):
        got = comm.recv((c + root) % p, shape=x.shape, dtype=x.dtype)  # we own `got`
        # acc <- x (op) got on the first child, then acc (op) got; ops commute bitwise.
        acc = combine(op, got, x) if acc is None else combine(op, acc, got)
    if acc is None:
        acc = x
    if v:
        comm.send(acc, (tree_parent(v) + root) % p)  # the receiver gets a copy
        return None
    return acc.copy() if acc is x else acc


def broadcast(comm, x: np.ndarray, root: int = 0) -> np.ndarray:
    """x: (N,) on every rank (its content matters on root only). Returns root's x, new array."""
    p, r = comm.size, comm.rank
    v = (r - root) % p
    buf = (
        x.copy() if v == 0 else comm.recv((tree_parent(v) + root) % p, shape=x.shape, dtype=x.dtype)
    )
    for c in reversed(tree_children(v, p)):  # farthest subtree first: it is the deepest
        comm.send(buf, (c + root) % p)
    return buf


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    acc = reduce(comm, x, op, root=0)
    if acc is not None:
        finalize(op, acc, comm.size)
    return broadcast(comm, x if acc is None else acc, root=0)
