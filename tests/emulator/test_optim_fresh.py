"""adamw_update(fresh=True): unset moments written, not read, in the first step - bitwise the
step on zero moments (signed zeros, NaN, inf, float32, bf16 gradients, weight decay), and
BucketAdamW's readers before its first step see zeros."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from emulator.optim import AdamW, adamw_update
from parallel.data.flat import make_buckets
from parallel.data.replica import BucketAdamW


@pytest.mark.parametrize("dtype, gdtype", [(np.float64, np.float64), (np.float32, np.float32),
                                           (np.float32, ml_dtypes.bfloat16)])  # fmt: skip
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_fresh_first_step_is_the_step_on_zero_moments(dtype, gdtype, wd):
    rng = np.random.default_rng(0)
    n = 3000  # > halves' split size on some machines: the row jobs too
    p0 = rng.standard_normal((2, n)).astype(dtype)
    g = rng.standard_normal((2, n)).astype(gdtype)
    g[0, :4] = [-0.0, 0.0, np.inf, -np.inf]
    g[1, :2] = [np.nan, -0.0]
    hyper = {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": wd}
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    pf, mf, vf = p0.copy(), np.full_like(p0, np.nan), np.full_like(p0, -7.0)  # unset memory
    with np.errstate(invalid="ignore"):  # inf - inf in the planted NaN's lanes
        adamw_update(p, g, m, v, 1, **hyper)
        adamw_update(pf, g, mf, vf, 1, **hyper, fresh=True)
    for got, want in ((pf, p), (mf, m), (vf, v)):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert not np.signbit(m[0, 0]) and not np.signbit(mf[0, 0])  # -0.0 -> +0.0


def test_bucket_adamw_readers_before_the_first_step_see_zeros():
    shapes = {"a": (5, 3), "b": (7,)}
    params = {n: np.ones(s) for n, s in shapes.items()}
    layouts = make_buckets(shapes, 4, 25.0, 8)
    opt = BucketAdamW(layouts, params)
    for flat in opt._m_flats + opt._v_flats:  # what np.empty may hand back
        flat[...] = np.nan
    assert opt.nbytes() == 2 * 22 * 8  # sizes only: no fill needed
    state = opt.state_dict()
    assert all(not a.any() for a in (*state["m"].values(), *state["v"].values()))
    assert all(not f.any() for f in opt.m_flats + opt.v_flats)  # padding too
    grads = {n: np.full(s, 0.5) for n, s in shapes.items()}
    ref_p = {n: p.copy() for n, p in params.items()}
    ref = AdamW(ref_p)  # the independent definition (emulator/optim.py)
    for k in (1, 2):  # the first step reads the zeros the reader filled in; the second too
        opt.step([lay.flatten({n: x * k for n, x in grads.items()}, np.float64) for lay in layouts])
        ref.step(ref_p, {n: x * k for n, x in grads.items()})
    for n in shapes:
        assert opt.m[n].tobytes() == ref.m[n].tobytes() and opt.v[n].tobytes() == ref.v[n].tobytes()
        assert opt.params[n].tobytes() == ref_p[n].tobytes()
