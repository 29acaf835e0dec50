"""parallel/data/replica.py: AdamW per DDP bucket is emulator.optim.AdamW, bitwise - the same
parameters and moments, in parameter order, with several buckets, padding, weight decay and bf16
gradients - and the padding stays zero; FlatLayout.flatten of a part; the buffers left unset
for DDP's initial broadcast; a group of one's gradients gathered into reused flat buffers."""

import ml_dtypes
import numpy as np
import pytest

from emulator.optim import AdamW
from parallel.data.flat import FlatGrads, make_buckets
from parallel.data.replica import BucketAdamW

SHAPES = {"emb": (13, 8), "w": (8, 24), "b": (24,), "ln": (8,), "head": (8, 13)}


@pytest.mark.parametrize("dtype, gdtype", [(np.float64, np.float64), (np.float32, np.float32),
                                           (np.float32, ml_dtypes.bfloat16)])  # fmt: skip
def test_bucket_adamw_is_adamw_bitwise(dtype, gdtype):
    rng = np.random.default_rng(0)
    params = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
    layouts = make_buckets(SHAPES, 3, 600 / 2**20, np.dtype(gdtype).itemsize)  # several, padded
    assert len(layouts) > 1 and any(lay.padding for lay in layouts)
    hyper = {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-6, "weight_decay": 0.1}
    flat = BucketAdamW(layouts, params, **hyper)
    ref_p = {n: p.copy() for n, p in params.items()}
    ref = AdamW(ref_p, **hyper)
    for _ in range(3):
        grads = {n: rng.standard_normal(s).astype(gdtype) for n, s in SHAPES.items()}
        ref.step(ref_p, grads)
        flat.step([lay.flatten(grads, gdtype) for lay in layouts])
    assert list(flat.params) == list(flat.m) == list(flat.v) == list(SHAPES)
    for n in SHAPES:
        for got, want in ((flat.params, ref_p), (flat.m, ref.m), (flat.v, ref.v)):
            assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
            assert got[n].tobytes() == want[n].tobytes(), n
    assert flat.step_count == ref.step_count == 3 and flat.nbytes() == ref.nbytes()
    for lay, p, m in zip(layouts, flat.flats, flat.m_flats):
        assert not p[lay.numel :].any() and not m[lay.numel :].any()  # the padding stays zero


def test_views_write_through_and_counts_are_checked():
    params = {n: np.ones(s) for n, s in SHAPES.items()}
    layouts = make_buckets(SHAPES, 2, 25.0, 8)
    flat = BucketAdamW(layouts, params)
    flat.params["w"][...] = 2.0  # DDP's initial broadcast writes through the views
    assert flat.flats[0][layouts[0].slot("w")].tolist() == [2.0] * 192
    assert params["w"][0, 0] == 1.0  # a copy, not the caller's arrays
    with pytest.raises(ValueError, match="1 buckets"):
        flat.step([])


@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16])
def test_flatten_of_a_part_is_that_slice_of_the_whole(dtype):
    """FlatLayout.flatten(part=): a rank's owned slice (ZeRO-3 builds only that) or any range is
    the same elements, casts and zero padding as the whole buffer's slice."""
    rng = np.random.default_rng(1)
    arrays = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
    for D in (1, 3, 4, 7):
        (lay,) = make_buckets(SHAPES, D, 25.0, 8)
        whole = np.zeros(lay.padded, dtype)  # the rule, one slice assignment per tensor
        for n in lay.names:
            whole[lay.slot(n)] = arrays[n].reshape(-1)
        assert lay.flatten(arrays, dtype).tobytes() == whole.tobytes()
        cuts = [lay.owned(r) for r in range(D)] + [slice(a, b) for a in range(0, lay.padded, 17)
                                                   for b in range(a + 1, lay.padded + 1, 23)]  # fmt: skip
        for part in cuts:
            got = lay.flatten(arrays, dtype, part)
            assert got.dtype == dtype and got.tobytes() == whole[part].tobytes(), (D, part)
    with pytest.raises(ValueError, match="'w' has 8 elements"):
        lay.flatten(arrays | {"w": np.ones(8)}, dtype)


class _PoisonedEmpty:
    """numpy, but np.empty hands out NaN: memory a buffer must not be read before written."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def empty(shape, dtype=float):
        return np.full(shape, np.nan, dtype)


def test_unfilled_buffers_are_the_broadcast_roots(monkeypatch):
    """fill=False leaves a rank's buffers for DDP's initial broadcast: afterwards every rank's
    buffers are its root's, bitwise, the padding zero - whatever the rank's own values were."""
    import emulator
    from parallel.data import flat as flat_module
    from parallel.data.ddp import DDP

    monkeypatch.setattr(flat_module, "np", _PoisonedEmpty())
    layouts = make_buckets(SHAPES, 3, 600 / 2**20, 8)
    assert len(layouts) > 1 and any(lay.padding for lay in layouts)

    def rank(comm):
        rng = np.random.default_rng(comm.rank)  # a different init on every rank
        params = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
        opt = BucketAdamW(layouts, params, fill=comm.rank == 0)
        DDP(comm, opt.params, layouts=layouts, flats=opt.flats)
        return [f.copy() for f in opt.flats]

    every = emulator.spawn(rank, 3, timeout=60)
    rng = np.random.default_rng(0)
    root = {n: rng.standard_normal(s) for n, s in SHAPES.items()}
    for lay, *flats in zip(layouts, *every):
        want = lay.flatten(root, np.float64)
        for f in flats:
            assert f.tobytes() == want.tobytes() and not f[lay.numel :].any()


def test_flat_grads_are_each_steps_flatten_in_their_dtype():
    # a group of one (DataAxis at dp = 1): every step's gradients, never the last step's, in
    # the gradients' own dtype (the clip scales them in it), laid out as flatten lays them out
    layouts = make_buckets(SHAPES, 1, 600 / 2**20, 8)
    assert len(layouts) > 1 and not any(lay.padding for lay in layouts)
    fg, rng = FlatGrads(layouts), np.random.default_rng(1)
    for dtype in (np.float64, np.float64, ml_dtypes.bfloat16, np.float32):
        grads = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
        got = fg.gather(grads)
        assert len(got) == len(layouts)
        for lay, flat in zip(layouts, got):
            want = lay.flatten(grads, dtype)
            assert flat.dtype == want.dtype and flat.tobytes() == want.tobytes()
