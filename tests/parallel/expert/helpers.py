"""One expert-parallel MoE layer on P virtual ranks beside emulator/moe.py given the same groups.

The reference sees the concatenation of every rank's tokens, (P B, S, H), with rank r's routing
groups shifted by r B S: the same routing, so every number must agree (float64, ~1e-12).
"""

from __future__ import annotations

import numpy as np

import emulator
from emulator import moe
from parallel.expert.cost import kept_table, layer_bytes
from parallel.expert.layer import ep_moe_backward, ep_moe_forward, local_experts
from tests.emulator.fd_helpers import assert_close

TOL = {"rtol": 1e-12, "atol": 1e-12}
TAGS = ("fwd/counts", "fwd/dispatch", "fwd/combine", "bwd/combine", "bwd/dispatch")


def params(rng, H, F, E, hot=None, cold=None):
    """Random MoE params; `hot` / `cold` make one expert's router column dominate / lose
    (with positive inputs, see tokens())."""
    mp = {
        "router": rng.normal(size=(H, E)),
        "w1": rng.normal(size=(E, H, F)) * 0.5,
        "b1": rng.normal(size=(E, F)) * 0.1,
        "w2": rng.normal(size=(E, F, H)) * 0.5,
        "b2": rng.normal(size=(E, H)) * 0.1,
    }
    if hot is not None:
        mp["router"][:, hot] = 8.0
    if cold is not None:
        mp["router"][:, cold] = -8.0
    return mp


def rank_groups(B, S, n_groups):
    """n_groups interleaved routing groups of one rank's B S tokens (None for one group)."""
    if n_groups == 1:
        return None
    return [np.arange(g, B * S, n_groups) for g in range(n_groups)]


def case(P, E, K, cf, *, B=2, S=3, H=4, F=5, mode="exact", n_groups=1, seed=0, hot=None,
         cold=None, positive=False):  # fmt: skip
    """-> (ref, fn): the reference's (y, aux, dm, grads, routes per rank, mp) on the gathered
    groups, and fn(comm) running one rank of the ep layer (forward, backward, its ledger)."""
    rng = np.random.default_rng(seed)
    mp = params(rng, H, F, E, hot, cold)
    M = rng.normal(size=(P * B, S, H))
    if positive:
        M = np.abs(M) + 0.1
    dY, daux = rng.normal(size=M.shape), 0.37
    local = rank_groups(B, S, n_groups)
    mine = [np.arange(B * S)] if local is None else local
    groups = [g + r * B * S for r in range(P) for g in mine]
    y, aux, cache = moe.moe_forward(mp, M, groups, top_k=K, capacity_factor=cf)
    dm, grads = moe.moe_backward(dY, cache, daux)
    routes = [[c[1] for c in cache[0][r * len(mine) : (r + 1) * len(mine)]] for r in range(P)]

    def fn(comm):
        r, sl = comm.rank, slice(comm.rank * B, (comm.rank + 1) * B)
        mark = comm.ledger.mark()
        kw = {"top_k": K, "capacity_factor": cf, "dispatch": mode}
        yr, auxr, c = ep_moe_forward(comm, local_experts(mp, r, P), M[sl], local, **kw)
        dmr, g = ep_moe_backward(dY[sl], c, daux / P)  # this rank's share of the groups
        recs = comm.ledger.since(mark)
        led = {t: (comm.ledger.sent(recs, tag="ep/" + t), comm.ledger.received(recs, tag="ep/" + t))
               for t in TAGS}  # fmt: skip
        return yr, auxr, dmr, g, led, c["counts"]

    return (y, aux, dm, grads, routes, mp), fn


def run(P, E, K, cf, **kw):
    """-> (ref, out): the reference and every virtual rank's (y, aux, dm, grads, ledger, counts)."""
    ref, fn = case(P, E, K, cf, **kw)
    return ref, emulator.spawn(fn, P)


def check(ref, out, P):
    """Every output and gradient against the reference (experts: the local slices)."""
    y, aux, dm, grads, _, _ = ref
    assert_close("y", np.concatenate([o[0] for o in out]), y, **TOL)
    assert abs(np.mean([o[1] for o in out]) - aux) < 1e-12
    assert_close("dm", np.concatenate([o[2] for o in out]), dm, **TOL)
    for n in ("w1", "b1", "w2", "b2"):
        assert_close(n, np.concatenate([o[3][n] for o in out]), grads[n], **TOL)
    assert_close("router", sum(o[3]["router"] for o in out), grads["router"], **TOL)


def check_bytes(ref, out, mode, H=4, itemsize=8):
    """The ledger of every rank, per phase, against parallel/expert/cost.py from the reference's
    routing (its kept counts and capacities)."""
    routes, E = ref[4], ref[5]["router"].shape[1]
    kept = kept_table(routes, E)
    for r, o in enumerate(out):
        C = sum(rt["C"] for rt in routes[r])
        want = layer_bytes(mode, kept, C, H, itemsize, r)
        assert o[4] == want, f"rank {r} ({mode}): ledger {o[4]} != formula {want}"
