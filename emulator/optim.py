"""AdamW (torch.optim.AdamW semantics) on named arrays or flat shards, and global-norm clipping.

Definition: docs/model.md, "Optimizer". ``adamw_update`` is elementwise on whatever array
it is handed, so ZeRO can run it on a flat shard of the concatenated parameters; clipping is split
into ``grad_norm_sq`` (a local sum a sharded layout all-reduces) and ``clip_coefficient``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from emulator.guards import check_hyper
from emulator.halves import ROWS, in_halves, independent
from emulator.precision import down, up


def adamw_update(p, g, m, v, step, *, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
    """One AdamW step in place on p, m, v (same shape, the master dtype); g may be bf16.

    The order of operations is torch's ``_single_tensor_adamw``: decay, moments, then
    p += -(lr / bc1) * (m / (sqrt(v) / sqrt(bc2) + eps)).
    """
    if step < 1:
        raise ValueError(f"adamw_update: step counts from 1, got {step}")
    fn = _adamw_fn(step, lr, betas, eps, weight_decay)
    in_halves(fn, p, g.astype(p.dtype, copy=False), m, v)  # two threads for large arrays


def _adamw_fn(step, lr, betas, eps, weight_decay):
    """-> fn(p, g, m, v): one adamw_update, elementwise (a halves ROWS job's function)."""
    b1, b2 = betas
    step_size, bc2 = lr / (1.0 - b1**step), math.sqrt(1.0 - b2**step)
    decay = 1.0 - lr * weight_decay if weight_decay != 0.0 else None
    return functools.partial(_moments_and_step, b1=b1, b2=b2, bc2=bc2, eps=eps,
                             step_size=step_size, decay=decay)  # fmt: skip


def _moments_and_step(p, g, m, v, *, b1, b2, bc2, eps, step_size, decay):
    """p *= decay (decoupled weight decay, Loshchilov & Hutter 2019; None: none); m += (1 - b1)
    g; v += (1 - b2) g^2; p -= step_size (m / (sqrt(v) / bc2 + eps)): these operations in this
    order, in one scratch buffer t instead of eight temporaries (a product with a scalar
    commutes bitwise)."""
    if decay is not None:
        p *= decay
    t = np.empty_like(p)
    np.multiply(g, 1.0 - b1, out=t)
    m *= b1
    m += t
    np.multiply(g, g, out=t)
    t *= 1.0 - b2
    v *= b2
    v += t
    np.sqrt(v, out=t)
    t /= bc2
    t += eps
    np.divide(m, t, out=t)
    t *= step_size
    p -= t


class AdamW:
    """AdamW over a dict of named master arrays. Defaults are the spec's (weight_decay 0.0)."""

    def __init__(self, params, *, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, where="AdamW")
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.m = {n: np.zeros_like(p) for n, p in params.items()}
        self.v = {n: np.zeros_like(p) for n, p in params.items()}
        self.step_count = 0

    def step(self, params, grads) -> None:
        """Update ``params`` in place from ``grads`` (same names)."""
        if set(grads) != set(self.m):
            raise KeyError(
                f"AdamW.step: grads names differ: {sorted(set(grads) ^ set(self.m))[:5]}"
            )
        self.step_count += 1
        fn = _adamw_fn(self.step_count, **self.hyper)
        jobs = [(ROWS, fn, (p, grads[n].astype(p.dtype, copy=False), self.m[n], self.v[n]))
                for n, p in params.items()]  # fmt: skip
        independent(*jobs)  # every parameter's update in one hand-off (emulator/halves.py)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "m": self.m, "v": self.v, **self.hyper}

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.m.values()) + sum(a.nbytes for a in self.v.values())


def grad_norm_sq(grads) -> float:
    """Sum of squares of every element of every gradient, accumulated in float64."""
    total = 0.0
    for g in grads.values() if isinstance(grads, dict) else grads:
        flat = np.asarray(g, dtype=np.float64).reshape(-1)
        total += float(np.dot(flat, flat))
    return total


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_: min(1, max_norm / (total + 1e-6))."""
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grad_norm(grads, max_norm: float) -> float:
    """Scale every gradient in place by clip_coefficient; returns the total norm before clipping.

    Total = sqrt(sum of squares) over the whole model (torch takes the norm of per-tensor norms,
    the same value up to rounding). A sharded layout all-reduces ``grad_norm_sq`` instead.
    """
    total = math.sqrt(grad_norm_sq(grads))
    coef = clip_coefficient(total, max_norm)
    if coef < 1.0:
        for g in grads.values():
            g[...] = down(up(g) * coef, g.dtype)
    return total
