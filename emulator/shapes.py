"""Shape-only arrays: an ndarray that carries shape and dtype but no data (the dry run).

A `ShapeArray` is an `np.ndarray` subclass whose strides are all zero over a buffer of one
element, so it costs `itemsize` bytes whatever its shape while `shape`, `dtype`, `size` and
`nbytes` are those of the array a real run would hold. NumPy hands every operation on it back
to us (`__array_ufunc__`, `__array_function__`), and we return new shape-only arrays whose shape
and dtype NumPy's own rules decide (broadcasting, type resolution on 1-element stand-ins, the
reduction's axes) without touching a number. Reading a value (`float`, `bool`, an `if`) sees 0.

Memory accounting sees what a real run allocates: a fresh result owns `nbytes` (its `.base` is
not an array, so `emulator.memory.saved_nbytes` charges it whole), and a view's `.base` is its
owner. Whether an operation would view or copy is decided on a stand-in with the *logical*
strides a real array of that history would have (`_ls`): basic indexing, transposes and
`reshape(copy=False)` on the stand-in never read memory, and when NumPy refuses a no-copy
reshape the real run would copy, so we make a fresh owner too.

`shape_only()` also routes NumPy's creation calls (`np.zeros(shape)`, `np.empty`, `np.ones`,
`np.full`, `np.asarray` of a shape-only array, `np.random.default_rng`) to shape-only arrays while
it is active, so code that allocates runs unchanged. Unsupported functions raise, naming them.
"""

from __future__ import annotations

import functools
import math

import numpy as np

# the real creation functions, kept before shape_only() swaps NumPy's attributes
_ZEROS, _ASARRAY = np.zeros, np.asarray


@functools.lru_cache(maxsize=4096)  # shapes repeat: every layer and micro-batch has the same
def c_strides(shape: tuple, itemsize: int) -> tuple:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


class ShapeArray(np.ndarray):
    """An array with a shape and a dtype and no data (see the module docstring)."""

    __array_priority__ = 100.0

    @classmethod
    def new(cls, shape, dtype=np.float64) -> ShapeArray:
        try:
            shape = tuple(map(int, shape))
        except TypeError:  # a scalar length
            shape = (int(shape),)
        if shape and min(shape) < 0:
            raise ValueError(f"negative dimensions are not allowed: {shape}")
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        buf = bytearray(max(dtype.itemsize, 1))  # not an ndarray: this array is the owner
        # _ls stays None (C order; __array_finalize__ set it): the strides a fresh array has
        return np.ndarray.__new__(cls, shape, dtype, buffer=buf, strides=(0,) * len(shape))

    def __array_finalize__(self, obj):
        self._ls = None  # set by whoever made the view; None = C order

    # -- logical layout ---------------------------------------------------------------------
    def _strides(self) -> tuple:
        ls = getattr(self, "_ls", None)
        return c_strides(self.shape, self.itemsize) if ls is None else ls

    def _probe(self) -> np.ndarray:
        """A stand-in with this array's logical strides (never read or written: views only, so
        one per (shape, strides) is kept; a dry run meets a few hundred)."""
        key = (self.shape, self._strides())
        p = _PROBES.get(key)
        if p is None:
            p = _PROBES[key] = np.lib.stride_tricks.as_strided(_ZEROS(1, np.uint8), *key)
        return p

    def _as_view(self, native, probe) -> ShapeArray:
        native._ls = tuple(probe.strides)
        return native

    @property
    def logically_contiguous(self) -> bool:
        """NumPy's C-contiguity rule on the logical strides (axes of length 1 do not count)."""
        if self.size <= 1:
            return True
        want = self.itemsize
        for n, st in zip(reversed(self.shape), reversed(self._strides())):
            if n != 1 and st != want:
                return False
            want *= n
        return True

    # -- views and copies ---------------------------------------------------------------------
    def __getitem__(self, idx):
        key = idx if isinstance(idx, tuple) else (idx,)
        if any(_is_advanced(k) for k in key):
            return ShapeArray.new(_advanced_shape(self.shape, key), self.dtype)
        probe = self._probe()[idx]
        native = np.ndarray.__getitem__(self, idx)
        if not isinstance(native, ShapeArray):
            return native  # a scalar element (reads the single zero)
        return self._as_view(native, probe)

    def __setitem__(self, idx, value):
        pass  # writes carry no data

    def reshape(self, *shape, order="C", copy=None):
        shape = shape[0] if len(shape) == 1 and not np.isscalar(shape[0]) else shape
        if self._ls is None and order == "C":  # C order: every reshape is a C-order view
            native = np.ndarray.reshape(self, shape)
            native._ls = None
            return native
        try:
            probe = np.reshape(self._probe(), shape, order=order, copy=False)
        except ValueError:  # a real array would be copied
            return ShapeArray.new(_resolve(self.size, shape), self.dtype)
        native = np.ndarray.reshape(self, probe.shape)
        return self._as_view(native, probe)

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and not np.isscalar(axes[0]) else (axes or None)
        return self._as_view(np.ndarray.transpose(self, axes), self._probe().transpose(axes))

    @property
    def T(self):
        return self.transpose()

    def swapaxes(self, a, b):
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.transpose(order)

    def ravel(self, order="C"):
        return self.reshape(-1)

    def flatten(self, order="C"):
        return ShapeArray.new((self.size,), self.dtype)

    def copy(self, order="C"):
        return ShapeArray.new(self.shape, self.dtype)

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return ShapeArray.new(self.shape, dtype)

    def fill(self, value):
        pass

    def dot(self, other):
        return np.dot(self, other)

    def tolist(self):
        raise TypeError("a shape-only array has no values to list")

    def __repr__(self):
        return f"ShapeArray(shape={self.shape}, dtype={self.dtype})"

    __str__ = __repr__

    # -- NumPy's protocols -------------------------------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        if method == "at":
            return None
        if method == "__call__":
            if ufunc is np.matmul:
                shapes = [_matmul_shape(_shape(inputs[0]), _shape(inputs[1]))]
            else:
                shapes = [_broadcast(inputs)] * ufunc.nout
            dts = _resolve_dtypes(ufunc, inputs, kw)
        elif method in ("reduce", "accumulate"):
            x = inputs[0]
            axis = kw.get("axis", 0)
            stand = _ZEROS((1,) * x.ndim, x.dtype)
            dts = [getattr(ufunc, method)(stand, **{k: v for k, v in kw.items()
                                                    if k != "where"}).dtype]  # fmt: skip
            if method == "accumulate":
                shapes = [x.shape]
            else:
                shapes = [_reduced_shape(x.shape, axis, kw.get("keepdims", False))]
        else:
            raise NotImplementedError(f"shape-only arrays: ufunc method {ufunc.__name__}.{method}")
        if out is not None:
            return out[0] if len(out) == 1 else out
        # a 0-d result is a NumPy scalar, as a real run's (caches do not charge scalars)
        res = tuple(ShapeArray.new(s, d) if s else d.type(0) for s, d in zip(shapes, dts))
        return res[0] if len(res) == 1 else res

    def __array_function__(self, func, types, args, kwargs):
        impl = HANDLED.get(func)
        if impl is None:
            raise NotImplementedError(
                f"shape-only arrays: numpy.{func.__name__} is not supported (emulator/shapes.py)"
            )
        return impl(*args, **kwargs)


def _resolve(size, shape):
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape = tuple(size // known if s == -1 else s for s in shape)
    return shape


def _is_advanced(k) -> bool:
    return isinstance(k, (np.ndarray, list)) and not isinstance(k, bool)


def _advanced_shape(shape, key) -> tuple:
    """NumPy's rule for integer-array indexing. A boolean mask is its nonzero() index arrays:
    exact for a real mask; a shape-only mask reads as zeros, so it selects nothing (length 0)."""
    expanded = []
    for k in key:
        if _is_advanced(k) and _ASARRAY(k).dtype == bool:
            if isinstance(k, ShapeArray):
                expanded += [_ZEROS(0, np.intp)] * max(k.ndim, 1)
            else:
                expanded += list(_ASARRAY(k).nonzero())
        else:
            expanded.append(k)
    key = tuple(expanded)
    consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
    dots = [i for i, k in enumerate(key) if k is Ellipsis]
    fill = (slice(None),) * (len(shape) - consumed)
    key = key[: dots[0]] + fill + key[dots[0] + 1 :] if dots else key + fill
    # with an array index present, integers are advanced indices too (0-d, broadcast)
    parts, dim = [], 0
    for k in key:
        if k is None:
            parts.append((False, (1,)))
        elif isinstance(k, slice):
            parts.append((False, (len(range(*k.indices(shape[dim]))),)))
            dim += 1
        else:
            parts.append((True, _shape(k)))
            dim += 1
    adv = [i for i, (is_adv, _) in enumerate(parts) if is_adv]
    b = np.broadcast_shapes(*(parts[i][1] for i in adv))
    rest = [(i, d) for i, (is_adv, d) in enumerate(parts) if not is_adv]
    if adv == list(range(adv[0], adv[-1] + 1)):
        before = [n for i, d in rest if i < adv[0] for n in d]
        after = [n for i, d in rest if i > adv[-1] for n in d]
        return (*before, *b, *after)
    return (*b, *(n for _, d in rest for n in d))


def _shape(x) -> tuple:
    return tuple(x.shape) if isinstance(x, np.ndarray) else np.shape(x)


def _matmul_shape(a, b) -> tuple:
    if len(a) == 1 and len(b) == 1:
        ok, out = a[0] == b[0], ()
    elif len(a) == 1:
        ok, out = a[0] == b[-2], (*b[:-2], b[-1])
    elif len(b) == 1:
        ok, out = a[-1] == b[0], a[:-1]
    else:
        ok, out = a[-1] == b[-2], (*np.broadcast_shapes(a[:-2], b[:-2]), a[-2], b[-1])
    if not ok:
        raise ValueError(f"matmul: shapes {a} and {b} do not align")
    return tuple(out)


def _broadcast(inputs) -> tuple:
    """np.broadcast_shapes of the inputs; the common case (equal shapes and scalars) first."""
    shapes = {_shape(x) for x in inputs}
    shapes.discard(())
    if len(shapes) <= 1:
        return shapes.pop() if shapes else ()
    return np.broadcast_shapes(*shapes)


def _scalar_key(x):
    """What NumPy's type resolution sees of an operand: an array's or NumPy scalar's dtype, a
    Python scalar's type (weak, NEP 50; an int's size too, which decides overflow errors)."""
    if hasattr(x, "dtype"):
        return x.dtype
    if type(x) is int:
        return int, x.bit_length(), x < 0
    return type(x)


_DTYPES: dict = {}  # (ufunc, operand keys, kw) -> result dtypes: resolution is data-independent


def _resolve_dtypes(ufunc, inputs, kw) -> list:
    kw = {k: v for k, v in kw.items() if k in ("dtype", "casting", "signature")}
    try:
        key = (ufunc, tuple(_scalar_key(x) for x in inputs), tuple(kw.items()))
        return _DTYPES[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable argument: resolve without the cache
        key = None
    stand = [_ZEROS(1, x.dtype) if isinstance(x, np.ndarray) else x for x in inputs]
    with np.errstate(all="ignore"):
        res = ufunc(*stand, **kw)
    out = [r.dtype for r in (res if ufunc.nout > 1 else (res,))]
    if key is not None:
        _DTYPES[key] = out
    return out


def _reduced_shape(shape, axis, keepdims) -> tuple:
    axes = range(len(shape)) if axis is None else np.atleast_1d(axis)
    axes = {int(a) % len(shape) for a in axes}
    return tuple(1 if i in axes else n for i, n in enumerate(shape) if keepdims or i not in axes)


_PROBES: dict = {}  # (shape, logical strides) -> read-only stand-in (ShapeArray._probe)
HANDLED: dict = {}  # numpy function -> handler (filled by emulator/shape_fns.py)

from emulator.shape_fns import ShapeRNG, shape_only  # noqa: F401 - registers the handlers
