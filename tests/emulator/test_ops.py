"""Every layer's backward against central finite differences (float64), forwards against NumPy
definitions written out independently."""

import math
from functools import partial

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator import ops
from tests.emulator.fd_helpers import assert_close, fd_grad


def _check(forward, backward, inputs, n_out_grads):
    """loss = sum(out * R); compare backward's grads of ``inputs`` with finite differences."""
    rng = np.random.default_rng(0)
    out, cache = forward(*inputs)
    R = rng.normal(size=np.shape(out))
    grads = backward(R, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)
    for j in range(n_out_grads):
        num = fd_grad(lambda: float(np.sum(forward(*inputs)[0] * R)), inputs[j])
        assert_close(f"grad {j}", grads[j], num)


@settings(max_examples=8, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 4), nin=st.integers(1, 4), nout=st.integers(1, 3))
def test_linear(B, S, nin, nout):
    rng = np.random.default_rng(B * 100 + S * 10 + nin)
    x, w, b = rng.normal(size=(B, S, nin)), rng.normal(size=(nin, nout)), rng.normal(size=nout)
    y, _ = ops.linear_forward(x, w, b)
    assert_close("forward", y, np.einsum("bsi,io->bso", x, w) + b, rtol=1e-13)
    _check(ops.linear_forward, ops.linear_backward, [x, w, b], 3)
    y0, c0 = ops.linear_forward(x, w)
    assert ops.linear_backward(np.ones_like(y0), c0)[2] is None


@settings(max_examples=6, deadline=None)
@given(S=st.integers(1, 4), H=st.integers(2, 6))
def test_layernorm(S, H):
    rng = np.random.default_rng(S * 7 + H)
    x, g, b = rng.normal(size=(2, S, H)), rng.normal(size=H), rng.normal(size=H)
    y, _ = ops.layernorm_forward(x, g, b, 1e-5)
    ref = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * g + b
    assert_close("forward", y, ref, rtol=1e-12, atol=1e-12)
    _check(
        lambda x, g, b: ops.layernorm_forward(x, g, b, 1e-5), ops.layernorm_backward, [x, g, b], 3
    )


def test_gelu():
    z = np.linspace(-5, 5, 23).reshape(1, 23)
    y, _ = ops.gelu_forward(z)
    ref = [0.5 * t * (1 + math.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t**3))) for t in z[0]]
    assert_close("forward", y[0], ref, rtol=1e-14)
    _check(ops.gelu_forward, ops.gelu_backward, [z], 1)


def _attention_loop(q, k, v, A):
    """Reference: explicit loops over batch, heads and queries (the definition)."""
    B, S, H = q.shape
    D = H // A
    o = np.zeros_like(q)
    for b in range(B):
        for h in range(A):
            cols = slice(h * D, (h + 1) * D)
            for i in range(S):
                s = q[b, i, cols] @ k[b, : i + 1, cols].T / math.sqrt(D)
                p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
                o[b, i, cols] = p @ v[b, : i + 1, cols]
    return o


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 2), S=st.integers(1, 4), A=st.integers(1, 3), D=st.integers(1, 3))
def test_attention(B, S, A, D):
    rng = np.random.default_rng(B + 10 * S + 100 * A + 1000 * D)
    q, k, v = (rng.normal(size=(B, S, A * D)) for _ in range(3))
    o, _ = ops.attention_forward(q, k, v, A)
    assert_close("forward", o, _attention_loop(q, k, v, A), rtol=1e-12, atol=1e-13)
    for keep in (True, False):
        fwd = partial(ops.attention_forward, n_heads=A, keep_probs=keep)
        _check(fwd, ops.attention_backward, [q, k, v], 3)


def test_attention_selective_is_bitwise():
    rng = np.random.default_rng(3)
    q, k, v, do = (rng.normal(size=(2, 5, 6)) for _ in range(4))
    full = ops.attention_backward(do, ops.attention_forward(q, k, v, 2)[1])
    sel = ops.attention_backward(do, ops.attention_forward(q, k, v, 2, keep_probs=False)[1])
    for a, b in zip(full, sel):
        assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="not divisible"):
        ops.attention_forward(q, k, v, 4)


def test_embedding():
    rng = np.random.default_rng(4)
    tok, pos = rng.normal(size=(5, 3)), rng.normal(size=(6, 3))
    tokens = np.array([[1, 1, 4], [0, 1, 2]])  # repeated ids must accumulate
    x, cache = ops.embedding_forward(tokens, tok, pos)
    assert_close("forward", x, tok[tokens] + pos[None, :3], rtol=0, atol=0)
    R = rng.normal(size=x.shape)
    dtok, dpos = ops.embedding_backward(R, cache)
    f = lambda: float(np.sum(ops.embedding_forward(tokens, tok, pos)[0] * R))
    assert_close("dtok", dtok, fd_grad(f, tok))
    assert_close("dpos", dpos, fd_grad(f, pos))


def test_cross_entropy():
    rng = np.random.default_rng(5)
    logits, targets = rng.normal(size=(2, 3, 7)) * 3, rng.integers(0, 7, (2, 3))
    loss, cache = ops.cross_entropy_forward(logits, targets)
    ref = np.mean(
        [
            -logits[b, s, targets[b, s]] + math.log(np.exp(logits[b, s]).sum())
            for b in range(2)
            for s in range(3)
        ]
    )
    assert abs(loss - ref) < 1e-13
    d = ops.cross_entropy_backward(1.0, cache)
    assert_close(
        "dlogits", d, fd_grad(lambda: ops.cross_entropy_forward(logits, targets)[0], logits)
    )
    total, n, c2 = ops.cross_entropy_sum_forward(logits, targets)
    assert n == 6 and abs(total - 6 * ref) < 1e-12
    assert_close("sum grad", ops.cross_entropy_sum_backward(1.0, c2), 6 * d, rtol=1e-13)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 33), (2, 1), (4, 300)])
def test_row_mean_is_ndarray_mean_bitwise(dtype, shape):
    """ops._row_mean calls the two ufuncs ndarray.mean does (the sum, then the division by the
    count as an intp: float32 rows are divided in float64, then rounded): the same bits."""
    x = (np.random.default_rng(6).standard_normal(shape) * 3.7).astype(dtype)
    got, want = ops._row_mean(x), x.mean(axis=-1, keepdims=True)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
