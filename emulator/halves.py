"""Elementwise work on two threads when the single-rank step has two BLAS threads.

NumPy runs a ufunc on one thread, so with a 2-thread BLAS pool the matmuls halve and the
elementwise chains (GELU, forward and backward) do not; PyTorch eager splits those too. A chain of
in-place ufuncs over row-aligned buffers gives every element the same operations whichever thread
runs it and wherever its rows start, so ``in_halves(fn, *arrays)`` - fn on the first half of the
rows on a helper thread and on the second half here - is bitwise fn(*arrays) (NumPy releases the
GIL inside a ufunc's loop, so the halves do run at once). Checked: tests/emulator/test_halves.py
against the one-call result, and `bench model --digest` against the unsplit tree.

It splits only on the main thread (virtual ranks are other threads and get 1 BLAS thread each,
emulator/blas.py), with the OpenBLAS pool at >= 2 threads, for C-contiguous arrays of at least
MIN_SIZE elements; otherwise it is one call.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from emulator import blas

MIN_SIZE = 1 << 16  # below this the hand-off (tens of microseconds) costs more than it saves
WAIT_S = 600.0  # a half is milliseconds of arithmetic; waiting longer means something is wrong
_pool: list = []
_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    with _lock:
        if not _pool:
            _pool.append(ThreadPoolExecutor(1, thread_name_prefix="distemu-halves"))
        return _pool[0]


def enabled(size: int) -> bool:
    """Whether an array of ``size`` elements would be split here, now."""
    if size < MIN_SIZE or threading.current_thread() is not threading.main_thread():
        return False
    return (blas.threads() or 1) >= 2


def in_halves(fn, *arrays) -> None:
    """fn(*arrays) for a row-wise fn writing into some of the arrays: elementwise, or reducing
    each row's last axis (a row's sum is the same whichever rows come with it). The arrays share
    their leading shape (..., X), X may differ (e.g. a layernorm's (N, H) and (N, 1))."""
    a0 = arrays[0]
    same = all(a.shape[:-1] == a0.shape[:-1] and a.flags.c_contiguous for a in arrays)
    if not (same and a0.ndim and enabled(a0.size)):
        fn(*arrays)
        return
    rows = [a.reshape(-1, a.shape[-1]) for a in arrays]  # views: the arrays are C-contiguous
    h = rows[0].shape[0] // 2
    if h == 0:
        fn(*arrays)
        return
    first = _helper().submit(fn, *(r[:h] for r in rows))
    try:
        fn(*(r[h:] for r in rows))
    finally:
        first.result(timeout=WAIT_S)  # re-raises the helper's exception, if any
