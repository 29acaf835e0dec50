"""The reference mixture-of-experts block on one rank (docs/model.md, "The MoE block").

Shape letters: N tokens of one routing group, H d_model, F d_ff, E experts, K experts per token,
C slots per expert. A "choice" is a (token, k) pair; choices are numbered choice-major,
i = k * N + t, which is exactly the order slots are filled in (every token's 1st choice, then
every token's 2nd, ...).

The block is split where expert parallelism cuts it (Lepikhin et al. 2020, GShard section 2.2):
    route -> dispatch -> [all-to-all] -> experts -> [all-to-all] -> combine
so a distributed layout reuses these functions and only adds the two all-to-alls.
"""

from __future__ import annotations

import math

import numpy as np

from emulator.ops import gelu_backward, gelu_forward, softmax
from emulator.precision import arith_dtype, down, up


def capacity(n_tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """C = ceil(capacity_factor * N * K / E) in Python floats, left to right; C = 0 is legal."""
    return math.ceil(capacity_factor * n_tokens * top_k / n_experts)


def route(u, router, top_k, capacity_factor):
    """u (N, H), router (H, E) -> a dict describing the routing of one group (also its cache).

    probs (N, E); topi (N, K) experts by stable (-prob, expert index); gates (N, K); and per
    choice (K*N,): expert, token, slot position, keep; f (E,) choice shares; aux (scalar).
    """
    N, E, K = u.shape[0], router.shape[1], top_k
    probs = softmax(up(u) @ up(router))  # (N, E), router arithmetic in fp32 or wider
    topi = np.argsort(-probs, axis=1, kind="stable")[
        :, :K
    ].copy()  # (N, K): ties -> lower index first
    psel = np.take_along_axis(probs, topi, axis=1)  # (N, K)
    gates = psel / psel.sum(axis=1, keepdims=True) if K > 1 else psel
    C = capacity(N, K, E, capacity_factor)
    expert = topi.T.flatten()  # (K*N,) choice-major (a copy)
    token = np.tile(np.arange(N), K)  # (K*N,)
    counts = np.bincount(expert, minlength=E)  # choices per expert, before dropping
    order = np.argsort(expert, kind="stable")  # groups choices by expert, keeps fill order
    starts = np.cumsum(counts) - counts
    pos = np.empty_like(expert)
    pos[order] = np.arange(K * N) - starts[expert[order]]  # slot index within the expert
    keep = pos < C
    f = (counts / (N * K)).astype(probs.dtype)  # (E,) constants of the backward
    aux = E * float(np.dot(f, probs.mean(axis=0)))  # Switch Transformer eq. 4 (Fedus et al.)
    return {
        "u": u, "router": router, "probs": probs, "topi": topi, "gates": gates,
        "C": C, "E": E, "K": K, "expert": expert, "token": token, "pos": pos,
        "keep": keep, "f": f, "aux": aux,
    }  # fmt: skip


def route_backward(dgates, daux, r):
    """dgates (N, K), daux scalar -> (du (N, H), drouter (H, E)); top-k/dropping are constants."""
    probs, topi, u, router = r["probs"], r["topi"], r["u"], r["router"]
    N, E = probs.shape
    if r["K"] > 1:  # g_j = p_j / s, s = sum_i p_i  ->  dp_j = (dg_j - sum_i dg_i g_i) / s
        s = np.take_along_axis(probs, topi, axis=1).sum(axis=1, keepdims=True)
        dpsel = (dgates - (dgates * r["gates"]).sum(axis=1, keepdims=True)) / s
    else:
        dpsel = dgates
    dprobs = np.zeros_like(probs)
    np.put_along_axis(dprobs, topi, dpsel, axis=1)  # the K experts of a row are distinct
    dprobs += (daux * E / N) * r["f"]  # aux = E sum_e f_e mean_t probs[t, e]
    dlogits = probs * (dprobs - (dprobs * probs).sum(axis=1, keepdims=True))  # (N, E)
    drouter = down(up(u).T @ dlogits, router.dtype)
    du = down(dlogits @ up(router).T, u.dtype)
    return du, drouter


def dispatch(u, r):
    """u (N, H) -> buf (E, C, H): each kept choice copies its token into its expert's slot."""
    k = r["keep"]
    buf = np.zeros((r["E"], r["C"], u.shape[1]), u.dtype)
    buf[r["expert"][k], r["pos"][k]] = u[r["token"][k]]
    return buf


def dispatch_backward(dbuf, r):
    """dbuf (E, C, H) -> du (N, H), summing a token's K choices in choice order."""
    k, K = r["keep"], r["K"]
    tmp = np.zeros((r["expert"].size, dbuf.shape[2]), arith_dtype(dbuf.dtype))  # (K*N, H)
    tmp[k] = dbuf[r["expert"][k], r["pos"][k]]
    return down(tmp.reshape(K, -1, dbuf.shape[2]).sum(axis=0), dbuf.dtype)


def experts_forward(buf, w1, b1, w2, b2):
    """buf (E, C, H); w1 (E, H, F), b1 (E, F), w2 (E, F, H), b2 (E, H) -> out (E, C, H)."""
    z = down(up(buf) @ up(w1) + up(b1)[:, None, :], buf.dtype)  # (E, C, F)
    h, _ = gelu_forward(z)
    out = down(up(h) @ up(w2) + up(b2)[:, None, :], buf.dtype)  # (E, C, H)
    return out, (buf, z, h, w1, w2)


def experts_backward(dout, cache):
    """-> (dbuf, dw1, db1, dw2, db2). Empty slots have dout = 0 and so contribute nothing."""
    buf, z, h, w1, w2 = cache
    d = up(dout)
    dw2 = down(up(h).transpose(0, 2, 1) @ d, w2.dtype)  # (E, F, H)
    db2 = down(d.sum(axis=1), w2.dtype)
    dz = up(gelu_backward(down(d @ up(w2).transpose(0, 2, 1), z.dtype), z))  # (E, C, F)
    dw1 = down(up(buf).transpose(0, 2, 1) @ dz, w1.dtype)  # (E, H, F)
    db1 = down(dz.sum(axis=1), w1.dtype)
    dbuf = down(dz @ up(w1).transpose(0, 2, 1), buf.dtype)  # (E, C, H)
    return dbuf, dw1, db1, dw2, db2


def combine(out, r):
    """out (E, C, H) -> y (N, H) = sum over kept choices of gate * expert output."""
    k, K = r["keep"], r["K"]
    g = r["gates"].T.reshape(-1)  # (K*N,) choice-major like expert/pos
    tmp = np.zeros((g.size, out.shape[2]), r["gates"].dtype)
    tmp[k] = up(out[r["expert"][k], r["pos"][k]]) * g[k, None]
    return down(tmp.reshape(K, -1, out.shape[2]).sum(axis=0), out.dtype)


def combine_backward(dy, out, r):
    """dy (N, H) -> (dout (E, C, H), dgates (N, K))."""
    k, K = r["keep"], r["K"]
    e, p, t = r["expert"][k], r["pos"][k], r["token"][k]
    g = r["gates"].T.reshape(-1)
    d = up(dy)
    dout = np.zeros(out.shape, d.dtype)
    dout[e, p] = g[k, None] * d[t]
    dg = np.zeros(g.size, g.dtype)
    dg[k] = (up(out[e, p]) * d[t]).sum(axis=1)
    return down(dout, out.dtype), dg.reshape(K, -1).T


def check_groups(groups, n_tokens):
    """Routing groups must partition 0..N-1 (each token in exactly one non-empty group)."""
    groups = [np.asarray(g) for g in groups]
    if not groups or any(g.ndim != 1 or g.size == 0 for g in groups):
        raise ValueError("routing groups must be a non-empty list of non-empty 1-D index arrays")
    allidx = np.concatenate(groups)
    if allidx.dtype.kind not in "iu" or not np.array_equal(np.sort(allidx), np.arange(n_tokens)):
        raise ValueError(f"routing groups must partition the flat token indices 0..{n_tokens - 1}")
    return groups


def moe_forward(mp, m, groups, *, top_k, capacity_factor):
    """mp: local names router, w1, b1, w2, b2; m (B, S, H) -> (y (B, S, H), aux, cache).

    aux is the unweighted mean of the groups' aux losses (one group of all tokens if None).
    """
    B, S, H = m.shape
    groups = check_groups([np.arange(B * S)] if groups is None else groups, B * S)
    flat = m.reshape(B * S, H)
    y = np.empty_like(flat)
    caches = []
    for idx in groups:  # loop over routing groups, not tokens
        r = route(flat[idx], mp["router"], top_k, capacity_factor)
        out, ecache = experts_forward(dispatch(r["u"], r), mp["w1"], mp["b1"], mp["w2"], mp["b2"])
        y[idx] = combine(out, r)
        caches.append((idx, r, out, ecache))
    aux = sum(c[1]["aux"] for c in caches) / len(caches)
    return y.reshape(B, S, H), aux, (caches, m.shape, m.dtype, mp)


def moe_backward(dy, cache, daux):
    """dy (B, S, H), daux = dloss/daux -> (dm (B, S, H), dmp with local names)."""
    caches, shape, dtype, mp = cache
    dflat = dy.reshape(-1, shape[2])
    dm = np.zeros((dflat.shape[0], shape[2]), dtype)
    grads = {n: np.zeros(mp[n].shape, arith_dtype(mp[n].dtype)) for n in mp}
    for idx, r, out, ecache in caches:
        dout, dgates = combine_backward(dflat[idx], out, r)
        dbuf, *dexp = experts_backward(dout, ecache)
        du_r, drouter = route_backward(dgates, daux / len(caches), r)
        dm[idx] = down(up(dispatch_backward(dbuf, r)) + up(du_r), dtype)
        for n, g in zip(("w1", "b1", "w2", "b2", "router"), (*dexp, drouter)):
            grads[n] += up(g)
    return dm.reshape(shape), {n: down(g, mp[n].dtype) for n, g in grads.items()}
