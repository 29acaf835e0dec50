"""Shared helpers: inputs per rank, comparison with the oracle, loud failure messages."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from parallel.testing import run_on_virtual_ranks
from parallel.testing import strategies as dst

DTYPES = (np.float32, np.float64, np.int64)
SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
world_sizes = dst.world_sizes(1, 16)  # the kit's, as a user's test draws them
lengths = st.integers(0, 40)
dtypes = st.sampled_from(DTYPES)


def inputs(p: int, shape, dtype, seed: int = 0) -> list[np.ndarray]:
    """Rank r's input: small integers for int dtypes, normals for floats (distinct per rank)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return [rng.integers(-50, 50, size=shape).astype(dtype) for _ in range(p)]
    return [rng.standard_normal(shape).astype(dtype) for _ in range(p)]


def run(fn, p: int, *args, **kw):
    return run_on_virtual_ranks(p, fn, *args, timeout=20, **kw)


def assert_close(got, want, p: int = 1, what: str = "") -> None:
    """Integers exactly; floats to the rounding of ~p additions."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}"
    )
    if want.dtype.kind in "iu" or want.size == 0:
        ok = np.array_equal(got, want)
        diff = "exact"
    else:
        g, w = got.astype(np.float64), want.astype(np.float64)
        eps = np.finfo(want.dtype).eps if want.dtype.kind == "f" else 2**-8
        tol = 4 * p * eps * (1 + np.abs(w))
        ok = bool(np.all(np.abs(g - w) <= tol))
        diff = f"max |diff| {np.max(np.abs(g - w)):.3g}"
    if not ok:
        bad = np.flatnonzero(got.reshape(-1) != want.reshape(-1))[:5]
        raise AssertionError(
            f"{what}: mismatch ({diff}) at flat {bad.tolist()}: got "
            f"{got.reshape(-1)[bad].tolist()} want {want.reshape(-1)[bad].tolist()}"
        )


def bytes_of(comm, op: str) -> tuple[int, int]:
    return comm.ledger.sent(op=op), comm.ledger.received(op=op)
