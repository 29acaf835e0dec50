"""Vocabulary-parallel embedding and cross-entropy (Shoeybi et al. 2019, section 3, last part).

Shape letters: B batch, S sequence, S_l = S or S/R under SP, H d_model, V vocab, R the tp group
size, N = B*S tokens. Rank r owns the vocabulary ids r*V/R .. (r+1)*V/R - 1: rows of embed.tok
(V/R, H) and columns of head.w (H, V/R).

Embedding: each rank looks up the ids it owns (zero rows for the others); the partial (B, S, H)
is summed by g (an all-reduce; a reduce-scatter along the sequence under SP), then the
replicated position table is added once.

Cross-entropy over the column-split logits (B, S, V/R), never gathered on one rank:
    M_t   = all-reduce max over ranks of the local max      (N,)  only for stability
    Z_t   = all-reduce sum of  sum_j exp(l_tj - M_t)         (N,)  \\ stacked into one (2, N)
    l_t*  = all-reduce sum of the target's logit - M_t       (N,)  / all-reduce
    loss_t = log Z_t - (l_t* - M_t)
and the backward is local: dlogits = (exp(l - M) / Z - onehot) * dloss.
"""

from __future__ import annotations

import numpy as np

from collectives.api import all_reduce
from emulator.ops import layernorm_backward, layernorm_forward, linear_backward, linear_forward
from emulator.precision import arith_dtype, down, up
from parallel.tensor.block import enter, enter_backward, leave, leave_backward
from parallel.tensor.sequence import seq_slice


def _owned(ids, start, n):
    """ids - start, the mask of ids this rank owns, and safe local indices (0 elsewhere)."""
    local = ids - start
    mine = (local >= 0) & (local < n)
    return np.where(mine, local, 0), mine


def vocab_embedding_forward(tp, tokens, tok, pos, *, sp=False, positions=None):
    """tokens (B, S) full; tok (V/R, H) this rank's rows; pos (T, H) -> x (B, S_l, H), cache.
    positions (S,): the columns' global positions (context parallelism; None = 0..S-1); under
    SP this rank adds the rows of its S/R slice of them (parallel/context/layout.sp_table)."""
    S = tokens.shape[1]
    local, mine = _owned(tokens, tp.rank * tok.shape[0], tok.shape[0])
    part = tok[local]  # (B, S, H)
    part[~mine] = 0  # ids another rank owns contribute nothing here
    x = leave(tp, part, sp)  # g: the sum over ranks has exactly one non-zero term per token
    s = seq_slice(S, tp.size, tp.rank) if sp else slice(0, S)  # this rank's local columns
    if positions is not None:  # cp: the global positions of the columns, cut by SP as they are
        s = np.asarray(positions)[s]  # distinct rows: dpos[s] = ... below is exact
    rows = pos[s]  # (S_l, H)
    if x.flags.writeable and x.dtype == rows.dtype == arith_dtype(x.dtype):
        x += rows  # the collective's fresh output, nothing cast: x + rows in its buffer
    else:
        x = down(up(x) + up(rows), tok.dtype)
    return x, (local, mine, tok.shape, pos.shape, s, sp, tok.dtype)


def vocab_embedding_backward(tp, dx, cache):
    """dx (B, S_l, H) -> (dtok (V/R, H), dpos (T, H)); dpos is partial under SP."""
    local, mine, tok_shape, pos_shape, s, sp, dtype = cache
    d = up(leave_backward(tp, dx, sp))  # g^T: identity (all-gather under SP)  (B, S, H)
    dtok = np.zeros(tok_shape, d.dtype)
    np.add.at(dtok, local[mine], d[mine])  # repeated ids accumulate, in token order
    dpos = np.zeros(pos_shape, d.dtype)
    dpos[s] = up(dx).sum(axis=0)
    return down(dtok, dtype), down(dpos, dtype)


def vocab_ce_sum_forward(tp, logits, targets):
    """logits (B, S, V/R) local columns, targets (B, S) -> (sum of losses, count, cache)."""
    Vl = logits.shape[-1]
    z = up(logits).reshape(-1, Vl)  # (N, V/R)
    M = all_reduce(tp, z.max(axis=-1), op="max", algorithm="ring")  # (N,)
    z = z - M[:, None]
    t, mine = _owned(targets.reshape(-1), tp.rank * Vl, Vl)
    picked = np.where(mine, z[np.arange(t.size), t], 0.0)  # (N,) the target's shifted logit
    e = np.exp(z, out=z)  # exp(l - M) in z's buffer, once z[t] is taken
    sums = all_reduce(tp, np.stack([e.sum(axis=-1), picked]), algorithm="ring")  # (2, N)
    total = (np.log(sums[0]) - sums[1]).sum()
    # the backward's exp(l - M): kept instead of the logits when it has their bytes (nothing
    # was cast; the logits are then held by nothing else), else recomputed from them
    kept = e if e.dtype == logits.dtype else None
    return total, t.size, (logits if kept is None else kept, kept is not None, logits.shape,
                           logits.dtype, t, mine, M, sums[0])  # fmt: skip


def vocab_ce_sum_backward(dsum, cache):
    """-> dlogits (B, S, V/R) = dsum * (softmax - onehot), the softmax from the kept M and Z."""
    kept, is_exp, shape, dtype, t, mine, M, Z = cache
    if is_exp:  # exp(l - M), (N, V/R)
        g = kept / Z[:, None]
    else:  # the logits: the same exp(l - M) again
        g = np.exp(up(kept).reshape(-1, shape[-1]) - M[:, None]) / Z[:, None]
    rows = np.flatnonzero(mine)
    g[rows, t[rows]] -= 1.0
    g *= dsum
    return down(g.reshape(shape), dtype)


def vocab_head_forward(tp, params, x, targets, cfg, *, sp=False, denom=None):
    """Final LN on x (B, S_l, H), f, logits (B, S, V/R), vocab-parallel CE -> (ce, cache)."""
    xf, ln = layernorm_forward(x, params["final_ln.gain"], params["final_ln.bias"], cfg.ln_eps)
    logits, lin = linear_forward(enter(tp, xf, sp), params["head.w"])  # f: (B, S, V/R)
    total, count, ce = vocab_ce_sum_forward(tp, logits, targets)
    denom = count if denom is None else denom
    return total / denom, {"ln": ln, "lin": lin, "ce": ce, "denom": denom, "sp": sp}


def vocab_head_backward(tp, dce, cache):
    """-> (dx (B, S_l, H), grads of final_ln.gain, final_ln.bias (partial under SP), head.w)."""
    dlogits = vocab_ce_sum_backward(dce / cache["denom"], cache["ce"])
    dxf, dw, _ = linear_backward(dlogits, cache["lin"])
    dxf = enter_backward(tp, dxf, cache["sp"])  # f^T: all-reduce (reduce-scatter under SP)
    dx, dgain, dbias = layernorm_backward(dxf, cache["ln"])
    return dx, {"final_ln.gain": dgain, "final_ln.bias": dbias, "head.w": dw}
