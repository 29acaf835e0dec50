"""Global-norm gradient clipping for every layout: one norm, one coefficient, one arithmetic.

torch.nn.utils.clip_grad_norm_ (and emulator.optim.clip_grad_norm, the reference) scales every
gradient by coef = min(1, max_norm / (total + 1e-6)), total = sqrt(sum of squares of the WHOLE
model's gradient). A layout holds only part of that gradient on each rank (a ZeRO shard, a TP
shard, a pipeline stage), so the total is a reduction across ranks (ZeRO paper, Rajbhandari et
al. 2020, section 5: the norm of a partitioned gradient; Megatron-LM, Shoeybi et al. 2019,
section 3: the norm is all-reduced over the model-parallel group):

    local  = sum over this rank's elements of w_name * g^2     (float64; w = 1 unless replicated)
    total  = local, all-reduced (sum, ring) over groups[0], then groups[1], ...
    norm   = sqrt(total);   coef = clip_coefficient(norm, max_norm)   (1.0 when max_norm is None)
    g     <- down(up(g) * coef)     only when coef < 1 (the reference's arithmetic)

**The order is fixed and documented:** the groups are reduced in the order passed, by
convention data-parallel first, then the model-parallel axes (tp, then pp). Every rank passes
the same tuple, and after each ring all-reduce every rank of the group holds the same bits, so
all ranks of the mesh get one identical norm (and coef): the replicas can never drift apart.
A group of size 1 (or None) is skipped; an empty tuple is the single-rank norm.

**Weights:** a gradient replicated over R ranks of a reduced group (a LayerNorm gain under TP,
held whole on every tp rank) would be counted R times; weight 1/R counts it once. Gradients
replicated over a group you do NOT reduce over (DDP's summed gradient over dp) need no weight:
leave that group out. The norm's traffic is tagged `tag` (callers: "dp/clip", "clip").
"""

from __future__ import annotations

import math

import numpy as np

from collectives import all_reduce
from emulator import scope
from emulator.optim import clip_coefficient
from emulator.precision import down, up


def local_norm_sq(grads, weights=None) -> float:
    """This rank's sum of squares in float64. `grads`: {name: array} (then `weights`
    {name: w}, missing names weigh 1) or an iterable of arrays (no weights)."""
    items = grads.items() if isinstance(grads, dict) else ((None, g) for g in grads)
    total = 0.0
    for name, g in items:
        flat = np.asarray(g, dtype=np.float64).reshape(-1)
        sq = float(np.dot(flat, flat))
        total += sq if not weights or name is None else weights.get(name, 1.0) * sq
    return total


def global_grad_norm(local, groups=(), *, max_norm=None, weights=None, tag="clip"):
    """-> (total_norm, coef). `local`: this rank's (already weighted) sum of squares, or its
    gradients as {name: array} (weighted by `weights`). Collective over every group given."""
    if max_norm is not None and not max_norm > 0:
        raise ValueError(f"max_norm must be > 0 (or None: no clipping), got {max_norm}")
    sq = local if isinstance(local, (int, float, np.floating)) else local_norm_sq(local, weights)
    total = np.array([float(sq)], dtype=np.float64)  # (1,)
    with scope(tag):
        for g in groups:
            if g is not None and g.size > 1:
                total = all_reduce(g, total, op="sum", algorithm="ring")
    norm = math.sqrt(float(total[0]))
    return norm, 1.0 if max_norm is None else clip_coefficient(norm, max_norm)


def scale_(grads, coef: float) -> None:
    """In place: g <- down(up(g) * coef) for every gradient (dict values or arrays) if coef < 1."""
    if coef < 1.0:
        for g in grads.values() if isinstance(grads, dict) else grads:
            g[...] = down(up(g) * coef, g.dtype)


def clip_(grads, max_norm, groups=(), *, weights=None, tag="clip"):
    """global_grad_norm + scale_ on {name: grad}: -> (norm before clipping, coef)."""
    norm, coef = global_grad_norm(grads, groups, max_norm=max_norm, weights=weights, tag=tag)
    scale_(grads, coef)
    return norm, coef


def clip_and_step(opt, master, grads, groups=(), *, max_norm=None, weights=None, tag="clip"):
    """The global norm of `grads`, then AdamW on `master` with the clipped gradients (copied
    only when they are clipped, so the caller's `grads` stay the unclipped ones). -> the norm."""
    norm, coef = global_grad_norm(grads, groups, max_norm=max_norm, weights=weights, tag=tag)
    step = grads if coef >= 1.0 else {n: g.copy() for n, g in grads.items()}
    scale_(step, coef)
    opt.step(master, step)
    return norm
