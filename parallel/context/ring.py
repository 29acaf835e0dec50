"""Ring attention: K and V blocks travel around the cp ring; queries, dQ and the softmax
statistics stay where they are (Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context", section 3).

Shape letters: B batch, A heads, S_local = S / C tokens per rank, D head dim, C cp ranks.

Forward, C steps on rank r: at step t it holds the K/V block of rank src = (r - t) mod C (step
0: its own), computes the attention of its queries on that block, and passes the block on to
r + 1 (C - 1 sendrecvs of K and V). Only the query rows and key columns that see anything are
computed (a fully masked block pair - a whole step under the contiguous layout, half a step
under zigzag - is skipped); the mask comes from the global positions of both blocks.

Backward (the same ring again): K/V blocks travel as in the forward; with each travels the
accumulator of its dK/dV, born on the rank after its owner at step 1, added to at each later
step and sent home after step C - 1 (C - 1 sendrecvs of dK and dV). dQ stays local. Its own
block's dK/dV (step 0) never leaves the rank.
What the backward reuses: keep_probs=True keeps every step's probability block (B, A, rows_t,
cols_t) from the forward (bytes: B A sum_t rows_t cols_t, work.py); keep_probs=False keeps only
the log-sum-exp (B, A, S_local) and recomputes each block's probabilities from q and the K block
that arrives again - the FlashAttention recomputation. Both keep q, k, v and o (cost.py).
"""

from __future__ import annotations

import numpy as np

from emulator.precision import down, up
from parallel.context.core import heads, merge, probs_backward, scores, visible


def _computed(qpos, kpos):
    """Rows (queries) and columns (keys) of a block pair that see anything: the block actually
    computed. Under zigzag this is exactly half of every block but the own one."""
    vis = visible(qpos, kpos)
    return np.flatnonzero(vis.any(axis=1)), np.flatnonzero(vis.any(axis=0)), int(vis.sum())


def _pass_on(comm, arrays):
    """Send each array to rank r + 1 and receive the same shapes from r - 1."""
    C, r = comm.size, comm.rank
    out = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        out.append(comm.sendrecv(a, (r + 1) % C, (r - 1) % C, shape=a.shape, dtype=a.dtype))
    return out


def ring_forward(comm, q, k, v, A, pos, *, keep_probs=True):
    """q, k, v (B, S_local, H) of rank r, positions table pos (C, S_local) -> (o, cache)."""
    C, r = comm.size, comm.rank
    qh, qpos = heads(q, A), pos[r]  # (B, A, S_local, D)
    B, _, S_l, _ = qh.shape
    m = np.full((B, A, S_l), -np.inf, qh.dtype)  # running row max
    l = np.zeros((B, A, S_l), qh.dtype)  # running sum of exp(s - m)
    acc = np.zeros_like(qh)  # running sum of exp(s - m) v, unnormalised (B, A, S_local, D)
    blocks, work, kb, vb = [], [], k, v
    with comm.collective("ring_attention", "ring", q, extra=f"forward, heads={A}"):
        for t in range(C):
            if t:  # the block used at step t - 1 moves on; the one of rank r - t arrives
                kb, vb = _pass_on(comm, (kb, vb))
            src = (r - t) % C
            rows, cols, seen = _computed(qpos, pos[src])
            work.append((src, rows.size, cols.size, seen))  # per (batch, head); work.py
            if rows.size == 0:  # fully masked block pair: skipped
                blocks.append(None)
                continue
            s = scores(qh[:, :, rows], heads(kb, A)[:, :, cols], qpos[rows], pos[src][cols])
            # online-softmax merge (Liu et al. 2023, section 3, after Milakov & Gimelshein 2018;
            # the zigzag blocks: Brandon et al. 2023): rescale the old partial sums and the
            # block's to the new running max before adding them; lse = m + log l at the end
            m_blk = s.max(axis=-1)  # (B, A, rows) finite: every computed row sees a key
            e = np.exp(s - m_blk[..., None])
            m_old = m[..., rows]
            m_new = np.maximum(m_old, m_blk)
            a_old, a_blk = np.exp(m_old - m_new), np.exp(m_blk - m_new)  # exp(-inf) = 0
            l[..., rows] = l[..., rows] * a_old + e.sum(axis=-1) * a_blk
            pv = e @ heads(vb, A)[:, :, cols]  # (B, A, rows, D)
            acc[:, :, rows] = acc[:, :, rows] * a_old[..., None] + pv * a_blk[..., None]
            m[..., rows] = m_new
            blocks.append(s if keep_probs else None)
    lse = m + np.log(l)  # (B, A, S_local): log sum_j exp(s_ij) over every key of the sequence
    o = down(merge(acc / l[..., None]), q.dtype)  # (B, S_local, H)
    for t, s in enumerate(blocks):  # kept scores -> probabilities normalised over all keys
        if s is not None:
            rows, _, _ = _computed(qpos, pos[(r - t) % C])
            s -= lse[..., rows, None]
            blocks[t] = down(np.exp(s, out=s), q.dtype)
    cache = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "A": A, "pos": pos, "probs": blocks}
    cache.update(comm=comm, keep=keep_probs, work=work)
    return o, cache


def ring_backward(do, cache):
    """-> (dq, dk, dv), each (B, S_local, H). Accumulates in the arithmetic dtype."""
    comm, q, k, v, A, pos = (cache[n] for n in ("comm", "q", "k", "v", "A", "pos"))
    C, r = comm.size, comm.rank
    qh, qpos, doh = heads(q, A), pos[r], heads(do, A)
    delta = (doh * heads(cache["o"], A)).sum(axis=-1)  # (B, A, S_local) = rowsum(dO * O)
    dq = np.zeros_like(qh)
    own_dk, own_dv = np.zeros_like(qh), np.zeros_like(qh)  # this rank's block, step 0
    dkb = dvb = None  # the travelling accumulators of the block held now
    kb, vb = k, v
    with comm.collective("ring_attention", "ring", q, extra=f"backward, heads={A}"):
        for t in range(C):
            if t:  # K/V move on as in the forward; from step 2 the accumulators come with them
                kb, vb = _pass_on(comm, (kb, vb))
                if t >= 2:
                    dkb, dvb = _pass_on(comm, (dkb, dvb))
                else:
                    dkb, dvb = np.zeros_like(qh), np.zeros_like(qh)
            src = (r - t) % C
            rows, cols, _ = _computed(qpos, pos[src])
            if rows.size == 0:
                continue
            kh, vh = heads(kb, A)[:, :, cols], heads(vb, A)[:, :, cols]
            p = cache["probs"][t]
            if p is None:  # recompute from q, the arriving K and the saved log-sum-exp
                s = scores(qh[:, :, rows], kh, qpos[rows], pos[src][cols])
                s -= cache["lse"][..., rows, None]
                p = np.exp(s, out=s)
            # the blockwise backward (Liu et al. 2023, section 3 and appendix; Brandon et al.
            # 2023 for the zigzag blocks): dQ += dS K locally, dK/dV of the block that is here
            dq_b, dk_b, dv_b = probs_backward(up(p), qh[:, :, rows], kh, vh, doh[:, :, rows],
                                              delta[..., rows])  # fmt: skip
            dq[:, :, rows] += dq_b
            gk, gv = (own_dk, own_dv) if t == 0 else (dkb, dvb)
            gk[:, :, cols] += dk_b
            gv[:, :, cols] += dv_b
        if C > 1:  # after step C - 1 rank r holds the accumulators of rank r + 1: send them home
            dkb, dvb = _pass_on(comm, (dkb, dvb))
            own_dk += dkb
            own_dv += dvb
    dt = q.dtype
    return down(merge(dq), dt), down(merge(own_dk), dt), down(merge(own_dv), dt)
