"""Linear layers y = x @ w + b, w (in, out): forward and backward (re-exported by emulator/ops.py).

Shape letters: N = B*S flattened tokens; "in" and "out" the layer's widths.

With a 2-thread BLAS pool on the main thread each layer's work is emulator/halves.py jobs handed
to the helper thread ONCE per layer (halves.together): the GEMM by halves of its rows, then on the
same rows the bias add and, when the caller passes one, the residual add; the backward's dx GEMM,
dw GEMM and bias sum (three independent jobs); the three projections of one input (q, k, v) and
the sum of their dx's. Per element the same operations in the same order as one call each, so
the same bits; fewer wake-ups of the helper (~100 us of the main thread's wall each when it waits
for the helper: docs/performance.md, "The model step against torch, fourth pass").
"""

from __future__ import annotations

import functools

import numpy as np

from emulator.halves import BATCH, COLUMNS, ONE, ROWS, together, together_then
from emulator.precision import add, arith_dtype, down, up

GEMM_HALF_MIN = 128  # the half's M, K and N; OpenBLAS's small-matrix path is for M N K <= 100^3


def _iadd(y, x):
    """y += x in place (x broadcasts: a bias row, or the same shape)."""
    np.add(y, x, out=y)


def _sum_rows_into(a, out):
    """out (X,) = a (N, X) summed over its rows."""
    np.add.reduce(a, axis=0, out=out)  # np.sum's ufunc call, without its Python frames


def _fold_into(a, *rest):
    """a = ((a + rest[0]) + rest[1]) ... in a's buffer."""
    for t in rest:
        np.add(a, t, out=a)


def _matmul_into(a, out, *, b):
    np.matmul(a, b, out=out)


def _gemm_job(a, b, out):
    """The job out (M, N) = a (M, K) @ b (K, N): with 2 BLAS threads on the main thread, two
    one-thread GEMMs on the halves of a's rows (BATCH; a transposed view too), each row the same
    BLAS kernel as in the one call: no BLAS worker spinning beside the halves' helper thread.
    Only for halves of >= GEMM_HALF_MIN rows, inner and outer size: a one-row half would be
    NumPy's gemv instead of gemm, a small one OpenBLAS's small-matrix kernel (other rounding)."""
    kind = BATCH if min(a.shape[0] // 2, *b.shape) >= GEMM_HALF_MIN else ONE
    return kind, functools.partial(_matmul_into, b=b), (a, out)


def _out(a, b):
    """The C-ordered (M, N) buffer of a (M, K) @ b (K, N) (an ndarray subclass flows on)."""
    return np.empty_like(a, dtype=np.result_type(a, b), order="C", shape=(a.shape[0], b.shape[1]))


def _gemm(a, b):
    """a (M, K) @ b (K, N), by halves of a's rows when they are large (_gemm_job)."""
    out = _out(a, b)
    together(_gemm_job(a, b, out))
    return out


def add_into(x, y):
    """add(x, y), written into y's buffer when no cast is involved: y must be a fresh result that
    nothing else holds (a linear layer's output, a backward's dx). IEEE addition commutes, so
    y + x is bitwise x + y; one (B, S, H) array fewer per residual."""
    if _fusable(x, y):
        together((ROWS, _iadd, (y, x)))  # two threads for large C-contiguous arrays
        return y
    return add(x, y)


def _fusable(x, y):
    """Whether add_into(x, y) is y += x in y's buffer (the same shape, no cast)."""
    return x.dtype == y.dtype == arith_dtype(y.dtype) and x.shape == y.shape


def _forward_jobs(x, w, b, residual):
    """-> (y (N, out) buffer, its jobs, whether residual is added in them)."""
    x2 = up(x.reshape(-1, x.shape[-1]))  # (N, in)
    w_ = up(w)
    y = _out(x2, w_)
    jobs = [_gemm_job(x2, w_, y)]
    if b is not None:
        jobs.append((ROWS, functools.partial(_iadd, x=up(b)), (y,)))
    shape = (*x.shape[:-1], w.shape[1])
    fused = residual is not None and x.dtype == y.dtype and _fusable(residual, y.reshape(shape))
    if fused:
        jobs.append((ROWS, _iadd, (y, residual.reshape(y.shape))))
    return y, jobs, fused


def _forward_done(x, w, b, residual, y, fused):
    out = down(y.reshape(*x.shape[:-1], w.shape[1]), x.dtype)
    if residual is not None and not fused:
        out = add_into(residual, out)
    return out, (x, w, b is not None)


def linear_forward(x, w, b=None, residual=None):
    """x (..., in) -> y (..., out), (+ residual, the same shape as y: residual + y, as
    add_into(residual, y)). Flattened to one 2-D GEMM; bf16 operands meet in fp32."""
    y, jobs, fused = _forward_jobs(x, w, b, residual)
    together(*jobs)
    return _forward_done(x, w, b, residual, y, fused)


def linears_forward(x, layers):
    """linear_forward(x, w, b) for each (w, b) of ``layers`` (the q, k, v projections of one
    input), all their jobs in one hand-off -> [(y, cache), ...]."""
    built = [_forward_jobs(x, w, b, None) for w, b in layers]
    together(*[j for _, jobs, _ in built for j in jobs])
    return [_forward_done(x, w, b, None, y, f) for (w, b), (y, _, f) in zip(layers, built)]


def _backward_jobs(dy, cache):
    """-> (dx (N, in), dw (in, out), db (out,) or None) buffers, dx's job, and dw's and db's
    (they read every row of dy: halves.together_then's later jobs)."""
    x, w, has_b = cache
    dy2 = up(dy.reshape(-1, dy.shape[-1]))  # (N, out)
    wt, xt = up(w).T, up(x.reshape(-1, x.shape[-1])).T  # (out, in), (in, N)
    dx, dw = _out(dy2, wt), _out(xt, dy2)
    later = [_gemm_job(xt, dy2, dw)]
    db = None
    if has_b:  # each column summed row after row, as sum(axis=0)
        db = np.empty(dy2.shape[1], dy2.dtype)
        later.append((COLUMNS, _sum_rows_into, (dy2, db)))
    return (dx, dw, db), [_gemm_job(dy2, wt, dx)], later


def _backward_done(cache, dx, dw, db):
    x, w, _ = cache
    dx = down(dx.reshape(x.shape), x.dtype)
    return dx, down(dw, w.dtype), None if db is None else down(db, w.dtype)


def linear_backward(dy, cache):
    """-> (dx, dw, db); db is None when the layer has no bias."""
    out, jobs, later = _backward_jobs(dy, cache)
    together_then(jobs, later)
    return _backward_done(cache, *out)


def linears_backward(dys, caches):
    """The backward of linears_forward: -> (the dx's summed, (dx_0 + dx_1) + dx_2 ...,
    [(dw, db), ...]), every job in one hand-off (the sum on the rows of dx_0's buffer)."""
    built = [_backward_jobs(dy, c) for dy, c in zip(dys, caches, strict=True)]
    dxs = [out[0] for out, _, _ in built]
    jobs = [j for _, js, _ in built for j in js]
    x = caches[0][0]
    fold = len(dxs) > 1 and all(x.dtype == d.dtype == arith_dtype(d.dtype) for d in dxs)
    if fold:
        jobs.append((ROWS, _fold_into, tuple(dxs)))
    together_then(jobs, [j for _, _, later in built for j in later])
    done = [_backward_done(c, *out) for (out, _, _), c in zip(built, caches)]
    if fold:
        total = done[0][0]
    else:  # bf16: summed in fp32, stored like the first
        total = up(done[0][0])
        for d, _, _ in done[1:]:
            total = total + up(d)
        total = down(total, done[0][0].dtype)
    return total, [(dw, db) for _, dw, db in done]
