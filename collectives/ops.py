"""Reduction ops and dtype rules shared by every algorithm.

Ops: "sum", "avg" (sum, then divide by the group size once, at the end), "max", "min".
Integer "avg" is refused (it would truncate). bfloat16 (ml_dtypes) travels as bfloat16 on the
wire, but every hop adds in float32 and rounds the partial back to bfloat16, as NCCL does.
`combine` always writes into a buffer the algorithm owns (a received message), never an input.
"""

from __future__ import annotations

import functools

import numpy as np

OPS = ("sum", "avg", "max", "min")
_UFUNC = {"sum": np.add, "avg": np.add, "max": np.maximum, "min": np.minimum}


@functools.lru_cache(maxsize=256)
def _bf16(dtype) -> bool:
    return np.dtype(dtype).name == "bfloat16"


def is_bf16(dtype) -> bool:
    """Cached per dtype: np.dtype.name is computed in Python, several us per call."""
    try:
        return _bf16(dtype)
    except TypeError:  # an unhashable dtype-like
        return np.dtype(dtype).name == "bfloat16"


def check_dtype(dtype, what: str) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.kind in "iufc" or is_bf16(dtype):
        return dtype
    raise TypeError(
        f"{what}: dtype {dtype} is not supported; use a numeric dtype "
        f"(int, uint, float, complex or ml_dtypes.bfloat16)"
    )


def check_op(op: str, dtype, what: str) -> None:
    if op not in OPS:
        raise ValueError(f"{what}: unknown op {op!r}; ops are {', '.join(OPS)}")
    dtype = check_dtype(dtype, what)
    if op == "avg" and dtype.kind in "iu":
        raise TypeError(
            f"{what}: op='avg' on integer dtype {dtype} would truncate; cast to a float dtype "
            f"first, or use op='sum' and divide yourself"
        )
    if op in ("max", "min") and dtype.kind == "c":
        raise TypeError(f"{what}: op={op!r} is undefined for complex dtype {dtype}")


def combine(op: str, acc: np.ndarray, other: np.ndarray) -> np.ndarray:
    """acc <- acc (op) other, in place, vectorised. acc is a buffer the caller owns."""
    f = _UFUNC[op]
    if is_bf16(acc.dtype):  # accumulate in float32, round once per hop
        acc[...] = f(acc.astype(np.float32), other.astype(np.float32)).astype(acc.dtype)
    else:
        f(acc, other, out=acc)
    return acc


def finalize(op: str, acc: np.ndarray, p: int) -> np.ndarray:
    """The last step of "avg": divide the sum by the group size (in place)."""
    if op == "avg":
        if is_bf16(acc.dtype):
            acc[...] = (acc.astype(np.float32) / p).astype(acc.dtype)
        else:
            np.divide(acc, p, out=acc)
    return acc


def exchange(comm, send, dst: int, src: int, recv_count: int, dtype, out=None):
    """Send `send` (skipped if None) to dst and receive recv_count elements from src (skipped
    if 0; then an empty array). Both ends know every count, so skipping never desynchronises
    and moves no bytes that the formulas count."""
    if recv_count == 0:
        if send is not None:
            comm.send(send, dst)
        return np.empty(0, dtype) if out is None else out
    if send is None:
        return comm.recv(src, out=out, shape=(recv_count,), dtype=dtype)
    return comm.sendrecv(send, dst, src, out=out, shape=(recv_count,), dtype=dtype)
