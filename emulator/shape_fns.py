"""The NumPy functions a shape-only array supports, and `shape_only()` (see emulator/shapes.py).

Each handler returns what NumPy would - a view where NumPy returns a view (split pieces are
basic slices), a fresh shape-only array where NumPy allocates, a NumPy scalar for 0-d results -
with the shape and dtype NumPy's rules give; nothing reads or writes a number.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np

from emulator.shapes import _ASARRAY, _ZEROS, HANDLED, ShapeArray, _shape


def _implements(*funcs):
    def deco(impl):
        for f in funcs:
            HANDLED[f] = impl
        return impl

    return deco


def _rt(*xs):
    """np.result_type as the real arrays would give it: Python scalars stay weak (NEP 50)."""
    return np.result_type(*(_ZEROS(1, x.dtype) if isinstance(x, np.ndarray) else x for x in xs))


@_implements(np.shape)
def _np_shape(a):
    return tuple(a.shape)


@_implements(np.ndim)
def _np_ndim(a):
    return a.ndim


@_implements(np.size)
def _np_size(a, axis=None):
    return a.size if axis is None else a.shape[axis]


@_implements(np.result_type)
def _np_result_type(*xs):
    return np.result_type(*(_ZEROS(1, x.dtype) if isinstance(x, np.ndarray) else x for x in xs))


@_implements(np.zeros_like, np.empty_like, np.ones_like, np.full_like)
def _np_like(a, *args, dtype=None, shape=None, **kw):
    if args and not isinstance(args[0], (type, np.dtype, str)) and dtype is None:
        args = args[1:]  # full_like's fill value
    dtype = dtype or (args[0] if args else a.dtype)
    return ShapeArray.new(a.shape if shape is None else shape, dtype)


@_implements(np.copy)
def _np_copy(a, *args, **kw):
    return a.copy()


@_implements(np.reshape)
def _np_reshape(a, shape=None, order="C", **kw):
    return a.reshape(shape if shape is not None else kw["newshape"])


@_implements(np.transpose)
def _np_transpose(a, axes=None):
    return a.transpose(axes)


@_implements(np.concatenate)
def _np_concatenate(arrays, axis=0, out=None, dtype=None, casting="same_kind"):
    arrays = list(arrays)
    if axis is None:
        arrays, axis = [x.reshape(-1) for x in arrays], 0
    shape = list(_shape(arrays[0]))
    shape[axis] = sum(_shape(x)[axis] for x in arrays)
    return ShapeArray.new(shape, dtype or _rt(*arrays))


@_implements(np.stack)
def _np_stack(arrays, axis=0, out=None, dtype=None, casting="same_kind"):
    arrays = list(arrays)
    shape = list(_shape(arrays[0]))
    shape.insert(axis % (len(shape) + 1), len(arrays))
    return ShapeArray.new(shape, dtype or _rt(*arrays))


@_implements(np.array_split, np.split)
def _np_split(a, sections, axis=0):
    n = a.shape[axis]
    if np.isscalar(sections):
        q, r = divmod(n, int(sections))
        bounds = np.cumsum([0] + [q + (i < r) for i in range(int(sections))])
    else:
        bounds = [0, *sections, n]
    idx = [slice(None)] * a.ndim
    out = []
    for lo, hi in itertools.pairwise(bounds):
        idx[axis] = slice(int(lo), int(hi))
        out.append(a[tuple(idx)])
    return out


@_implements(np.dot)
def _np_dot(a, b, out=None):
    sa, sb = _shape(a), _shape(b)
    shape = sa[:-1] + sb[:-2] + sb[-1:] if len(sb) >= 2 else sa[:-1]
    return ShapeArray.new(shape, _rt(a, b))


@_implements(np.triu, np.tril)
def _np_tri(m, k=0):
    return ShapeArray.new(m.shape, m.dtype)


def _method(name):
    """np.sum(a, ...) -> a.sum(...): the method reduces through __array_ufunc__."""
    return lambda a, *args, **kw: getattr(a, name)(*args, **kw)


for _f, _m in ((np.sum, "sum"), (np.prod, "prod"), (np.max, "max"), (np.min, "min"),
               (np.mean, "mean"), (np.any, "any"), (np.all, "all"), (np.cumsum, "cumsum")):  # fmt: skip
    HANDLED[_f] = _method(_m)


@_implements(np.broadcast_to)
def _np_broadcast_to(a, shape, subok=False):
    return ShapeArray.new(shape, a.dtype)  # a read-only view in NumPy; owns nothing new


@_implements(np.where)
def _np_where(cond, x=None, y=None):
    if x is None:
        raise NotImplementedError("shape-only arrays: np.where(cond) depends on data")
    shape = np.broadcast_shapes(_shape(cond), _shape(x), _shape(y))
    return ShapeArray.new(shape, _rt(x, y))


@_implements(np.copyto)
def _np_copyto(dst, src, casting="same_kind", where=True):
    return None


@_implements(np.atleast_1d)
def _np_atleast_1d(*arys):
    out = [a if a.ndim else a.reshape(1) for a in arys]
    return out[0] if len(out) == 1 else out


# -- creation calls and the random generator, while shape_only() is active ----------------------
class ShapeRNG:
    """np.random.default_rng's stand-in: draws have the requested shape and no values."""

    def __init__(self, seed=None):
        self.seed = seed

    def normal(self, loc=0.0, scale=1.0, size=None):
        return ShapeArray.new(() if size is None else size, np.float64)

    def uniform(self, low=0.0, high=1.0, size=None):
        return ShapeArray.new(() if size is None else size, np.float64)

    def standard_normal(self, size=None, dtype=np.float64):
        return ShapeArray.new(() if size is None else size, dtype)

    def random(self, size=None, dtype=np.float64):
        return ShapeArray.new(() if size is None else size, dtype)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        return ShapeArray.new(() if size is None else size, dtype)

    def permutation(self, x):
        return ShapeArray.new((x,) if np.isscalar(x) else x.shape, np.int64)


def _creator(dtype_default, real=None):
    """np.zeros / np.ones (``real`` the original) keep small integer tables real (SMALL_TABLE:
    their values are known); np.empty's never are, everything else is shape-only."""

    def make(shape, dtype=dtype_default, *args, **kw):
        dt = np.dtype(dtype if dtype is not None else np.float64)
        n = math.prod((shape,) if np.isscalar(shape) else shape)
        if real is not None and dt.kind in "biu" and n <= SMALL_TABLE:
            return real(shape, dt, *args, **kw)
        return ShapeArray.new(shape, dt)

    return make


def _full(shape, fill_value, dtype=None, *args, **kw):
    dt = np.dtype(dtype if dtype is not None else _ASARRAY(fill_value).dtype)
    if dt.kind in "biu" and not isinstance(fill_value, np.ndarray):
        n = math.prod((shape,) if np.isscalar(shape) else shape)
        if n <= SMALL_TABLE:  # a small integer table of a known value: data-independent, real
            return _FULL(shape, fill_value, dt, *args, **kw)
    return ShapeArray.new(shape, dt)


# np.full / zeros / ones of an integer or bool dtype with a concrete fill and at most this many
# elements stay real arrays: such tables are bookkeeping the code reads back (parallel/expert's
# padded dispatch fills its (P, El) row counts with the capacity, np.full((P, El), C), and offsets
# them from np.zeros((1, El), np.int64)); shape-only they would read as zeros. Their values are
# known without data, so keeping them real is exact.
SMALL_TABLE = 4096
_FULL = np.full


def _converter(original, name: str):
    def convert(a, dtype=None, *args, **kw):
        if isinstance(a, ShapeArray):
            if name == "ascontiguousarray" and not a.logically_contiguous:
                return ShapeArray.new(a.shape, dtype or a.dtype)
            copy = kw.get("copy", name == "array")
            if copy or (dtype is not None and np.dtype(dtype) != a.dtype):
                return a.astype(dtype or a.dtype)
            return a
        return original(a, dtype, *args, **kw)

    return convert


@contextlib.contextmanager
def shape_only():
    """Route NumPy's creation calls to shape-only arrays inside the block (one thread only)."""
    saved = {n: getattr(np, n) for n in ("zeros", "empty", "ones", "full", "asarray", "array",
                                         "ascontiguousarray", "asanyarray")}  # fmt: skip
    saved_rng = np.random.default_rng
    try:
        np.empty = _creator(np.float64)
        np.zeros, np.ones = (
            _creator(np.float64, saved["zeros"]),
            _creator(np.float64, saved["ones"]),
        )
        np.full = _full
        for n in ("asarray", "array", "ascontiguousarray", "asanyarray"):
            setattr(np, n, _converter(saved[n], n))
        np.random.default_rng = ShapeRNG
        yield
    finally:
        for n, f in saved.items():
            setattr(np, n, f)
        np.random.default_rng = saved_rng


@_implements(np.take)
def _np_take(a, indices, axis=None, out=None, mode="raise"):
    if axis is None:
        return ShapeArray.new(_shape(indices), a.dtype)
    axis %= a.ndim
    return ShapeArray.new(a.shape[:axis] + _shape(indices) + a.shape[axis + 1 :], a.dtype)


@_implements(np.flatnonzero)
def _np_flatnonzero(a):
    """Data: which entries are non-zero. A shape-only array reads as zeros, so none are - the
    stated assumption (in this code such index sets only steer in-place updates, e.g. the
    vocabulary-parallel loss's own-target rows; MoE buffers are capacity-sized, so routing
    decides no size)."""
    return ShapeArray.new((0,), np.intp)


@_implements(np.array_equal)
def _np_array_equal(a1, a2, equal_nan=False):
    return _shape(a1) == _shape(a2)  # both read as zeros


# -- index computations (MoE routing): shapes are data-independent, values read as zeros ---------
@_implements(np.argsort)
def _np_argsort(a, axis=-1, kind=None, order=None, stable=None):
    return ShapeArray.new((a.size,) if axis is None else a.shape, np.intp)


@_implements(np.take_along_axis)
def _np_take_along_axis(arr, indices, axis=-1):
    a, i = list(_shape(arr)), list(_shape(indices))
    axis %= len(a)
    n, a[axis], i[axis] = i[axis], 1, 1
    out = list(np.broadcast_shapes(tuple(a), tuple(i)))
    out[axis] = n
    return ShapeArray.new(out, arr.dtype)


@_implements(np.put_along_axis)
def _np_put_along_axis(arr, indices, values, axis):
    return None


@_implements(np.bincount)
def _np_bincount(x, weights=None, minlength=0):
    """Every id reads as 0, so the count has max(minlength, 1) bins (NumPy's length rule)."""
    dt = np.intp if weights is None else np.float64
    return ShapeArray.new((max(minlength, 1 if x.size else 0),), dt)


@_implements(np.ravel)
def _np_ravel(a, order="C"):
    return a.ravel(order)
