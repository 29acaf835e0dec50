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
from emulator.halves import on as halves_on
from emulator.precision import down, up

FLAT_MAX = 1 << 14  # elements: below this a tensor's 14 NumPy calls cost more than its copy


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
    g; v += (1 - b2) g^2; p -= step_size (m / (sqrt(v) / bc2 + eps)): these operations, in one
    scratch buffer t instead of eight temporaries (a product with a scalar commutes bitwise). p
    is read by nothing else, so its decay may come first or last: the same bits."""
    if decay is not None:
        p *= decay
    t = np.empty_like(p)
    _moments_into(g, m, v, t, b1=b1, b2=b2, bc2=bc2, eps=eps, step_size=step_size)
    p -= t


def _moments_into(g, m, v, t, *, b1, b2, bc2, eps, step_size):
    """m += (1 - b1) g, v += (1 - b2) g^2 in place; t = step_size (m / (sqrt(v) / bc2 + eps))."""
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


class AdamW:
    """AdamW over a dict of named master arrays. Defaults are the spec's (weight_decay 0.0).

    The moments of the parameters of at most FLAT_MAX elements are views of one flat buffer
    each for m and v; where nothing splits (a virtual rank's thread, a 1-thread pool) their
    moments and steps are one pass over it (their gradients gathered into one buffer first)
    and each such parameter takes its step in one subtraction: a step of the small layouts'
    69 tensors is 14 NumPy calls on a flat buffer, not 14 per tensor. Elementwise, so every
    element gets the same operations in the same order: the same bits."""

    def __init__(self, params, *, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, where="AdamW")
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self._flat = _flat_names(params)
        size = sum(params[n].size for n in self._flat)
        dtype = params[self._flat[0]].dtype if self._flat else None
        self._buffers = (np.zeros(size, dtype), np.zeros(size, dtype)) if self._flat else ()
        self.m, self.v = (self._zeros(params, buf) for buf in self._buffers or (None, None))
        self.step_count = 0

    def _zeros(self, params, buf) -> dict:
        """{name: zeros like the parameter}: the _flat names' are views of buf, in order."""
        flat, at = {}, 0
        for n in self._flat:
            p = params[n]
            flat[n] = buf[at : at + p.size].reshape(p.shape)
            at += p.size
        return {n: flat[n] if n in flat else np.zeros_like(p) for n, p in params.items()}

    def step(self, params, grads) -> None:
        """Update ``params`` in place from ``grads`` (same names)."""
        if set(grads) != set(self.m):
            raise KeyError(
                f"AdamW.step: grads names differ: {sorted(set(grads) ^ set(self.m))[:5]}"
            )
        self.step_count += 1
        fn = _adamw_fn(self.step_count, **self.hyper)
        flat = self._flat if self._flat and not halves_on() else ()
        skip = set(flat)
        jobs = [(ROWS, fn, (p, grads[n].astype(p.dtype, copy=False), self.m[n], self.v[n]))
                for n, p in params.items() if n not in skip]  # fmt: skip
        independent(*jobs)  # every parameter's update in one hand-off (emulator/halves.py)
        if flat:
            self._flat_step(params, grads, fn.keywords)

    def _flat_step(self, params, grads, kw) -> None:
        """_moments_and_step of the _flat parameters: the moments on the flat buffers, then
        each parameter's decay and step on its slice of the flat step t."""
        m_buf, v_buf = self._buffers
        ps = [params[n] for n in self._flat]
        g = np.concatenate([grads[n].astype(p.dtype, copy=False).reshape(-1)
                            for n, p in zip(self._flat, ps)])  # fmt: skip
        t = np.empty_like(m_buf)
        decay = kw["decay"]
        _moments_into(g, m_buf, v_buf, t, **{k: w for k, w in kw.items() if k != "decay"})
        at = 0
        for p in ps:
            if decay is not None:
                p *= decay
            p -= t[at : at + p.size].reshape(p.shape)
            at += p.size

    def state_dict(self) -> dict:
        return {"step": self.step_count, "m": self.m, "v": self.v, **self.hyper}

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.m.values()) + sum(a.nbytes for a in self.v.values())


def _flat_names(params) -> list:
    """The names of the parameters AdamW keeps flat: plain arrays of at most FLAT_MAX
    elements, all of the first one's dtype (none if the dtypes differ)."""
    names = [n for n, p in params.items() if type(p) is np.ndarray and p.size <= FLAT_MAX]
    dtypes = {params[n].dtype for n in names}
    return names if len(dtypes) == 1 else []


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
