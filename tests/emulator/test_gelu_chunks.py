"""GELU in row chunks (emulator/ops.py, GELU_CHUNK): every entry point - gelu_forward /
gelu_backward and the fused linear_gelu_forward / linear_gelu_backward - is bitwise the chain run
once on the whole arrays, for chunk sizes from one row to more than the array, a short last chunk,
3-D and non-contiguous inputs; and GELU and its derivative match the closed form."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator import ops


def _whole_forward(z):
    c = ops.up(z)
    y = np.empty_like(c)
    ops._gelu_forward_into(c, y)
    return y


def _whole_backward(dy, z):
    c = ops.up(z)
    t, c2, d = (np.empty_like(c) for _ in range(3))
    ops._gelu_backward_into(c, ops.up(dy), t, c2, d)
    return d


def _bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(1, 1), (7, 5), (3, 11, 13), (2, 1, 64), (40, 3)]),
    chunk=st.integers(1, 4096),
    dtype=st.sampled_from([np.float32, np.float64]),
    transposed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_gelu_is_bitwise_the_whole_chain(shape, chunk, dtype, transposed, seed):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal(shape) * 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    if transposed:  # not C-contiguous: the whole-array fallback
        z, dy = z.T, dy.T
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops, "GELU_CHUNK", chunk)  # bytes: 1 is a row per chunk
        y, _ = ops.gelu_forward(z)
        dz = ops.gelu_backward(dy, z)
    _bitwise(y, _whole_forward(z))
    _bitwise(dz, _whole_backward(dy, z))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("chunk", [1, 3 * 8 * 24 + 5, 1 << 18])
def test_fused_linear_gelu_is_bitwise_linear_then_whole_gelu(monkeypatch, dtype, chunk):
    monkeypatch.setattr(ops, "GELU_CHUNK", chunk)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 37, 16)).astype(dtype)  # 74 rows: a short last chunk
    w, b = rng.standard_normal((16, 24)).astype(dtype), rng.standard_normal(24).astype(dtype)
    h, (z, _) = ops.linear_gelu_forward(x, w, b)
    z_ref, _ = ops.linear_forward(x, w, b)
    _bitwise(z, z_ref)
    _bitwise(h, _whole_forward(z_ref).reshape(z_ref.shape))
    w2, b2 = rng.standard_normal((24, 16)).astype(dtype), rng.standard_normal(16).astype(dtype)
    out, lin2 = ops.linear_forward(h, w2, b2)  # the w2 layer, whose backward carries GELU's
    dout = rng.standard_normal(out.shape).astype(dtype)
    dz, dw2, db2 = ops.linear_gelu_backward(dout, lin2, z)
    dh_ref, dw2_ref, db2_ref = ops.linear_backward(dout, lin2)
    _bitwise(dz, _whole_backward(dh_ref, z_ref).reshape(z_ref.shape))
    _bitwise(dw2, dw2_ref)
    _bitwise(db2, db2_ref)


def test_chunked_gelu_matches_the_closed_form(monkeypatch):
    monkeypatch.setattr(ops, "GELU_CHUNK", 8 * 9)  # nine float64 columns: one row a chunk
    z = np.linspace(-6, 6, 5 * 9).reshape(5, 9)
    k = math.sqrt(2 / math.pi)
    u = k * (z + 0.044715 * z**3)
    want_y = 0.5 * z * (1 + np.tanh(u))
    want_d = 0.5 * (1 + np.tanh(u)) + 0.5 * z * (1 - np.tanh(u) ** 2) * k * (
        1 + 3 * 0.044715 * z**2
    )
    y, _ = ops.gelu_forward(z)
    np.testing.assert_allclose(y, want_y, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(
        ops.gelu_backward(np.ones_like(z), z), want_d, rtol=1e-12, atol=1e-15
    )
