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

Pipelined as NCCL's: each half crosses each edge in chunks of at most cost.TREE_CHUNK bytes
(cost.chunk_spans), reduced and forwarded as they come, so the levels overlap; sends go out
without an eager copy (`send_lent`), the root reduces straight into its output and leaves
receive their chunks where they stay. Bytes (cost.py) and results are the same for any
chunking, because each element's reduction order is fixed by the tree. On p = 2 with halves of
one chunk the two ranks' messages cross in pairs: two sendrecvs each (`_pair`), same messages.

Reduction order (deterministic, the same on every backend): in tree t a rank combines
(left subtree's partial (op) its own half) (op) right subtree's partial, so half 0 is reduced
over ranks 0, 1, ..., p-1 in order and half 1 over p-1, ..., 0 (p even) or 1, ..., p-1, 0
(p odd), bracketed as the tree. "avg" divides once, at each tree's root. Byte counts: cost.py.
"""

from __future__ import annotations

import functools

import numpy as np

from . import cost
from .cost import double_tree_links
from .ops import combine, finalize
from .tree import spans

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


@functools.lru_cache(maxsize=1024)
def _plan(rank: int, p: int) -> tuple:
    """schedule(rank, p) with each step's links: ((step, tree, (parent, left, right)), ...)."""
    return tuple((step, t, double_tree_links(rank, p, t)) for step, t in schedule(rank, p))


def _up(comm, half: np.ndarray, op: str, links, acc) -> None:
    """Reduce `half` over this rank's subtree into `acc` (the root's output slice, else a
    scratch half), chunk by chunk, each chunk sent on to the parent as soon as it is reduced.
    A leaf sends its own chunks."""
    parent, left, right = links
    parts = spans(half.size, half.itemsize)
    if left is None and right is None:
        for a, b in parts:
            comm.send_lent(half[a:b], parent)
        return
    tmp = None if right is None else np.empty(parts[0][1] - parts[0][0], half.dtype)
    for a, b in parts:
        part = acc[a:b]
        if left is not None:
            combine(op, comm.recv(left, out=part), half[a:b])  # left (op) own
        else:
            part[...] = half[a:b]
        if right is not None:
            combine(op, part, comm.recv(right, out=tmp[: b - a]))  # (...) (op) right
        if parent is not None:
            comm.send_lent(part, parent)


def _pair(comm, halves, outs, op: str, plan) -> None:
    """p = 2, each half one chunk: the same four messages as the steps of `plan` (a leaf in
    one tree, the root of the other), each crossing pair in one sendrecv. Rank r's steps are
    send its leaf half, receive its root half's other partial, send the root half's result,
    receive the leaf half's result: the sendrecv's send-then-receive is that order, and the
    peer's steps are the same, so both ends match (and record) as the four steps do."""
    (_, leaf, (peer, _, _)), (_, root, (_, left, _)) = plan[0], plan[1]
    own = outs[root]
    if left is not None:  # left (op) own, as _up
        combine(op, comm.sendrecv(halves[leaf], peer, peer, out=own), halves[root])
    else:  # own (op) right (cost.btree_links makes the one child of p = 2 a right child)
        own[...] = halves[root]
        combine(op, own, comm.sendrecv(halves[leaf], peer, peer, out=np.empty_like(own)))
    finalize(op, own, 2)
    comm.sendrecv(own, peer, peer, out=outs[leaf])


def all_reduce(comm, x: np.ndarray, op: str) -> np.ndarray:
    """x: (N,) contiguous, never written. Every rank gets the (N,) reduction, a new array."""
    p, r = comm.size, comm.rank
    h = x.size - x.size // 2  # np.array_split(x, 2): (ceil(N/2),), (floor(N/2),)
    halves = (x[:h], x[h:])  # views
    out = np.empty_like(x)  # (N,)
    outs = (out[:h], out[h:])  # views into out, one per tree
    if p == 2 and h * x.itemsize <= cost.TREE_CHUNK:  # (read at the call: tests change it)
        _pair(comm, halves, outs, op, _plan(r, p))
        return out
    for step, t, links in _plan(r, p):
        parent, left, right = links
        if step == "up":  # the root reduces straight into its output
            leaf = left is None and right is None
            acc = outs[t] if parent is None else None if leaf else np.empty_like(halves[t])
            _up(comm, halves[t], op, links, acc)
            continue
        if parent is None:
            finalize(op, outs[t], p)
        for a, b in spans(outs[t].size, x.itemsize):
            if parent is not None:
                comm.recv(parent, out=outs[t][a:b])
            for child in (left, right):  # the left subtree is never shallower than the right
                if child is not None:
                    comm.send_lent(outs[t][a:b], child)
    return out
