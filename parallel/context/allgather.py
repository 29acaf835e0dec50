"""All-gather K/V context parallelism (Llama 3: Dubey et al. 2024, "The Llama 3 Herd of Models",
section 3.3.2): all-gather the K and V of the whole sequence before attention, compute the local
queries' attention on it, and reduce-scatter dK and dV back to their owners after.

Shape letters: B batch, A heads, S_local = S / C, S = global sequence, H = A D, C cp ranks.

Gathered rows are in rank order (rank j's S_local tokens at rows j S_local ...), so the mask comes
from the flattened positions table. The forward keeps the gathered K and V for the backward (2 C
blocks of memory, no second gather); keep_probs=False drops the (B, A, S_local, S) probabilities
and the backward recomputes them from q and the kept K.
"""

from __future__ import annotations

from collectives import all_gather, reduce_scatter
from emulator.precision import down, up
from parallel.context.core import heads, merge, probs_backward, scores, softmax_rows


def _gather(comm, x):
    """(B, S_local, H) on every rank -> (B, S, H) in rank order; one ring all-gather."""
    return all_gather(comm, x, axis=1)  # (B, S, H), contiguous: no transposed copies


def _reduce_scatter(comm, g):
    """(B, S, H) partial sums on every rank -> this rank's (B, S_local, H) rows, summed."""
    return reduce_scatter(comm, g, axis=1)  # (B, S_local, H), contiguous


def _probs(cache):
    qh, kh, pos, r = heads(cache["q"], cache["A"]), heads(cache["kg"], cache["A"]), *cache["pos"]
    return softmax_rows(scores(qh, kh, pos[r], pos.reshape(-1)))  # (B, A, S_local, S)


def allgather_forward(comm, q, k, v, A, pos, *, keep_probs=True):
    """q, k, v (B, S_local, H) of rank r, positions table pos (C, S_local) -> (o, cache)."""
    kg, vg = _gather(comm, k), _gather(comm, v)  # (B, S, H) each
    cache = {"q": q, "kg": kg, "vg": vg, "A": A, "pos": (pos, comm.rank), "comm": comm}
    p = _probs(cache)  # every row sees at least its own position
    o = down(merge(p @ heads(vg, A)), q.dtype)  # (B, S_local, H)
    cache["p"] = down(p, q.dtype) if keep_probs else None
    return o, cache


def allgather_backward(do, cache):
    """-> (dq, dk, dv), each (B, S_local, H)."""
    comm, q, A = cache["comm"], cache["q"], cache["A"]
    p = _probs(cache) if cache["p"] is None else up(cache["p"])
    qh, kh, vh = heads(q, A), heads(cache["kg"], A), heads(cache["vg"], A)
    dq, dkg, dvg = probs_backward(p, qh, kh, vh, heads(do, A))  # dk, dv over all S keys
    dk = _reduce_scatter(comm, merge(dkg))  # every rank's queries contributed to every key
    dv = _reduce_scatter(comm, merge(dvg))
    dt = q.dtype
    return down(merge(dq), dt), down(dk, dt), down(dv, dt)
