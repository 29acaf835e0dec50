r"""Double binary tree all-reduce: each half of the array reduced up one tree and broadcast down it.

Sanders, Speck & Traff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction and
scan" (sec. 2); NCCL 2.4's double binary tree (src/graph/trees.cc, ncclGetDtree). Two binary
trees over the same p ranks, built so that every rank is a leaf in at most one of them:
tree 0 is NCCL's in-order binary tree on the ranks (cost.btree_links; its leaves are the odd
ranks), tree 1 the same tree mirrored (r -> p-1-r, p even) or shifted (r -> r+1, p odd), whose
leaves are the even ranks (but 0, when p is odd). Half t of the flat array (np.array_split(x, 2))
travels only in tree t. A rank thus does real work (two children in, one parent out) in at
most one tree and only sends and receives its half once in the other, so every rank moves
about 2S each way (the binomial tree's root moves L S), and its link works both ways at once:
while it receives its children's halves in one tree, it sends its own half up the other.

    p = 8:  tree 0        tree 1 = tree 0 with r -> 7-r
            0             7
             \             \
              4             3
             / \           / \
            2   6         5   1
           / \ / \       / \ / \
           1 3 5 7       6 4 2 0

Unpipelined: each half crosses each edge as one message. NCCL cuts the halves into chunks that
stream through the tree, which overlaps the levels and brings the time towards the ring's; here
that would change the message count and the threads' timing only. Bytes (cost.py) and results
are the same for any chunking, because each element's reduction order is fixed by the tree.

Reduction order (deterministic, the same on every backend): in tree t a rank combines
(left subtree's partial (op) its own half) (op) right subtree's partial, so half 0 is reduced
over ranks 0, 1, ..., p-1 in order and half 1 over p-1, ..., 0 (p even) or 1, ..., p-1, 0
(p odd), bracketed as the tree. "avg" divides once, at each tree's root. Byte counts: cost.py.
"""

from __future__ import annotations

import numpy as np

from .cost import double_tree_links
from .ops import combine, finalize

LEAF, INTERIOR, ROOT = 0, 1, 2


def role(rank: int, p: int, tree: int) -> int:
    parent, left, right = double_tree_links(rank, p, tree)
    if parent is None:
        return ROOT
    return LEAF if left is None and right is None else INTERIOR


def schedule(rank: int, p: int) -> list[tuple[str, int]]:
    """Rank's steps in order: ("up", t) reduces half t in tree t, ("down", t) broadcasts it.

    Going up, a rank acts first in the tree where it is lowest (leaf before interior before
    root); going down, in the reverse order: a leaf's send never waits and a root starts the
    broadcast at once. A rank's roles in the two trees always differ (p >= 2), and this order
    keeps each pair's messages in the same order at both ends even where one edge is in both
    trees (p = 3: rank 2 is rank 0's child twice); tests/collectives checks this for every p.
    """
    ups = sorted((0, 1), key=lambda t: role(rank, p, t))
    return [("up", t) for t in ups] + [("down", t) for t in reversed(ups)]


def _up(comm, half: np.ndarray, op: str, parent, left, right):
    """Reduce `half` over this rank's subtree; send it to the parent (None) or return it (root)."""
    part = half
    if left is not None:
        got = comm.recv(left, shape=half.shape, dtype=half.dtype)  # we own `got`
        part = combine(op, got, half)  # left (op) own
    if right is not None:
        part = half.copy() if part is half else part
        combine(op, part, comm.recv(right, shape=half.shape, dtype=half.dtype))  # (...) (op) right
    if parent is None:
        return half.copy() if part is half else part  # finalize writes into it
    comm.send(part, parent)  # the receiver gets a copy
    return None


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    """x: (N,) contiguous, never written. Every rank gets the (N,) reduction, a new array."""
    p, r = comm.size, comm.rank
    halves = np.array_split(x, 2)  # views: (ceil(N/2),), (floor(N/2),)
    out = np.empty_like(x)  # (N,)
    outs = np.array_split(out, 2)  # views into out, one per tree
    reduced = [None, None]  # the root's reduction of half t
    for step, t in schedule(r, p):
        parent, left, right = double_tree_links(r, p, t)
        if step == "up":
            reduced[t] = _up(comm, halves[t], op, parent, left, right)
            continue
        if parent is None:
            outs[t][...] = finalize(op, reduced[t], p)
        else:
            comm.recv(parent, out=outs[t])
        for child in (left, right):  # the left subtree is never shallower than the right
            if child is not None:
                comm.send(outs[t], child)
    return out
