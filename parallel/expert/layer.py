"""The MoE block under expert parallelism: a drop-in for emulator/moe.py's moe_forward / backward.

Shape letters: B, S this rank's micro-batch, H d_model, F d_ff, E experts, K top-k, P the ep
group size, El = E / P experts per rank, N tokens of a routing group, C_g its slots per expert.

Rank r of the ep group holds the replicated router (H, E) and its experts r El .. (r+1) El - 1:
w1 (El, H, F), b1 (El, F), w2 (El, F, H), b2 (El, H) (``mp_local``, the block's local names).
Each rank routes its OWN tokens, group by group, with emulator/moe.py's ``route`` (top-K, the
capacity C_g = ceil(cf N K / E) of that group, choice-major slot filling, dropping) - capacity is
per routing group, i.e. per sending rank, as in Megatron-core and DeepSpeed - and ``dispatch``
fills the group's (E, C_g, H) buffer. Then (GShard section 2.2; parallel/expert/dispatch.py):
  forward   [counts: exact only] -> rows to the experts' owners -> local experts on what arrived
            -> outputs back -> ``combine`` with the gates in the original token order
  backward  combine_backward -> dout rows to the owners -> experts_backward -> dx rows back
            -> dispatch_backward + route_backward (top-K and dropping are constants)
Ledger tags: ep/fwd/{counts,dispatch,combine}, ep/bwd/{combine,dispatch} (the backward's
"combine" carries dL/d(expert output) to the experts, its "dispatch" dL/d(expert input) back).

What comes out is the reference's, given the same routing groups: y and aux (the mean over this
rank's groups, as moe_forward), dm, the router gradient of this rank's tokens (sum it over the
ranks that routed, as data parallelism does) and the COMPLETE gradient of the local experts (every
ep rank's tokens already contributed; sum it only over ranks holding the same experts).
"""

from __future__ import annotations

import numpy as np

from emulator import scope
from emulator.moe import (
    check_groups,
    combine,
    combine_backward,
    dispatch_backward,
    experts_backward,
    experts_forward,
    route,
    route_backward,
)
from emulator.moe import dispatch as fill_buffer
from emulator.precision import arith_dtype, down, up
from parallel.expert import dispatch as dx

EXPERT_NAMES = ("w1", "b1", "w2", "b2")


def check_ep(E: int, P: int, top_k: int, mp_local=None) -> int:
    """-> El = E / P, or a ValueError saying what to change."""
    if E % P:
        raise ValueError(
            f"expert parallelism: E={E} experts do not split over ep={P} ranks; choose ep "
            f"dividing E (e.g. {[d for d in range(1, E + 1) if E % d == 0]}) or another E"
        )
    if not 1 <= top_k <= E:
        raise ValueError(f"expert parallelism: top_k={top_k} must lie in 1..E={E}")
    El = E // P
    for n in EXPERT_NAMES if mp_local is not None else ():
        if mp_local[n].shape[0] != El:
            raise ValueError(
                f"expert parallelism: local {n} has {mp_local[n].shape[0]} experts on axis 0; "
                f"rank's share of E={E} over ep={P} is El={El} (experts r*El .. (r+1)*El-1)"
            )
    return El


def local_experts(mp, rank: int, P: int) -> dict:
    """The full block's MoE params (router, w1 (E, ...), ...) -> rank's share (copies)."""
    El = check_ep(mp["router"].shape[1], P, 1)
    sl = slice(rank * El, (rank + 1) * El)
    return {n: (a.copy() if n == "router" else a[sl].copy()) for n, a in mp.items()}


def ep_moe_forward(ep, mp_local, m, groups, *, top_k, capacity_factor, dispatch="exact",
                   prefix="ep/"):  # fmt: skip
    """m (B, S, H) this rank's tokens -> (y (B, S, H), aux, cache); ``ep`` the ep group's Comm.
    ``prefix``: of the phase scopes "<prefix>fwd" / "<prefix>bwd" (parallel/expert/nd.py opens
    "ep/<layer>/mb<j>" itself and passes "")."""
    if dispatch not in dx.MODES:
        raise ValueError(f"dispatch={dispatch!r} must be one of {dx.MODES}")
    B, S, H = m.shape
    E, P = mp_local["router"].shape[1], ep.size
    El = check_ep(E, P, top_k, mp_local)
    # None: one group of every token in order, a partition already (check_groups would return
    # it as is), whose results need no scatter into the token order (y = combine's, not y[idx])
    whole = groups is None
    groups = [np.arange(B * S)] if whole else check_groups(groups, B * S)
    flat = m.reshape(B * S, H)
    routes = [route(flat[idx], mp_local["router"], top_k, capacity_factor) for idx in groups]
    bufs = [fill_buffer(r["u"], r) for r in routes]  # G x (E, C_g, H)
    n = dx.rows_table(routes, E, dispatch)  # (G, E) rows sent per group and expert
    per_e = n.sum(axis=0).tolist()  # rows for each expert, over the groups (exact integers)
    send_rows = [sum(per_e[d * El : (d + 1) * El]) for d in range(P)]
    sends = dx.pack(bufs, n, P)
    w = [mp_local[k] for k in EXPERT_NAMES]
    with scope(f"{prefix}fwd"):
        if dispatch == "exact":
            counts = dx.announce(ep, dx.expert_counts(n), sends)  # (P, El)
        else:  # every source sends sum_g C_g per expert (all_to_all checks the ranks agree)
            counts = np.full((P, El), int(n[:, 0].sum()), np.int64)
        recv_rows = counts.sum(axis=1).tolist()
        xs = dx.by_expert(
            dx.exchange(ep, sends, send_rows, recv_rows, dispatch, "dispatch"), counts
        )
        outs, ecaches = [], []
        for e in range(El):  # the local experts on what arrived (rows of every source)
            o, c = experts_forward(xs[e][None], *(a[e : e + 1] for a in w))  # (1, rows_e, H)
            outs.append(o[0])
            ecaches.append(c)
        back = dx.exchange(
            ep, dx.to_sources(outs, counts), recv_rows, send_rows, dispatch, "combine"
        )
    outb = dx.unpack(back, n, P, [b.shape for b in bufs], m.dtype)  # G x (E, C_g, H)
    if whole:
        y = combine(outb[0], routes[0])
    else:
        y = np.empty_like(flat)
        for idx, r, o in zip(groups, routes, outb):
            y[idx] = combine(o, r)
    aux = sum(r["aux"] for r in routes) / len(routes)
    cache = {
        "ep": ep, "mode": dispatch, "groups": groups, "routes": routes, "outb": outb, "n": n,
        "counts": counts, "send_rows": send_rows, "recv_rows": recv_rows, "ecaches": ecaches,
        "shape": m.shape, "dtype": m.dtype, "mp": mp_local, "prefix": prefix, "whole": whole,
    }  # fmt: skip
    return y.reshape(B, S, H), aux, cache


def ep_moe_backward(dy, cache, daux):
    """dy (B, S, H), daux = dloss/daux -> (dm (B, S, H), dmp_local: router + the local experts)."""
    c = cache
    ep, mode, n, counts, mp = c["ep"], c["mode"], c["n"], c["counts"], c["mp"]
    shape, dtype, P = c["shape"], c["dtype"], ep.size
    dflat = dy.reshape(-1, shape[2])
    pairs = [
        combine_backward(dflat[i], o, r) for i, r, o in zip(c["groups"], c["routes"], c["outb"])
    ]
    grads = {k: [] for k in EXPERT_NAMES}
    with scope(f"{c.get('prefix', 'ep/')}bwd"):
        sends = dx.pack([p[0] for p in pairs], n, P)
        recv = dx.exchange(ep, sends, c["send_rows"], c["recv_rows"], mode, "combine")
        dxs = []
        for e, (dout, ec) in enumerate(zip(dx.by_expert(recv, counts), c["ecaches"])):
            dbuf, *dw = experts_backward(dout[None], ec)
            dxs.append(dbuf[0])
            for k, d in zip(EXPERT_NAMES, dw):
                grads[k].append(d)
        back = dx.exchange(ep, dx.to_sources(dxs, counts), c["recv_rows"], c["send_rows"], mode,
                           "dispatch")  # fmt: skip
    dbufs = dx.unpack(back, n, P, [o.shape for o in c["outb"]], dtype)
    dm = None if c["whole"] else np.zeros((dflat.shape[0], shape[2]), dtype)
    drouter = np.zeros(mp["router"].shape, arith_dtype(mp["router"].dtype))
    for idx, r, dbuf, (_, dgates) in zip(c["groups"], c["routes"], dbufs, pairs):
        du_r, dr = route_backward(dgates, daux / len(c["routes"]), r)
        du = down(up(dispatch_backward(dbuf, r)) + up(du_r), dtype)
        if dm is None:  # the one group of every token, in order
            dm = du
        else:
            dm[idx] = du
        drouter += up(dr)
    # (El, ...) each; one local expert: its gradient as experts_backward returned it (fresh)
    out = {k: g[0] if len(g) == 1 else np.concatenate(g, axis=0) for k, g in grads.items()}
    out["router"] = down(drouter, mp["router"].dtype)
    return dm.reshape(shape), {k: out[k] for k in mp}
