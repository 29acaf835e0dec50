"""Central finite differences in float64: the independent check of every backward."""

from __future__ import annotations

import numpy as np


def _central(f, flat, i, eps):
    """(f(x + eps e_i) - f(x - eps e_i)) / 2 eps, perturbing the flat view in place."""
    old = flat[i]
    flat[i] = old + eps
    fp = f()
    flat[i] = old - eps
    fm = f()
    flat[i] = old
    return (fp - fm) / (2 * eps)


def fd_grad(f, x, eps=1e-6):
    """d f / d x by central differences, perturbing x in place one element at a time."""
    flat = x.reshape(-1)
    g = np.array([_central(f, flat, i, eps) for i in range(flat.size)], dtype=np.float64)
    return g.reshape(x.shape)


def assert_close(name, got, want, rtol=1e-6, atol=1e-8):
    """Fail with the name, the max difference and a few entries."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    diff = np.abs(got - want)
    bad = diff > atol + rtol * np.abs(want)
    if bad.any():
        idx = np.argwhere(bad)[:3]
        rows = [f"{tuple(i)}: got {got[tuple(i)]:.12g} want {want[tuple(i)]:.12g}" for i in idx]
        raise AssertionError(f"{name}: max |diff| {diff.max():.3g}; " + "; ".join(rows))


def fd_entries(f, x, n=4, seed=0, eps=1e-6):
    """Central differences at ``n`` random entries of x -> (flat indices, values)."""
    rng = np.random.default_rng(seed)
    flat = x.reshape(-1)
    idx = rng.choice(flat.size, size=min(n, flat.size), replace=False)
    return idx, np.array([_central(f, flat, i, eps) for i in idx])
