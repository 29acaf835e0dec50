"""Causal multi-head attention core (q, k, v already projected): forward and backward.

Shape letters: B batch, S sequence, H H_local (d_model, or its share under tensor parallelism),
A heads (A_local), D = H // A head dim. Heads are consecutive D-column blocks of H.

Every (batch, head) pair is independent: its GEMMs, its mask and its softmax rows. With a 2-thread
BLAS pool on the main thread the two halves of the batch run on two threads, each with its own
one-thread GEMMs (emulator/halves.py, by_batch); per pair the same operations, so the same bits.
The per-pair GEMMs are np.matmul over the stacked (B, A) axes: one BLAS call per pair, too small
(S x S x D) for two BLAS threads to share well.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from emulator.halves import by_batch
from emulator.precision import arith_dtype, down, up


def _heads(t, A):
    B, S, H = t.shape
    return up(t).reshape(B, S, A, H // A).transpose(0, 2, 1, 3)  # (B, A, S, D)


def _merge(t):
    B, A, S, D = t.shape
    return t.transpose(0, 2, 1, 3).reshape(B, S, A * D)  # (B, S, H)


def _matmul_merged(a, b, out):
    """out (B, S, A*D) = _merge(a @ b) for a (B, A, S, X), b (B, A, X, D): the GEMMs write
    straight into the (B, S, A, D) memory (ldc = A*D), no (B, A, S, D) temporary and copy."""
    B, A, S, _ = a.shape
    np.matmul(a, b, out=out.reshape(B, S, A, b.shape[-1]).transpose(0, 2, 1, 3))


@functools.lru_cache(maxsize=16)
def _future(S: int) -> np.ndarray:
    """(S, S) bool, True where key j > query i (masked); shared, read-only."""
    m = np.triu(np.ones((S, S), dtype=bool), k=1)
    m.flags.writeable = False
    return m


def _probs_into(q, k, A, p):
    """p (B, A, S, S) <- softmax(q k^T / sqrt(D)) with key j > query i masked, computed in the
    arithmetic dtype (in p's buffer unless p is bf16) and stored as p's dtype."""
    qh, kh = _heads(q, A), _heads(k, A)
    s = p if p.dtype == arith_dtype(p.dtype) else np.empty(p.shape, arith_dtype(p.dtype))
    np.matmul(qh, kh.transpose(0, 1, 3, 2), out=s)  # (B, A, S, S)
    s *= 1.0 / math.sqrt(qh.shape[-1])
    np.copyto(s, -np.inf, where=_future(q.shape[1]))
    s -= np.maximum.reduce(s, axis=-1, keepdims=True)  # ndarray.max's ufunc call
    np.exp(s, out=s)
    s /= np.add.reduce(s, axis=-1, keepdims=True)
    if s is not p:
        p[...] = down(s, p.dtype)


def _forward_into(q, k, v, p, o, *, A):
    """Batch rows of q, k, v (b, S, H) -> p (b, A, S, S), o (b, S, H) in the arithmetic dtype."""
    _probs_into(q, k, A, p)
    _matmul_merged(up(p), _heads(v, A), o)


def _empty(t, shape=None, dtype=None):
    """A C-ordered buffer like t (an ndarray subclass flows on), in t's arithmetic dtype."""
    return np.empty_like(t, dtype=dtype or arith_dtype(t.dtype), order="C", shape=shape or t.shape)


def attention_forward(q, k, v, n_heads, *, keep_probs=True):
    """q, k, v (B, S, H) -> o (B, S, H).

    ``keep_probs=False`` is selective recomputation (Korthikanti et al. 2022, section 4.2): the
    (B, A, S, S) probabilities are not cached and the backward recomputes them from q and k.
    """
    if q.shape[-1] % n_heads:
        raise ValueError(f"attention: H_local={q.shape[-1]} not divisible by n_heads={n_heads}")
    B, S, _ = q.shape
    p = _empty(q, (B, n_heads, S, S), q.dtype)  # stored dtype = q's dtype
    o = _empty(q)
    by_batch(functools.partial(_forward_into, A=n_heads), q, k, v, p, o)
    return down(o, q.dtype), (q, k, v, n_heads, p if keep_probs else None)


def _backward_recompute(q, k, v, do, dq, dk, dv, *, A):
    """_backward_into without cached probabilities: recomputed by the forward's code, so
    bitwise the same."""
    p = _empty(q, (q.shape[0], A, q.shape[1], q.shape[1]), q.dtype)
    _probs_into(q, k, A, p)
    _backward_into(q, k, v, do, p, dq, dk, dv, A=A)


def _backward_into(q, k, v, do, p, dq, dk, dv, *, A):
    """Batch rows -> dq, dk, dv (b, S, H) in the arithmetic dtype."""
    p = up(p)
    doh, vh = _heads(do, A), _heads(v, A)
    _matmul_merged(p.transpose(0, 1, 3, 2), doh, dv)
    dp = doh @ vh.transpose(0, 1, 3, 2)  # (b, A, S, S)
    # softmax backward, ds = p (dp - sum(dp p)), in dp's buffer; masked p = 0
    dp -= np.add.reduce(dp * p, axis=-1, keepdims=True)
    ds = np.multiply(dp, p, out=dp)
    ds *= 1.0 / math.sqrt(doh.shape[-1])
    _matmul_merged(ds, _heads(k, A), dq)
    _matmul_merged(ds.transpose(0, 1, 3, 2), _heads(q, A), dk)


def attention_backward(do, cache):
    """-> (dq, dk, dv), each (B, S, H)."""
    q, k, v, A, p = cache
    dq, dk, dv = _empty(q), _empty(q), _empty(q)
    if p is None:
        by_batch(functools.partial(_backward_recompute, A=A), q, k, v, do, dq, dk, dv)
    else:
        by_batch(functools.partial(_backward_into, A=A), q, k, v, do, p, dq, dk, dv)
    dt = q.dtype
    return down(dq, dt), down(dk, dt), down(dv, dt)
