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

import dataclasses

import numpy as np

from emulator.precision import down, up
from parallel.context.core import block_scores, heads, merge, probs_backward, visible


@dataclasses.dataclass(frozen=True)
class _Step:
    """The part of one block pair (this rank's queries, the keys of rank src) that sees
    anything: rows / cols as slices when they are a contiguous range (always, under the
    contiguous and zigzag tables: views instead of fancy-index copies), else index arrays;
    hidden (rows, cols) bool = masked entries of that part, None when it sees everything."""

    src: int
    rows: object  # slice | int array (Sq,)
    cols: object  # slice | int array (Sk,)
    n_rows: int
    n_cols: int
    seen: int  # visible entries (per batch, head)
    hidden: object  # None | (n_rows, n_cols) bool, read-only


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Every ring step of one rank under one positions table (C steps). An object, not a
    tuple: memory.saved_nbytes walks dicts, tuples and lists only, so the plan's index arrays
    are static metadata (like the positions table), not charged to the attention cache."""

    steps: tuple


_PLANS: dict = {}  # (rank, table shape, table bytes) -> _Plan; the table is the same per step
_MAX_PLANS = 64


def _index(idx: np.ndarray):
    """Sorted indices -> a slice when they form one contiguous range."""
    if idx.size and idx[-1] - idx[0] + 1 == idx.size:
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return idx


def _step(qpos, kpos, src: int) -> _Step:
    vis = visible(qpos, kpos)
    rows, cols = np.flatnonzero(vis.any(axis=1)), np.flatnonzero(vis.any(axis=0))
    part = vis[np.ix_(rows, cols)]
    hidden = None if part.all() else ~part
    if hidden is not None:
        hidden.flags.writeable = False  # shared by the ranks' threads through _PLANS
    return _Step(src, _index(rows), _index(cols), rows.size, cols.size, int(vis.sum()), hidden)


def plan(pos, r: int) -> _Plan:
    """Rank r's C ring steps under positions table pos (C, S_local); cached per table."""
    key = (r, pos.shape, pos.dtype.str, pos.tobytes())
    got = _PLANS.get(key)
    if got is None:
        C = pos.shape[0]
        got = _Plan(tuple(_step(pos[r], pos[(r - t) % C], (r - t) % C) for t in range(C)))
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = got
    return got


def _row_max(s):
    """s.max(axis=-1), by one np.maximum per key column while the rows are short (a ring
    block's 4-16 keys; NumPy's reduction over a short last axis costs ~3x that). A maximum is
    exact whatever the order, NaN propagates either way, and the sign a zero maximum could
    take does not reach any result (the maxima are only subtracted from scores and
    exponentiated, or added to log l)."""
    n = s.shape[-1]
    if n > _SHORT_ROW or n < 2:
        return s.max(axis=-1)
    m = np.maximum(s[..., 0], s[..., 1])
    for j in range(2, n):
        np.maximum(m, s[..., j], out=m)
    return m


_SHORT_ROW = 16  # keys per row up to which _row_max takes column maxima


def _pass_on(comm, arrays):
    """Send each array to rank r + 1 and receive the same shapes from r - 1."""
    C, r = comm.size, comm.rank
    out = []
    for a in arrays:
        a = np.ascontiguousarray(a)
        out.append(comm.sendrecv(a, (r + 1) % C, (r - 1) % C, shape=a.shape, dtype=a.dtype))
    return out


def _fresh(g, sl, shape, dtype):
    """A zero accumulator of ``shape`` with the block gradient ``g`` added at rows ``sl`` (axis
    2), without the zeros and the add when ``g`` fills it: g is a matmul's output - fresh,
    C-contiguous - and a matmul's sums start from +0.0, so they never yield -0.0 and 0.0 + g
    is g bitwise (the one x for which 0.0 + x differs from x is -0.0)."""
    if g.shape == shape and g.dtype == dtype:
        return g
    acc = np.zeros(shape, dtype)
    acc[:, :, sl] += g
    return acc


def ring_forward(comm, q, k, v, A, pos, *, keep_probs=True):
    """q, k, v (B, S_local, H) of rank r, positions table pos (C, S_local) -> (o, cache)."""
    r = comm.rank
    qh = heads(q, A)  # (B, A, S_local, D)
    steps = plan(pos, r).steps
    m = l = acc = None  # running row max, sum of exp(s - m), sum of exp(s - m) v (unnormalised)
    blocks, work, kb, vb = [], [], k, v
    with comm.collective("ring_attention", "ring", q, extra=f"forward, heads={A}"):
        for t, st in enumerate(steps):
            if t:  # the block used at step t - 1 moves on; the one of rank r - t arrives
                kb, vb = _pass_on(comm, (kb, vb))
            work.append((st.src, st.n_rows, st.n_cols, st.seen))  # per (batch, head); work.py
            if st.n_rows == 0:  # fully masked block pair: skipped
                blocks.append(None)
                continue
            rs, cs = st.rows, st.cols
            s = block_scores(qh[:, :, rs], heads(kb, A)[:, :, cs], st.hidden)
            # online-softmax merge (Liu et al. 2023, section 3, after Milakov & Gimelshein 2018;
            # the zigzag blocks: Brandon et al. 2023): rescale the old partial sums and the
            # block's to the new running max before adding them; lse = m + log l at the end
            m_blk = _row_max(s)  # (B, A, rows) finite: every computed row sees a key
            e = np.subtract(s, m_blk[..., None])
            np.exp(e, out=e)
            pv = e @ heads(vb, A)[:, :, cs]  # (B, A, rows, D)
            if t == 0:  # the own block: every query sees its own position, so every row is
                # here; merging into m = -inf, l = 0, acc = 0 is a_old = 0, a_blk = 1, i.e.
                # l = sum e and acc = 0 + pv, which is pv bitwise (_fresh)
                m, l, acc = m_blk, e.sum(axis=-1), pv
            else:
                m_old = m[..., rs]
                m_new = np.maximum(m_old, m_blk)
                a_old, a_blk = np.exp(m_old - m_new), np.exp(m_blk - m_new)  # exp(-inf) = 0
                lv, av = l[..., rs], acc[:, :, rs]  # views (slices) or copies (index arrays)
                lv *= a_old
                lv += e.sum(axis=-1) * a_blk
                av *= a_old[..., None]
                pv *= a_blk[..., None]
                av += pv
                if not isinstance(rs, slice):  # index arrays: lv, av are copies; write back
                    l[..., rs], acc[:, :, rs] = lv, av
                m[..., rs] = m_new
            blocks.append(s if keep_probs else None)
    lse = m + np.log(l)  # (B, A, S_local): log sum_j exp(s_ij) over every key of the sequence
    o = down(merge(acc / l[..., None]), q.dtype)  # (B, S_local, H)
    for st, (t, s) in zip(steps, enumerate(blocks)):  # scores -> probabilities over all keys
        if s is not None:
            s -= lse[..., st.rows, None]
            blocks[t] = down(np.exp(s, out=s), q.dtype)
    cache = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "A": A, "pos": pos, "probs": blocks}
    cache.update(comm=comm, keep=keep_probs, work=work, plan=_Plan(steps))
    return o, cache


def ring_backward(do, cache):
    """-> (dq, dk, dv), each (B, S_local, H). Accumulates in the arithmetic dtype."""
    comm, q, k, v, A = (cache[n] for n in ("comm", "q", "k", "v", "A"))
    C = comm.size
    qh, doh = heads(q, A), heads(do, A)
    delta = (doh * heads(cache["o"], A)).sum(axis=-1)  # (B, A, S_local) = rowsum(dO * O)
    # the accumulators, C-contiguous (B, A, S_local, D) - the layout of the matmuls' outputs
    # added into them and of the ring's messages: dq and the own block's dK/dV are born at
    # step 0, the travelling dK/dV of the block held now (dkb, dvb) at step 1, each as its
    # first block's gradients on zeros (_fresh); later steps add into them
    dq = own_dk = own_dv = dkb = dvb = None
    kb, vb, shape, adt = k, v, qh.shape, qh.dtype
    with comm.collective("ring_attention", "ring", q, extra=f"backward, heads={A}"):
        for t, st in enumerate(cache["plan"].steps):
            if t:  # K/V move on as in the forward; from step 2 the accumulators come with them
                kb, vb = _pass_on(comm, (kb, vb))
                if t >= 2:
                    dkb, dvb = _pass_on(comm, (dkb, dvb))
            if st.n_rows == 0:  # skipped: what is born here starts (and travels) empty
                if t == 0:
                    dq, own_dk, own_dv = (np.zeros(shape, adt) for _ in range(3))
                elif t == 1:
                    dkb, dvb = np.zeros(shape, adt), np.zeros(shape, adt)
                continue
            rs, cs = st.rows, st.cols
            kh, vh = heads(kb, A)[:, :, cs], heads(vb, A)[:, :, cs]
            p = cache["probs"][t]
            if p is None:  # recompute from q, the arriving K and the saved log-sum-exp
                s = block_scores(qh[:, :, rs], kh, st.hidden)
                s -= cache["lse"][..., rs, None]
                p = np.exp(s, out=s)
            # the blockwise backward (Liu et al. 2023, section 3 and appendix; Brandon et al.
            # 2023 for the zigzag blocks): dQ += dS K locally, dK/dV of the block that is here
            dq_b, dk_b, dv_b = probs_backward(up(p), qh[:, :, rs], kh, vh, doh[:, :, rs],
                                              delta[..., rs])  # fmt: skip
            if t == 0:
                dq, own_dk, own_dv = (_fresh(g, sl, shape, adt) for g, sl in
                                      ((dq_b, rs), (dk_b, cs), (dv_b, cs)))  # fmt: skip
                continue
            dq[:, :, rs] += dq_b
            if t == 1:
                dkb, dvb = _fresh(dk_b, cs, shape, adt), _fresh(dv_b, cs, shape, adt)
            else:
                dkb[:, :, cs] += dk_b
                dvb[:, :, cs] += dv_b
        if C > 1:  # after step C - 1 rank r holds the accumulators of rank r + 1: send them home
            dkb, dvb = _pass_on(comm, (dkb, dvb))
            own_dk += dkb
            own_dv += dvb
    dt = q.dtype
    return down(merge(dq), dt), down(merge(own_dk), dt), down(merge(own_dv), dt)
