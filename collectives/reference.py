"""What each collective MEANS, in a few lines over the list of all ranks' arrays: the oracle.

`xs[r]` is rank r's input; each function returns what rank r should end with (a list over
ranks) or the one array every rank gets. No messages, no algorithm, no reduction order: the
real algorithms (ring.py, tree.py, alltoall.py) are tested against these.
Floats are reduced in float64 here (bfloat16 in float32), so an algorithm's result equals this
to rounding, and integers exactly.
"""

from __future__ import annotations

import numpy as np

from .ops import is_bf16


def reduce_all(xs, op: str = "sum") -> np.ndarray:
    """Elementwise reduction over ranks: the value every all-reduce / reduce returns."""
    dt = xs[0].dtype
    acc_dt = np.float32 if is_bf16(dt) else (np.float64 if dt.kind == "f" else dt)
    stack = np.stack([np.asarray(x, acc_dt) for x in xs])  # (R, ...)
    f = {"sum": np.sum, "avg": np.sum, "max": np.max, "min": np.min}[op]
    out = f(stack, axis=0)
    if op == "avg":
        out = out / len(xs)
    return out.astype(dt)


def all_reduce(xs, op="sum"):
    return [reduce_all(xs, op)] * len(xs)


def reduce_scatter(xs, op="sum"):
    """Reduce, then rank r keeps rows chunk r of axis 0 (np.array_split: first n % R get +1)."""
    # np.array_split itself, not cost.chunk_counts: the oracle must not share the code it checks
    return np.array_split(reduce_all(xs, op), len(xs), axis=0)


def all_gather(xs):
    return [np.concatenate(xs, axis=0)] * len(xs)


def broadcast(xs, root=0):
    return [xs[root]] * len(xs)


def reduce(xs, root=0, op="sum"):
    return [reduce_all(xs, op) if r == root else None for r in range(len(xs))]


def all_to_all(xs):
    """Rank r's block j (axis 0 in R equal blocks) goes to rank j, landing as block r."""
    blocks = [np.split(x, len(xs)) for x in xs]  # blocks[src][dst]
    return [np.concatenate([blocks[s][d] for s in range(len(xs))]) for d in range(len(xs))]


def all_to_allv(sends):
    """sends[src][dst] -> rank dst receives the list [sends[0][dst], ..., sends[R-1][dst]]."""
    return [[sends[s][d] for s in range(len(sends))] for d in range(len(sends))]


def gather(xs, root=0):
    return [np.concatenate(xs, axis=0) if r == root else None for r in range(len(xs))]


def scatter(chunks, root=0):
    return list(chunks)
