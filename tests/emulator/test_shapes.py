"""Shape-only arrays against NumPy itself: every result's shape and dtype, and whether it is a
view of its input or owns new memory (what emulator.memory.saved_nbytes charges), equal those of
the same expression on real arrays."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator.memory import _owner, saved_nbytes
from emulator.shapes import ShapeArray, shape_only

BF16 = np.dtype(ml_dtypes.bfloat16)

# each program maps an input x (shape (a, b, c)) to a list of results
PROGRAMS = {
    "reshape view": lambda x: [x.reshape(-1, x.shape[-1]), x.reshape(x.shape[0], -1)],
    "transpose then reshape copies": lambda x: [x.transpose(0, 2, 1).reshape(x.shape[0], -1)],
    "T and swapaxes": lambda x: [x.T, x.swapaxes(0, 1), x.transpose(1, 0, 2)[1:]],
    "slices": lambda x: [x[0], x[:, 1:], x[..., :1], x[None, :, ::2], x[1:, None]],
    "fancy": lambda x: [
        x[np.arange(x.shape[0])],
        x[:, [0, 0, 1]],
        x[np.zeros((2, 3), int), 0],
        x[0, None, [1, 2]],
        x[..., [0], None],
        x[np.arange(1), :, None, [0]],
        x[x.shape[0] * [True], 1:],
        x[None, 0, :, [0, 0]],
    ],
    "astype": lambda x: [x.astype(x.dtype, copy=False), x.astype(BF16), x.astype(np.float32)],
    "ufuncs": lambda x: [x + 1.0, x * np.float32(2), np.exp(x), x > 0, np.sqrt(x) - x[:1]],
    "matmul": lambda x: [x @ x.transpose(0, 2, 1), x[0] @ x[0].T, x.reshape(-1) @ x.reshape(-1)],
    "reductions": lambda x: [x.sum(axis=-1, keepdims=True), x.mean(axis=0), x.max(axis=(0, 2))],
    "functions": lambda x: [
        np.concatenate([x, x], axis=1),
        np.stack([x[0], x[1 % len(x)]]),
        *np.array_split(x.reshape(-1), 3),
        np.zeros_like(x, np.int8),
        np.take(x, np.arange(1), axis=2),
        np.dot(x[0], x[0].T),
        np.argsort(x, axis=1),
        np.take_along_axis(x, np.zeros((1, 2, 1), int), axis=1),
    ],
    "contiguity": lambda x: [
        np.ascontiguousarray(x.T),
        np.ascontiguousarray(x),
        x.ravel(),
        x.T.ravel(),
        x.copy(),
        x.flatten(),
    ],
}


def run(program, x):
    out = PROGRAMS[program](x)
    return [
        (np.shape(y), np.asarray(y).dtype if isinstance(y, np.ndarray) else type(y),
         isinstance(y, np.ndarray) and _owner(y) is _owner(x))
        for y in out
    ], saved_nbytes(out)  # fmt: skip


@given(
    program=st.sampled_from(sorted(PROGRAMS)),
    shape=st.tuples(st.integers(1, 4), st.integers(3, 5), st.integers(1, 4)),
    dtype=st.sampled_from([np.float64, np.float32]),
)
def test_shape_dtype_and_view_semantics_match_numpy(program, shape, dtype):
    real = run(program, np.ones(shape, dtype))
    with shape_only():
        fake = run(program, ShapeArray.new(shape, dtype))
    assert fake == real


def test_a_shape_only_array_costs_one_element():
    x = ShapeArray.new((1 << 20, 1 << 20), np.float32)  # 4 TiB if it were real
    assert x.nbytes == 4 << 40 and x.strides == (0, 0)
    assert (x @ x).shape == (1 << 20, 1 << 20) and float(x.sum()) == 0.0


def test_unsupported_functions_say_so_and_numpy_is_restored():
    with pytest.raises(NotImplementedError, match="numpy.fft"):
        np.fft.fft(ShapeArray.new((4,)))
    zeros = np.zeros
    with pytest.raises(RuntimeError), shape_only():
        assert isinstance(np.zeros(3), ShapeArray)
        raise RuntimeError
    assert np.zeros is zeros and type(np.zeros(3)) is np.ndarray


def test_the_shape_only_generator_draws_numpys_shapes_and_dtypes():
    real = np.random.default_rng(0)
    with shape_only():
        fake = np.random.default_rng(0)
    draws = [("normal", (0.0, 1.0, (2, 3))), ("uniform", (0.0, 1.0, (4,))),
             ("standard_normal", ((3, 1),)), ("random", ((5,),)),
             ("integers", (0, 9, (2, 2)))]  # fmt: skip
    for name, args in draws:
        want, got = getattr(real, name)(*args), getattr(fake, name)(*args)
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        assert isinstance(got, ShapeArray)
