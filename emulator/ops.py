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
from emulator.attention import _heads, _merge, attention_backward, attention_forward  # noqa: F401
from emulator.halves import COLUMNS, ROWS, by_columns, in_halves, together, together_then
from emulator.linear import (  # noqa: F401 - re-exported: ops is the layers' public face
    GEMM_HALF_MIN,
    _backward_done,
    _backward_jobs,
    _forward_done,
    _forward_jobs,
    _gemm,
    _iadd,
    add_into,
    linear_backward,
    linear_forward,
    linears_backward,
    linears_forward,
)
from emulator.precision import arith_dtype, down, up

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
    S, H = dx.shape[1:]
    d = up(dx)
    dtok, rows = np.zeros(tok_shape, d.dtype), np.empty((S, H), d.dtype)
    by_columns(functools.partial(_embedding_sums, ids=tokens.reshape(-1)), dtok, d, rows)
    dpos = np.zeros(pos_shape, d.dtype)
    dpos[slice(S) if positions is None else positions] = rows  # positions distinct
    return down(dtok, dtype), down(dpos, dtype)


def _embedding_sums(dtok, d, rows, *, ids):
    """Columns of dtok (V, H) += the rows of d (B, S, H) in token order (repeated ids
    accumulate), rows (S, H) = d summed over the batch."""
    np.add.at(dtok, ids, d.reshape(-1, d.shape[-1]))
    np.add.reduce(d, axis=0, out=rows)


# ---- layernorm over the last axis, biased variance -----------------------------------------------
def _row_mean(x):
    """x.mean(axis=-1, keepdims=True) as NumPy computes it (numpy/_core/_methods.py _mean: the
    sum, then a true_divide by the count as an intp, in place) without its ten Python-level
    calls: the same two ufunc calls, so the same bits. Reductions below call the ufunc's reduce
    for the same reason (ndarray.sum and np.sum are Python wrappers of np.add.reduce)."""
    if x.dtype.kind != "f" or x.dtype.itemsize < 4:  # _mean's float16 path: its own
        return x.mean(axis=-1, keepdims=True)
    r = np.add.reduce(x, axis=-1, keepdims=True)
    return np.true_divide(r, np.intp(x.shape[-1]), out=r, casting="unsafe", subok=False)


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
    np.subtract(c, _row_mean(c), out=xhat)
    np.multiply(xhat, xhat, out=y)
    r = _row_mean(y)  # (..., 1)
    r += eps
    np.sqrt(r, out=r)
    np.divide(1.0, r, out=rstd)
    xhat *= rstd
    np.multiply(xhat, gain, out=y)
    y += bias


def layernorm_backward(dy, cache, residual=None):
    """-> (dx, dgain, dbias); with ``residual`` (dx's shape) dx is add_into(residual, dx), the
    add on the same rows in the same hand-off (halves.together) when there is no cast."""
    xhat_s, rstd, gain = cache
    d, xhat = up(dy), up(xhat_s)
    H = d.shape[-1]
    dx = np.empty_like(d)  # _like: keeps an ndarray subclass flowing
    tmp, tmp2 = np.empty_like(d), np.empty_like(d)  # the sums' d xhat; dx's dxhat xhat, proj
    dgain, dbias = np.empty(H, d.dtype), np.empty(H, d.dtype)
    rows = [a.reshape(-1, H) for a in (d, xhat, tmp)]  # (N, H); tmp's is a view
    jobs = [(ROWS, functools.partial(_layernorm_dx, gain=up(gain)), (d, xhat, rstd, tmp2, dx))]
    fused = residual is not None and dx.dtype == dy.dtype and residual.shape == dx.shape
    fused = fused and residual.dtype == dx.dtype == arith_dtype(dx.dtype)
    if fused:
        jobs.append((ROWS, _iadd, (dx, residual)))
    together_then(jobs, [(COLUMNS, _layernorm_sums, (*rows, dgain, dbias))])  # sums: every row
    out = down(dx, dy.dtype)
    if residual is not None and not fused:
        out = add_into(residual, out)
    return out, down(dgain, gain.dtype), down(dbias, gain.dtype)


def _layernorm_sums(d, xhat, tmp, dgain, dbias):
    """Columns: dgain = sum over rows of d xhat (built in tmp), dbias = sum of d."""
    np.multiply(d, xhat, out=tmp)
    np.add.reduce(tmp, axis=0, out=dgain)
    np.add.reduce(d, axis=0, out=dbias)


def _layernorm_dx(d, xhat, rstd, tmp, dx, *, gain):
    """Rows: dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), dxhat = d gain."""
    np.multiply(d, gain, out=dx)
    proj = _row_mean(np.multiply(dx, xhat, out=tmp))
    dx -= _row_mean(dx)
    dx -= np.multiply(xhat, proj, out=tmp)
    dx *= rstd


# ---- gelu, tanh approximation: 0.5 z (1 + tanh(c (z + 0.044715 z^3))) ----------------------------
# In place, no extra temporaries (GELU is a quarter of a training step's time in NumPy otherwise),
# each chain a function of row-aligned buffers so that halves.in_halves can run it on two threads.
# The chains run on row chunks of about GELU_CHUNK bytes per array (_gelu_forward_rows,
# _gelu_backward_rows): the backward's 17 passes then read and write five chunks that stay in
# a core's L2 instead of five (N, F) arrays that do not (the model step's (1024, 1024): 4 MiB
# each in float32), and its two scratch buffers are chunks, not arrays. Per element the same
# operations in the same order: the same bits.
GELU_CHUNK = 1 << 18  # bytes per array and chunk (docs/performance.md, "GELU in row chunks")


def _rows2d(a):
    """a as a 2-D (rows, last axis) view, or None when that would be a copy."""
    return a.reshape(-1, a.shape[-1]) if a.ndim and a.flags.c_contiguous else None


def _chunk_rows(a2):
    """Rows of the 2-D a2 per chunk of ~GELU_CHUNK bytes: at least one, at most all."""
    n, f = a2.shape
    return min(n, max(1, GELU_CHUNK // (f * a2.itemsize)))


def _gelu_forward_rows(c, y):
    """_gelu_forward_into(c, y) by row chunks of ~GELU_CHUNK bytes."""
    c2, y2 = _rows2d(c), _rows2d(y)
    if c2 is None or y2 is None or not c2.size:
        return _gelu_forward_into(c, y)
    step = _chunk_rows(c2)
    for a in range(0, c2.shape[0], step):
        _gelu_forward_into(c2[a : a + step], y2[a : a + step])


def _gelu_backward_rows(c, dy, d):
    """_gelu_backward_into(c, dy, t, c2, d) by row chunks of ~GELU_CHUNK bytes, its scratch
    buffers t and c2 one chunk each."""
    c2, dy2, d2 = _rows2d(c), _rows2d(dy), _rows2d(d)
    if c2 is None or dy2 is None or d2 is None or not c2.size:
        return _gelu_backward_into(c, dy, np.empty_like(c), np.empty_like(c), d)
    n, f = c2.shape
    step = _chunk_rows(c2)
    t, s = np.empty((step, f), c2.dtype), np.empty((step, f), c2.dtype)
    for a in range(0, n, step):
        k = min(step, n - a)
        _gelu_backward_into(c2[a : a + k], dy2[a : a + k], t[:k], s[:k], d2[a : a + k])


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
    in_halves(_gelu_forward_rows, c, y)
    return down(y, z.dtype), z


def gelu_backward(dy, z):
    """-> dz. The cache is z itself; tanh is recomputed (elementwise, cheap)."""
    c = up(z)
    d = np.empty_like(c)
    in_halves(_gelu_backward_rows, c, up(dy), d)
    return down(d, z.dtype)


def linear_gelu_forward(x, w, b):
    """gelu_forward(linear_forward(x, w, b)) -> (h, (z, the linear's cache)): GELU's rows in
    the GEMM's hand-off (halves.together) when z is not cast (a cast z is GELU's input)."""
    y, jobs, _ = _forward_jobs(x, w, b, None)
    if x.dtype != y.dtype:
        z, lin = linear_forward(x, w, b)
        return gelu_forward(z)[0], (z, lin)
    h = np.empty_like(y)
    together(*jobs, (ROWS, _gelu_forward_rows, (y, h)))
    z, lin = _forward_done(x, w, b, None, y, False)
    return h.reshape(z.shape), (z, lin)


def linear_gelu_backward(dy, cache, z):
    """gelu_backward(linear_backward(dy, cache)[0], z), the linear's (dw, db): GELU's rows in
    the dx GEMM's hand-off when dx is not cast -> (dz, dw, db)."""
    (dx, dw, db), jobs, later = _backward_jobs(dy, cache)
    if cache[0].dtype != dx.dtype:
        together_then(jobs, later)
        dh, dw, db = _backward_done(cache, dx, dw, db)
        return gelu_backward(dh, z), dw, db
    c = up(z).reshape(dx.shape)
    d = np.empty_like(c)
    together_then([*jobs, (ROWS, _gelu_backward_rows, (c, dx, d))], later)
    _, dw, db = _backward_done(cache, dx, dw, db)
    return down(d.reshape(z.shape), z.dtype), dw, db


# ---- softmax cross-entropy -----------------------------------------------------------------------
def _shifted_into(logits, z):
    """z (N, V) = logits - rowmax in the arithmetic dtype; log softmax is z - log(sum(exp(z)))."""
    c = up(logits)
    np.subtract(c, np.maximum.reduce(c, axis=-1, keepdims=True), out=z)


def _ce_rows(logits, t, zt, lse):
    """Rows of logits (n, V), t (n, 1) -> zt (n, 1) = z[t], lse (n, 1) = log(sum(exp(z)));
    exp(z) goes in z's buffer once z[t] is taken."""
    z = np.empty(logits.shape, zt.dtype)
    _shifted_into(logits, z)
    zt[:, 0] = z[np.arange(t.shape[0]), t[:, 0]]
    lse[:, 0] = np.log(np.add.reduce(np.exp(z, out=z), axis=-1))


def _ce_grad_rows(logits, t, g, *, dsum):
    """Rows: g (n, V) = dsum (softmax(logits) - onehot(t)), log softmax then softmax in g."""
    _shifted_into(logits, g)
    g -= np.log(np.add.reduce(np.exp(g), axis=-1, keepdims=True))
    np.exp(g, out=g)
    g[np.arange(t.shape[0]), t[:, 0]] -= 1.0
    g *= dsum


def cross_entropy_sum_forward(logits, targets):
    """logits (..., V), targets (...) ints -> (sum of per-token losses, token count, cache).

    The sum form lets data/pipeline layouts divide by a global token count. Only the targets'
    log-probabilities z[t] - log(sum(exp(z))) are formed (each the same operations as in the
    full (N, V) log softmax); exp(z) goes in z's buffer once z[t] is taken.
    """
    V = logits.shape[-1]
    t = targets.reshape(-1, 1)  # (N, 1)
    zt, lse = np.empty((2, t.shape[0], 1), arith_dtype(logits.dtype))
    in_halves(_ce_rows, logits.reshape(-1, V), t, zt, lse)
    total = -(zt[:, 0] - lse[:, 0]).sum()
    return total, t.size, (logits, targets)


def cross_entropy_sum_backward(dsum, cache):
    """-> dlogits = dsum * (softmax - onehot); the softmax is recomputed from the logits."""
    logits, targets = cache
    V = logits.shape[-1]
    g = np.empty((logits.size // V, V), arith_dtype(logits.dtype))  # (N, V)
    in_halves(functools.partial(_ce_grad_rows, dsum=dsum), logits.reshape(-1, V),
              targets.reshape(-1, 1), g)  # fmt: skip
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
