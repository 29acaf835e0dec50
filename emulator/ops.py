"""Layer forward/backward pairs: ``x_forward(...) -> (out, cache)``, ``x_backward(dout, cache)``.

Shape letters: B batch, S sequence used (S <= T), T max positions, H d_model (H_local under
tensor parallelism), A heads (A_local), D = H // A head dim, F d_ff, V vocab, E experts, K top-k,
N = B*S flattened tokens.

Every op is vectorised (no Python loop over tokens, heads or elements) and dtype-polymorphic: the
stored dtype of the input decides the arithmetic (see precision.py). Caches hold exactly what the
backward needs; emulator/flops.py counts those bytes and the matmuls by formula.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from emulator import heap
from emulator.halves import in_halves
from emulator.precision import down, up

GELU_C = math.sqrt(2.0 / math.pi)
heap.keep_freed_memory()  # a step's activations reuse the last step's memory (emulator/heap.py)


# ---- embedding: x = tok[tokens] + pos[:S] -------------------------------------------------------
def embedding_forward(tokens, tok, pos, positions=None):
    """tokens (B, S) ints; tok (V, H); pos (T, H) -> x (B, S, H). ``positions`` (S,): the global
    position of each column (context parallelism holds a subsequence); None = 0..S-1."""
    S = tokens.shape[1]
    rows = pos[:S] if positions is None else pos[positions]  # (S, H)
    x = up(tok[tokens])  # (B, S, H), a fresh gather (a copy for bf16): the sum goes in place
    x += up(rows)
    return down(x, tok.dtype), (tokens, tok.shape, pos.shape, tok.dtype, positions)


def embedding_backward(dx, cache):
    """-> (dtok (V, H), dpos (T, H)); there is no dx: token ids are not differentiable."""
    tokens, tok_shape, pos_shape, dtype, positions = cache
    B, S, H = dx.shape
    d = up(dx)
    dtok = np.zeros(tok_shape, d.dtype)
    np.add.at(dtok, tokens.reshape(-1), d.reshape(B * S, H))  # repeated ids accumulate
    dpos = np.zeros(pos_shape, d.dtype)
    dpos[slice(S) if positions is None else positions] = d.sum(axis=0)  # positions distinct
    return down(dtok, dtype), down(dpos, dtype)


# ---- linear: y = x @ w + b, w (in, out) ----------------------------------------------------------
def linear_forward(x, w, b=None):
    """x (..., in) -> y (..., out). Flattened to one 2-D GEMM; bf16 operands meet in fp32."""
    x2 = up(x.reshape(-1, x.shape[-1]))  # (N, in)
    y = x2 @ up(w)  # (N, out)
    if b is not None:
        y += up(b)
    return down(y.reshape(*x.shape[:-1], w.shape[1]), x.dtype), (x, w, b is not None)


def linear_backward(dy, cache):
    """-> (dx, dw, db); db is None when the layer has no bias."""
    x, w, has_b = cache
    dy2 = up(dy.reshape(-1, dy.shape[-1]))  # (N, out)
    dx = down((dy2 @ up(w).T).reshape(x.shape), x.dtype)
    dw = down(up(x.reshape(-1, x.shape[-1])).T @ dy2, w.dtype)  # (in, out)
    db = down(dy2.sum(axis=0), w.dtype) if has_b else None
    return dx, dw, db


# ---- layernorm over the last axis, biased variance -----------------------------------------------
def layernorm_forward(x, gain, bias, eps):
    """x (..., H) -> y (..., H). Statistics in the arithmetic dtype (fp32 for bf16)."""
    c = up(x)
    xhat, y = np.empty_like(c), np.empty_like(c)  # _like: keeps an ndarray subclass flowing
    rstd = np.empty_like(c, shape=(*c.shape[:-1], 1))
    in_halves(functools.partial(_layernorm_into, gain=up(gain), bias=up(bias), eps=eps), c, xhat,
              y, rstd)  # fmt: skip
    return down(y, x.dtype), (down(xhat, x.dtype), rstd, gain)


def _layernorm_into(c, xhat, y, rstd, *, gain, bias, eps):
    """Row-wise: xhat = (c - mean) rstd, rstd = 1 / sqrt(mean((c - mean)^2) + eps), y = xhat
    gain + bias, in the two (..., H) output buffers (y holds the squares first)."""
    np.subtract(c, c.mean(axis=-1, keepdims=True), out=xhat)
    np.multiply(xhat, xhat, out=y)
    r = y.mean(axis=-1, keepdims=True)  # (..., 1)
    r += eps
    np.sqrt(r, out=r)
    np.divide(1.0, r, out=rstd)
    xhat *= rstd
    np.multiply(xhat, gain, out=y)
    y += bias


def layernorm_backward(dy, cache):
    """-> (dx, dgain, dbias)."""
    xhat_s, rstd, gain = cache
    d, xhat = up(dy), up(xhat_s)
    H = d.shape[-1]
    tmp = np.multiply(d, xhat)  # (..., H), the one temporary: d xhat, dxhat xhat, xhat proj
    dgain = tmp.reshape(-1, H).sum(axis=0)
    dbias = d.reshape(-1, H).sum(axis=0)
    dx = np.multiply(d, up(gain))  # dxhat, becomes dx in place
    # rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)): the same operations in the same order
    proj = np.multiply(dx, xhat, out=tmp).mean(axis=-1, keepdims=True)
    dx -= dx.mean(axis=-1, keepdims=True)
    dx -= np.multiply(xhat, proj, out=tmp)
    dx *= rstd
    return down(dx, dy.dtype), down(dgain, gain.dtype), down(dbias, gain.dtype)


# ---- gelu, tanh approximation: 0.5 z (1 + tanh(c (z + 0.044715 z^3))) ----------------------------
# In place, no extra temporaries (GELU is a quarter of a training step's time in NumPy otherwise),
# each chain a function of row-aligned buffers so that halves.in_halves can run it on two threads.
def _gelu_forward_into(c, y):
    """y = gelu(c): t = tanh(sqrt(2/pi) c (1 + 0.044715 c^2)) built in y, then 0.5 c (1 + t)."""
    np.multiply(c, c, out=y)
    y *= 0.044715
    y += 1.0
    y *= c
    y *= GELU_C
    np.tanh(y, out=y)
    y += 1.0
    y *= c
    y *= 0.5


def _gelu_backward_into(c, dy, t, c2, d):
    """d = dy * gelu'(c) = dy (0.5 (1 + t) + 0.5 c (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 c^2));
    t and c2 are scratch buffers."""
    np.multiply(c, c, out=c2)
    np.multiply(c2, 0.044715, out=t)
    t += 1.0
    t *= c
    t *= GELU_C
    np.tanh(t, out=t)
    np.multiply(t, t, out=d)
    np.subtract(1.0, d, out=d)
    d *= c
    c2 *= 3 * 0.044715
    c2 += 1.0
    c2 *= 0.5 * GELU_C
    d *= c2
    t += 1.0
    t *= 0.5
    d += t
    d *= dy


def gelu_forward(z):
    c = up(z)
    y = np.empty_like(c)
    in_halves(_gelu_forward_into, c, y)
    return down(y, z.dtype), z


def gelu_backward(dy, z):
    """-> dz. The cache is z itself; tanh is recomputed (elementwise, cheap)."""
    c = up(z)
    t, c2, d = (np.empty_like(c) for _ in range(3))
    in_halves(_gelu_backward_into, c, up(dy), t, c2, d)
    return down(d, z.dtype)


# ---- causal multi-head attention core (q, k, v already projected) --------------------------------
def _heads(t, A):
    B, S, H = t.shape
    return up(t).reshape(B, S, A, H // A).transpose(0, 2, 1, 3)  # (B, A, S, D)


def _merge(t):
    B, A, S, D = t.shape
    return t.transpose(0, 2, 1, 3).reshape(B, S, A * D)  # (B, S, H)


def _matmul_merged(a, b):
    """a (B, A, S, X) @ b (B, A, X, D) -> (B, S, A*D): the GEMMs write straight into (B, S, A, D)
    memory (ldc = A*D), which is _merge(a @ b) without the (B, A, S, D) temporary and its copy."""
    B, A, S, _ = a.shape
    D = b.shape[-1]
    out = np.empty_like(a, dtype=np.result_type(a, b), order="C", shape=(B, S, A, D))
    np.matmul(a, b, out=out.transpose(0, 2, 1, 3))
    return out.reshape(B, S, A * D)


def _probs(q, k, A):
    """softmax(q k^T / sqrt(D)) with key j > query i masked; stored dtype = q's dtype."""
    qh, kh = _heads(q, A), _heads(k, A)
    S = q.shape[1]
    scores = qh @ kh.transpose(0, 1, 3, 2)  # (B, A, S, S)
    scores *= 1.0 / math.sqrt(qh.shape[-1])
    np.copyto(scores, -np.inf, where=np.triu(np.ones((S, S), dtype=bool), k=1))  # key j > i
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return down(scores, q.dtype)


def attention_forward(q, k, v, n_heads, *, keep_probs=True):
    """q, k, v (B, S, H_local), heads = consecutive D-column blocks -> o (B, S, H_local).

    ``keep_probs=False`` is selective recomputation (Korthikanti et al. 2022, section 4.2): the
    (B, A, S, S) probabilities are not cached and the backward recomputes them from q and k.
    """
    if q.shape[-1] % n_heads:
        raise ValueError(f"attention: H_local={q.shape[-1]} not divisible by n_heads={n_heads}")
    p = _probs(q, k, n_heads)  # (B, A, S, S)
    o = _matmul_merged(up(p), _heads(v, n_heads))  # (B, S, H_local)
    return down(o, q.dtype), (q, k, v, n_heads, p if keep_probs else None)


def attention_backward(do, cache):
    """-> (dq, dk, dv), each (B, S, H_local)."""
    q, k, v, A, p = cache
    if p is None:
        p = _probs(q, k, A)  # the same code as the forward: bitwise the same probabilities
    p = up(p)
    doh, vh = _heads(do, A), _heads(v, A)
    dv = _matmul_merged(p.transpose(0, 1, 3, 2), doh)  # (B, S, H_local)
    dp = doh @ vh.transpose(0, 1, 3, 2)  # (B, A, S, S)
    # softmax backward, ds = p (dp - sum(dp p)), in dp's buffer; masked p = 0
    dp -= (dp * p).sum(axis=-1, keepdims=True)
    ds = np.multiply(dp, p, out=dp)
    ds *= 1.0 / math.sqrt(doh.shape[-1])
    dq = _matmul_merged(ds, _heads(k, A))
    dk = _matmul_merged(ds.transpose(0, 1, 3, 2), _heads(q, A))
    dt = q.dtype
    return down(dq, dt), down(dk, dt), down(dv, dt)


# ---- softmax cross-entropy -----------------------------------------------------------------------
def _shifted(logits):
    """z = logits - rowmax, (N, V) in the arithmetic dtype (a new array); log softmax is
    z - log(sum(exp(z)))."""
    z = up(logits).reshape(-1, logits.shape[-1])  # (N, V)
    return z - z.max(axis=-1, keepdims=True)


def cross_entropy_sum_forward(logits, targets):
    """logits (..., V), targets (...) ints -> (sum of per-token losses, token count, cache).

    The sum form lets data/pipeline layouts divide by a global token count. Only the targets'
    log-probabilities z[t] - log(sum(exp(z))) are formed (each the same operations as in the
    full (N, V) log softmax); exp(z) goes in z's buffer once z[t] is taken.
    """
    z = _shifted(logits)  # (N, V)
    t = targets.reshape(-1)
    zt = z[np.arange(t.size), t]  # (N,)
    lse = np.log(np.exp(z, out=z).sum(axis=-1))  # (N,)
    total = -(zt - lse).sum()
    return total, t.size, (logits, targets)


def cross_entropy_sum_backward(dsum, cache):
    """-> dlogits = dsum * (softmax - onehot); the softmax is recomputed from the logits."""
    logits, targets = cache
    z = _shifted(logits)  # (N, V), then log softmax and softmax in place
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    g = np.exp(z, out=z)
    t = targets.reshape(-1)
    g[np.arange(t.size), t] -= 1.0
    g *= dsum
    return down(g.reshape(logits.shape), logits.dtype)


def cross_entropy_forward(logits, targets):
    """Mean over all tokens -> (loss, cache)."""
    total, n, cache = cross_entropy_sum_forward(logits, targets)
    return total / n, (cache, n)


def cross_entropy_backward(dloss, cache):
    inner, n = cache
    return cross_entropy_sum_backward(dloss / n, inner)


def softmax(z, axis=-1):
    """Plain softmax in the arithmetic dtype (used by the MoE router)."""
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)
