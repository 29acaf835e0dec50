"""An MoE block under tensor parallelism: every expert's FFN is split as the dense MLP is.

Shape letters: B batch, S sequence, H d_model, F d_ff, E experts, K top-k, C slots per expert,
N tokens of a routing group, R the tp group size.

Each rank holds, for every expert e, the column block w1[e][:, r] (H, F/R), b1[e][r] and the row
block w2[e][r, :] (F/R, H) (Shoeybi et al. 2019, section 3, applied per expert); the router is
replicated. Routing, dispatch and the aux loss run identically on every rank from the full
(all-gathered under SP) input, so no rank ever needs another's routing decision. The expert
outputs (E, C, H) are partial sums over ranks; ``combine`` is linear in them, so the block's
output is one partial (B, S, H) summed by the same g as the dense MLP (the caller's ``leave``).

Two consequences, both handled here and counted in parallel/tensor/cost.py:
- b2 sits inside the gate-weighted combine, so "add the bias once" is done by adding it on tp
  rank 0 only, before the sum (its gradient does not depend on where it was added: replicated).
- The gates multiply partial expert outputs, so dL/dgates is partial: one all-reduce of the
  (B*S*K,) gate gradients per MoE block in the backward, before the router's backward.
The f of the block input (all-reduce, or reduce-scatter under SP) applies only to the experts'
share of dL/dm; the router's share is already complete on every rank (the caller adds it after).
"""

from __future__ import annotations

import numpy as np

from collectives.api import all_reduce
from emulator import scope
from emulator.moe import (
    check_groups,
    combine,
    combine_backward,
    dispatch,
    dispatch_backward,
    experts_backward,
    experts_forward,
    route,
    route_backward,
)
from emulator.precision import arith_dtype, down, up


def tp_moe_forward(tp, bp, m, cfg, groups):
    """m (B, S, H) full on every rank -> (y partial (B, S, H), aux, cache)."""
    B, S, H = m.shape
    groups = check_groups([np.arange(B * S)] if groups is None else groups, B * S)
    flat = m.reshape(B * S, H)
    b2 = bp["moe.b2"] if tp.rank == 0 else np.zeros_like(bp["moe.b2"])  # added once
    w = (bp["moe.w1"], bp["moe.b1"], bp["moe.w2"], b2)  # (E,H,F/R) (E,F/R) (E,F/R,H) (E,H)
    y = np.empty_like(flat)
    caches = []
    for idx in groups:  # loop over routing groups, not tokens
        r = route(flat[idx], bp["moe.router"], cfg.moe_top_k, cfg.capacity_factor)
        out, ecache = experts_forward(dispatch(r["u"], r), *w)  # (E, C, H) partial
        y[idx] = combine(out, r)  # (N, H) partial
        caches.append((idx, r, out, ecache))
    aux = sum(c[1]["aux"] for c in caches) / len(caches)
    return y.reshape(B, S, H), aux, {"groups": caches, "shape": m.shape, "dtype": m.dtype}


def tp_moe_backward(tp, dy, cache, daux, bp):
    """dy (B, S, H) full -> (dm_experts partial (B, S, H), dm_router full (B, S, H), grads)."""
    shape, dtype = cache["shape"], cache["dtype"]
    dflat = dy.reshape(-1, shape[2])
    dm_exp = np.zeros((dflat.shape[0], shape[2]), dtype)  # (B*S, H) partial
    dm_rt = np.zeros_like(dm_exp)  # (B*S, H) complete on every rank
    names = ("moe.w1", "moe.b1", "moe.w2", "moe.b2", "moe.router")
    acc = {n: np.zeros(bp[n].shape, arith_dtype(bp[n].dtype)) for n in names}
    dgates = []
    for idx, r, out, ecache in cache["groups"]:
        dout, dg = combine_backward(dflat[idx], out, r)  # dg (N, K) partial: out is partial
        dbuf, *dexp = experts_backward(dout, ecache)
        dm_exp[idx] = dispatch_backward(dbuf, r)
        for n, d in zip(names, dexp):
            acc[n] += up(d)
        dgates.append(dg)
    sizes = [d.size for d in dgates]
    with scope("gates"):  # (sum over groups of N K,) partial -> complete on every rank
        total = all_reduce(tp, np.concatenate([d.reshape(-1) for d in dgates]), algorithm="ring")
    n_groups, off = len(cache["groups"]), 0
    for (idx, r, _, _), k, dg in zip(cache["groups"], sizes, dgates):
        du, drouter = route_backward(total[off : off + k].reshape(dg.shape), daux / n_groups, r)
        dm_rt[idx] = du
        acc["moe.router"] += up(drouter)
        off += k
    grads = {n: down(a, bp[n].dtype) for n, a in acc.items()}
    return dm_exp.reshape(shape), dm_rt.reshape(shape), grads
