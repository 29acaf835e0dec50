"""Dtypes of the three precision modes and the two casts every op uses.

A stored array's dtype decides how an op computes on it: float64 and float32 compute in their own
dtype; bfloat16 (``ml_dtypes.bfloat16``, 2 bytes) is upcast to float32 for the arithmetic and the
result is cast back down (bf16 operands, fp32 accumulation: Micikevicius et al. 2018, section 3).
So one code path serves all three modes, and in float64/float32 both casts are no-ops (no copy).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ("float64", "float32", "mixed")


def arith_dtype(dtype) -> np.dtype:
    """The dtype arithmetic runs in for arrays stored as ``dtype`` (bf16 -> fp32)."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype == BF16 else dtype


def up(x: np.ndarray) -> np.ndarray:
    """View ``x`` in its arithmetic dtype (copies only for bf16; x itself otherwise, as
    astype(copy=False) would return it, without the call: the small layouts make thousands)."""
    return x.astype(np.float32) if x.dtype == BF16 else x


def down(y: np.ndarray, dtype) -> np.ndarray:
    """Store ``y`` as ``dtype`` (copies only when the dtype differs; y itself otherwise)."""
    return y if y.dtype == dtype else y.astype(dtype)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b in the arithmetic dtype, stored like ``a`` (residual adds, summed gradient parts)."""
    return down(up(a) + up(b), a.dtype)


def compute_dtype(mode: str) -> np.dtype:
    """Dtype of the parameters, activations and gradients the forward/backward use."""
    return {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32), "mixed": BF16}[mode]


def master_dtype(mode: str) -> np.dtype:
    """Dtype of the optimizer's copy of the parameters and of the Adam moments."""
    return {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32)}.get(
        mode, np.dtype(np.float32)
    )
