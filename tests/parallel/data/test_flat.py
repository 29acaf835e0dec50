"""parallel/data/flat.py: GradAccumulator's buffers hold the bits of a zero-started sum - its
first pass stores g + 0.0 instead of adding g into np.zeros - -0.0 included, over several
micro-batches and padded buckets, in float64, float32 and bf16."""

import ml_dtypes
import numpy as np
import pytest

from emulator.precision import down, up
from parallel.data.flat import GradAccumulator, make_buckets

SHAPES = {"emb": (13, 8), "w": (8, 24), "b": (24,), "ln": (8,), "head": (8, 13)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, ml_dtypes.bfloat16])
def test_grad_accumulator_is_a_zeroed_buffers_sum(dtype):
    layouts = make_buckets(SHAPES, 3, 600 / 2**20, np.dtype(dtype).itemsize)  # padded buckets
    assert len(layouts) > 1 and any(lay.padding for lay in layouts)
    acc, want, rng, k = GradAccumulator(layouts, dtype), {}, np.random.default_rng(1), 3
    for mb in range(k):  # -0.0 + -0.0, -0.0 + 0.0 and the like in "b"'s first entries
        grads = {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}
        grads["b"][:3] = [-0.0, -0.0, 0.0] if mb < k - 1 else [-0.0, 0.0, -0.0]
        done = [acc.add(n, g) for n, g in reversed(grads.items())]  # the backward's order
        assert sorted(lay.index for lay in done if lay) == [lay.index for lay in layouts]
        for n, g in grads.items():  # what np.zeros + add gave: 0 + g1 + g2 ...
            want[n] = down(up(want.get(n, np.zeros_like(g))) + up(g), g.dtype)
    for lay in layouts:
        flat = acc.flats[lay.index]
        assert flat.dtype == dtype and not flat[lay.numel :].any()  # the padding is zero
        for n, v in lay.views(flat).items():
            assert v.tobytes() == want[n].tobytes(), n
