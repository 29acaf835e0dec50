"""Vocabulary-parallel cross-entropy stays finite and exact with large float32 logits: the
global max is subtracted before exp (exp(89) overflows float32). Checked against NumPy's
log-sum-exp in float64 on the same float32 values."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from parallel.tensor.vocab import vocab_ce_sum_backward, vocab_ce_sum_forward


def _reference(logits, targets):
    """float64 log-sum-exp CE: (sum of losses, dlogits of the sum) over the full vocabulary."""
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])  # (N, V)
    m = z.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    t = targets.reshape(-1)
    loss = float((lse - z[np.arange(t.size), t]).sum())
    g = np.exp(z - lse[:, None])
    g[np.arange(t.size), t] -= 1.0
    return loss, g.reshape(logits.shape)


@pytest.mark.parametrize("R", [2, 4])
@pytest.mark.parametrize("scale", [1e2, 1e4, 3e4])
def test_large_float32_logits_are_finite_and_match_log_sum_exp(R, scale):
    rng = np.random.default_rng(int(scale) + R)
    B, S, V = 2, 3, 8 * R
    logits = (rng.standard_normal((B, S, V)) * scale).astype(np.float32)  # max far above 88
    targets = rng.integers(0, V, size=(B, S))
    want_loss, want_grad = _reference(logits, targets)
    Vl = V // R

    def fn(comm):
        mine = logits[..., comm.rank * Vl : (comm.rank + 1) * Vl]
        total, count, cache = vocab_ce_sum_forward(comm, mine, targets)
        return float(total), count, vocab_ce_sum_backward(1.0, cache)

    out = emulator.spawn(fn, R, timeout=30)
    grad = np.concatenate([g for _, _, g in out], axis=-1)
    for total, count, g in out:
        assert np.isfinite(total) and count == B * S
        assert abs(total - want_loss) <= 1e-6 * abs(want_loss) + 1e-3, (total, want_loss)
        assert g.dtype == np.float32 and np.all(np.isfinite(g))
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bf16"])
def test_backward_softmax_is_the_forwards_exp_bitwise(dtype):
    """The forward keeps exp(l - M) for the backward when it has the logits' bytes (float64,
    float32) and the backward recomputes it from the logits otherwise (bf16): either way the
    gradient is dsum * (exp(l - M) / Z - onehot) from the same operations, bit for bit."""
    from emulator.precision import BF16, up

    dt = BF16 if dtype == "bf16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    B, S, V, R = 2, 5, 12, 2
    logits = rng.standard_normal((B, S, V)).astype(dt)
    targets = rng.integers(0, V, size=(B, S))
    Vl, dsum = V // R, 0.37

    def fn(comm):
        mine = logits[..., comm.rank * Vl : (comm.rank + 1) * Vl]
        _, _, cache = vocab_ce_sum_forward(comm, mine, targets)
        return mine, vocab_ce_sum_backward(dsum, cache)

    out = emulator.spawn(fn, R, timeout=30)
    z = [up(mine).reshape(-1, Vl) for mine, _ in out]
    M = np.maximum(z[0].max(axis=-1), z[1].max(axis=-1))  # the ring's max over 2 ranks
    Z = np.exp(z[0] - M[:, None]).sum(axis=-1) + np.exp(z[1] - M[:, None]).sum(axis=-1)
    t = targets.reshape(-1)
    for r, (mine, got) in enumerate(out):
        want = np.exp(z[r] - M[:, None]) / Z[:, None]
        rows = np.flatnonzero((t >= r * Vl) & (t < (r + 1) * Vl))
        want[rows, t[rows] - r * Vl] -= 1.0
        want *= dsum
        want = want.reshape(mine.shape).astype(mine.dtype)
        assert got.dtype == mine.dtype and got.shape == mine.shape
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (dtype, r)
