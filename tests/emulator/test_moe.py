"""The MoE block against a token-by-token loop written from the spec, and its backward against
finite differences (float64)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator import moe
from tests.emulator.fd_helpers import assert_close, fd_grad


def _params(rng, H, F, E):
    return {
        "router": rng.normal(size=(H, E)),
        "w1": rng.normal(size=(E, H, F)) * 0.5,
        "b1": rng.normal(size=(E, F)) * 0.1,
        "w2": rng.normal(size=(E, F, H)) * 0.5,
        "b2": rng.normal(size=(E, H)) * 0.1,
    }


def _naive_group(u, mp, K, cf):
    """One routing group, one token and one choice at a time, exactly as the spec reads."""
    N, E = u.shape[0], mp["router"].shape[1]
    logits = u @ mp["router"]
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    choices = [sorted(range(E), key=lambda e, t=t: (-probs[t, e], e))[:K] for t in range(N)]
    C = math.ceil(cf * N * K / E)
    fill, y = [0] * E, np.zeros_like(u)
    for k in range(K):
        for t in range(N):
            e = choices[t][k]
            gate = probs[t, e] / (sum(probs[t, c] for c in choices[t]) if K > 1 else 1.0)
            if fill[e] < C:
                fill[e] += 1
                z = u[t] @ mp["w1"][e] + mp["b1"][e]
                h = 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
                y[t] += gate * (h @ mp["w2"][e] + mp["b2"][e])
    f = np.array([sum(c.count(e) for c in choices) for e in range(E)]) / (N * K)
    return y, E * float(np.sum(f * probs.mean(0)))


def _naive(m, mp, groups, K, cf):
    flat = m.reshape(-1, m.shape[-1])
    y, auxes = np.zeros_like(flat), []
    for g in groups:
        yg, aux = _naive_group(flat[g], mp, K, cf)
        y[g] = yg
        auxes.append(aux)
    return y.reshape(m.shape), sum(auxes) / len(auxes)


@settings(max_examples=10, deadline=None)
@given(
    E=st.integers(1, 4),
    K=st.integers(1, 3),
    cf=st.sampled_from([0.0, 0.3, 0.75, 1.0, 1.25, 2.0]),
    S=st.integers(1, 5),
    split=st.booleans(),
)
def test_forward_matches_token_loop(E, K, cf, S, split):
    K = min(K, E)
    rng = np.random.default_rng(E * 100 + K * 10 + S)
    mp, m = _params(rng, 3, 4, E), rng.normal(size=(2, S, 3))
    n = 2 * S
    groups = [np.arange(0, n, 2), np.arange(1, n, 2)] if split and n > 1 else [np.arange(n)]
    y, aux, _ = moe.moe_forward(mp, m, groups, top_k=K, capacity_factor=cf)
    y_ref, aux_ref = _naive(m, mp, groups, K, cf)
    assert_close("y", y, y_ref, rtol=1e-12, atol=1e-13)
    assert abs(aux - aux_ref) < 1e-13


@pytest.mark.parametrize("K,cf", [(1, 0.5), (1, 4.0), (2, 0.6), (2, 4.0)])
def test_backward_finite_differences(K, cf):
    rng = np.random.default_rng(K)
    E, H = 3, 3
    mp, m = _params(rng, H, 4, E), rng.normal(size=(2, 4, H))
    groups = [np.array([0, 3, 5, 7, 1]), np.array([2, 4, 6])]
    R, coef = rng.normal(size=m.shape), 0.7

    def loss():
        y, aux, _ = moe.moe_forward(mp, m, groups, top_k=K, capacity_factor=cf)
        return float(np.sum(y * R)) + coef * aux

    _, _, cache = moe.moe_forward(mp, m, groups, top_k=K, capacity_factor=cf)
    kept = sum(c[1]["keep"].sum() for c in cache[0])
    assert (kept < 8 * K) == (cf < 1), "the case must drop tokens exactly when intended"
    dm, dmp = moe.moe_backward(R, cache, coef)
    assert_close("dm", dm, fd_grad(loss, m))
    for name in mp:
        assert_close(name, dmp[name], fd_grad(loss, mp[name]))


def test_ties_capacity_and_groups():
    mp = _params(np.random.default_rng(0), 2, 3, 4)
    mp["router"][:] = 0.0  # all probabilities equal: ties go to the lower expert index
    r = moe.route(np.ones((5, 2)), mp["router"], 2, 1.0)
    assert np.array_equal(r["topi"], np.tile([0, 1], (5, 1)))
    # C = ceil(1.0 * 5 * 2 / 4) = 3: experts 0 and 1 take tokens 0..2 of each choice round
    assert r["C"] == 3 and np.array_equal(r["keep"], np.tile([1, 1, 1, 0, 0], 2).astype(bool))
    assert moe.capacity(5, 2, 4, 1.25) == math.ceil(1.25 * 5 * 2 / 4) == 4
    assert moe.capacity(3, 1, 8, 0.0) == 0
    assert abs(r["aux"] - 1.0) < 1e-15  # f = (.5, .5, 0, 0), P = 1/4 each: 4 * (2 * .5 / 4) = 1
    with pytest.raises(ValueError, match="partition"):
        moe.moe_forward(mp, np.ones((1, 3, 2)), [np.array([0, 1])], top_k=1, capacity_factor=1)
    with pytest.raises(ValueError, match="non-empty"):
        moe.moe_forward(mp, np.ones((1, 3, 2)), [np.arange(3), []], top_k=1, capacity_factor=1)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("K,cf", [(1, 0.5), (2, 1.25), (2, 4.0)])
def test_groups_none_is_one_checked_group(dtype, K, cf):
    """groups=None is one group of every token in order: the same bits and saved bytes as the
    checked group [arange(N)] (a shortcut for None must keep both), the token loop's values;
    and a lone permuted group's outputs are scattered back to token order."""
    from emulator.memory import saved_nbytes

    rng = np.random.default_rng(K * 10 + int(cf * 4))
    mp = {k: v.astype(dtype) for k, v in _params(rng, 3, 4, 4).items()}
    m, R = rng.normal(size=(2, 5, 3)).astype(dtype), rng.normal(size=(5, 2, 3)).astype(dtype)
    dy = R.transpose(1, 0, 2)  # a non-contiguous upstream gradient
    n = m.shape[0] * m.shape[1]
    runs = {}
    for name, groups in (
        ("none", None),
        ("arange", [np.arange(n)]),
        ("perm", [np.arange(n)[::-1]]),
    ):
        y, aux, cache = moe.moe_forward(mp, m, groups, top_k=K, capacity_factor=cf)
        dm, dmp = moe.moe_backward(dy, cache, 0.3)
        runs[name] = (y, aux, dm, dmp, saved_nbytes(cache, exclude=list(mp.values())))
    (y, aux, dm, dmp, nb), (y2, aux2, dm2, dmp2, nb2) = runs["none"], runs["arange"]
    assert y.tobytes() == y2.tobytes() and aux == aux2 and dm.tobytes() == dm2.tobytes()
    assert y.dtype == y2.dtype == dm.dtype == dm2.dtype == dtype
    assert all(dmp[k].tobytes() == dmp2[k].tobytes() for k in mp) and nb == nb2
    y_ref, aux_ref = _naive(m.astype(np.float64), {k: v.astype(np.float64) for k, v in mp.items()},
                            [np.arange(n)], K, cf)  # fmt: skip
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert_close("y", y, y_ref, rtol=tol, atol=tol)
    assert abs(aux - aux_ref) < tol
    # the reversed group routes the tokens in another order (capacity drops differ), but its
    # outputs are scattered back to token order: the token loop over that group says so
    y_p, aux_p = _naive(m.astype(np.float64), {k: v.astype(np.float64) for k, v in mp.items()},
                        [np.arange(n)[::-1]], K, cf)  # fmt: skip
    assert_close("y perm", runs["perm"][0], y_p, rtol=tol, atol=tol)
    assert abs(runs["perm"][1] - aux_p) < tol
