"""AdamW and clipping against the formulas written out by hand, one scalar at a time."""

import math

import ml_dtypes
import numpy as np
import pytest

from emulator.optim import AdamW, adamw_update, clip_coefficient, clip_grad_norm, grad_norm_sq


def _scalar_adamw(p, grads, lr, b1, b2, eps, wd):
    """The spec's AdamW for one scalar over a list of gradients (plain Python floats)."""
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        p = p - lr * wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (math.sqrt(v / (1 - b2**t)) + eps)
    return p


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_scalar_formula(wd):
    rng = np.random.default_rng(0)
    p0, gs = rng.normal(size=7), rng.normal(size=(5, 7))
    p, m, v = p0.copy(), np.zeros(7), np.zeros(7)
    for t in range(5):
        adamw_update(p, gs[t], m, v, t + 1, lr=0.05, betas=(0.8, 0.9), eps=1e-3, weight_decay=wd)
    want = [_scalar_adamw(p0[i], gs[:, i], 0.05, 0.8, 0.9, 1e-3, wd) for i in range(7)]
    np.testing.assert_allclose(p, want, rtol=1e-14, atol=1e-15)


def test_adamw_defaults_and_first_step():
    # Step 1 with zero decay: m_hat = g, v_hat = g^2, so p moves by lr * g / (|g| + eps).
    opt_p = {"a": np.array([1.0, -2.0, 0.5]), "b": np.array([[3.0]])}
    g = {"a": np.array([0.1, -4.0, 0.0]), "b": np.array([[2.0]])}
    opt = AdamW(opt_p)
    assert opt.hyper == {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    opt.step(opt_p, g)
    want = np.array([1.0, -2.0, 0.5]) - 1e-3 * g["a"] / (np.abs(g["a"]) + 1e-8)
    np.testing.assert_allclose(opt_p["a"], want, rtol=1e-15)
    assert opt.state_dict()["step"] == 1 and opt.nbytes() == 2 * 4 * 8
    with pytest.raises(KeyError, match="names differ"):
        opt.step(opt_p, {"a": g["a"]})
    with pytest.raises(ValueError, match="betas"):
        AdamW(opt_p, betas=(0.9, 1.0))


def test_adamw_flat_shard_equals_named_update():
    """ZeRO runs the update on a slice of the flat concatenation; elementwise => identical."""
    rng = np.random.default_rng(1)
    p = {"x": rng.normal(size=(3, 4)), "y": rng.normal(size=5)}
    g = {"x": rng.normal(size=(3, 4)), "y": rng.normal(size=5)}
    flat_p = np.concatenate([a.ravel() for a in p.values()])
    flat_g = np.concatenate([a.ravel() for a in g.values()])
    m, v = np.zeros(17), np.zeros(17)
    for lo, hi in ((0, 6), (6, 17)):  # two shards updated separately
        adamw_update(flat_p[lo:hi], flat_g[lo:hi], m[lo:hi], v[lo:hi], 1, lr=0.1, weight_decay=0.01)
    opt = AdamW(p, lr=0.1, weight_decay=0.01)
    opt.step(p, g)
    assert np.array_equal(flat_p, np.concatenate([a.ravel() for a in p.values()]))


def test_bf16_gradients_update_fp32_master():
    p, m, v = np.ones(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)
    g = np.array([1.0, -1.0, 0.5]).astype(ml_dtypes.bfloat16)
    adamw_update(p, g, m, v, 1, lr=0.5)
    assert p.dtype == np.float32
    np.testing.assert_allclose(p, 1.0 - 0.5 * np.sign([1.0, -1.0, 0.5]), rtol=1e-6)


def test_clipping_matches_hand_formula():
    g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}  # total norm 5
    assert grad_norm_sq(g) == 25.0
    assert clip_coefficient(5.0, 10.0) == 1.0
    assert clip_coefficient(5.0, 1.0) == 1.0 / (5.0 + 1e-6)
    total = clip_grad_norm(g, 1.0)
    assert total == 5.0
    c = 1.0 / (5.0 + 1e-6)
    assert np.array_equal(g["a"], np.array([3.0 * c, 0.0])) and g["b"][0, 0] == 4.0 * c
    g2 = {"a": np.array([0.3, 0.4])}
    assert clip_grad_norm(g2, 1.0) == pytest.approx(0.5, abs=1e-15)
    assert np.array_equal(g2["a"], [0.3, 0.4])  # below max_norm: untouched


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adamw_flat_moments_bitwise_per_tensor(monkeypatch, weight_decay, dtype):
    """Where nothing splits, the small tensors' moments and steps run on AdamW's flat buffers
    (and the large ones one by one): bitwise adamw_update one tensor at a time, with the
    moments as views of one buffer per moment, and the same figures."""
    monkeypatch.setattr("emulator.halves.blas.threads", lambda: 1)  # the plain path, here
    rng = np.random.default_rng(4)
    shapes = {"w": (64, 300), "b": (40,), "t": (3, 4, 5), "one": (1,), "x": (9, 7)}
    params = {n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()}
    grads = [{n: rng.standard_normal(s).astype(dtype) for n, s in shapes.items()} for _ in range(3)]
    p = {n: a.copy() for n, a in params.items()}
    opt = AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=weight_decay)
    want = {n: a.copy() for n, a in params.items()}
    m, v = ({n: np.zeros(s, dtype) for n, s in shapes.items()} for _ in range(2))
    for k, g in enumerate(grads, start=1):
        opt.step(p, g)
        for n in shapes:
            adamw_update(want[n], g[n], m[n], v[n], k, lr=0.01, betas=(0.8, 0.99), eps=1e-6,
                         weight_decay=weight_decay)  # fmt: skip
    for n in shapes:
        for got, ref in ((p, want), (opt.m, m), (opt.v, v)):
            assert got[n].shape == ref[n].shape and np.array_equal(got[n], ref[n]), n
    assert opt._flat == ["b", "t", "one", "x"]  # w (19,200 elements) is over FLAT_MAX
    assert opt.m["b"].base is opt.m["x"].base and opt.m["w"].base is None
    assert opt.nbytes() == 2 * sum(a.nbytes for a in params.values())


def test_adamw_flat_bf16_gradients_and_mixed_dtypes(monkeypatch):
    """bf16 gradients are widened before the flat pass; parameters of two dtypes keep every
    tensor on its own (no flat buffer)."""
    monkeypatch.setattr("emulator.halves.blas.threads", lambda: 1)
    rng = np.random.default_rng(5)
    p32 = {"a": rng.standard_normal(6).astype(np.float32), "b": np.ones((2, 3), np.float32)}
    g = {n: rng.standard_normal(a.shape).astype(ml_dtypes.bfloat16) for n, a in p32.items()}
    p, want = {n: a.copy() for n, a in p32.items()}, {n: a.copy() for n, a in p32.items()}
    AdamW(p, lr=0.5).step(p, g)
    for n in p32:
        adamw_update(want[n], g[n], np.zeros_like(want[n]), np.zeros_like(want[n]), 1, lr=0.5)
        assert np.array_equal(p[n], want[n])
    two = {"a": np.zeros(3), "b": np.zeros(3, np.float32)}
    assert AdamW(two)._flat == []
