"""A message's arguments: what may be sent, which peer, and what a receive expects.

The message path's checks (`emulator.comm`: `send`, `recv`, `sendrecv`, and the backends' fast
paths) test the common case in one line each and call these for everything else: the full
checks with their error texts, and the caches the one-line tests read (dtypes that passed
`as_message`, normalised (shape, dtype) receive arguments).
"""

from __future__ import annotations

import functools

import numpy as np


def check_peer(comm, peer: int, verb: str) -> None:
    """`peer` must be another rank of `comm`'s group (Comm._peer: `verb` says what for)."""
    if type(peer) is int and 0 <= peer < comm.world_size and peer != comm.rank:
        return  # the common case, checked in one line (every message passes here)
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < comm.world_size:
        raise ValueError(
            f"rank {comm.rank} of {comm.name!r}: cannot {verb} rank {peer!r}; "
            f"peers are 0..{comm.world_size - 1}"
        )
    if peer == comm.rank:
        raise ValueError(
            f"rank {comm.rank} of {comm.name!r}: cannot {verb} itself; a rank's own data "
            f"does not cross a link (handle it locally)"
        )


def as_message(array, what: str) -> np.ndarray:
    """`array` if it can travel as a message (a NumPy array of numbers), else the error."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what}: expected a NumPy array, got {type(array).__name__}")
    dt = array.dtype
    if dt.hasobject or dt.kind not in "biufcV":
        raise ValueError(
            f"{what}: dtype {array.dtype} is not a numeric dtype; send numbers "
            f"(bool, int, float, complex, bfloat16)"
        )
    if type(array) is np.ndarray:
        _SENDABLE.add(dt)  # send's one-line check from now on
    return array


# Caches of the message path's argument checks, filled by the full checks: dtypes that passed
# `as_message` (for plain ndarrays), and (shape, dtype) arguments already normalised. A key
# equal to a cached one normalises to an equal (shape, dtype), so a hit gives the same result.
_SENDABLE: set = set()
_EXPECTED: dict = {}


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:
    return str(dtype)  # computed in Python by NumPy: several us, once per call otherwise


def _expected(out, shape, dtype):
    if out is None:
        try:
            hit = _EXPECTED.get((shape, dtype))
        except TypeError:  # an unhashable shape (a list, a 0-d array): the full path
            hit = None
        if hit is not None:
            return None, hit[0], hit[1]
        got = _normalised(shape, dtype)
        try:
            if len(_EXPECTED) >= 4096:
                _EXPECTED.clear()
            _EXPECTED[(shape, dtype)] = got
        except TypeError:
            pass
        return None, got[0], got[1]
    if not isinstance(out, np.ndarray):
        raise TypeError(f"recv: out must be a NumPy array, got {type(out).__name__}")
    if not out.flags.c_contiguous:
        raise ValueError(
            "recv: out must be C-contiguous (received bytes fill it in order); "
            "pass np.ascontiguousarray(...) or receive into a fresh buffer"
        )
    return out, out.shape, out.dtype


def _normalised(shape, dtype) -> tuple:
    """(shape as a tuple of ints, np.dtype) of a receive without `out`."""
    if shape is None or dtype is None:
        raise ValueError(
            "recv: give out=<buffer> or both shape= and dtype=; a receiver must know what it "
            "expects (as with MPI), so a wrong message is caught instead of misread"
        )
    if type(shape) is int:
        shape = (shape,)
    elif type(shape) is tuple:
        shape = tuple(map(int, shape))
    else:
        shape = (int(shape),) if np.isscalar(shape) else tuple(map(int, shape))
    return shape, dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
