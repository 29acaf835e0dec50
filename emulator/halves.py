"""The single-rank step's non-BLAS work on two threads when it has two BLAS threads.

NumPy runs a ufunc on one thread, so with a 2-thread BLAS pool the matmuls halve and the
elementwise chains, row reductions and column sums do not; PyTorch eager splits those too. Each op
here gives every element the same operations whichever thread runs it, so each split is bitwise
the one call (NumPy releases the GIL inside a ufunc's loop, so the halves do run at once):

  in_halves(fn, *a)   halves of the rows (the leading axes flattened): a chain of in-place ufuncs,
                      or reductions of each row's last axis (a row's sum is the same whichever rows
                      come with it: GELU, layernorm rows, AdamW, cross-entropy rows, residual adds)
  by_columns(fn, *a)  halves of the last axis: sums over rows (axis 0), which NumPy accumulates
                      row after row per column, so a column's sum does not depend on its
                      neighbours (bias and layernorm gain sums, the embedding's scatter-add)
  by_batch(fn, *a)    halves of axis 0 with the BLAS pool at ONE thread meanwhile: GEMMs by halves
                      of their rows (the linear layers, ops._gemm) and the attention core by halves
                      of the batch (one small GEMM per (batch, head)), each half on its own thread
                      with one-thread BLAS calls. OpenBLAS computes a GEMM's elements the same
                      whichever rows it is given and at 1 or 2 threads (checked: tests, and
                      `bench model --digest` prints the same at both thread counts).

Why not the BLAS pool's own two threads for the GEMMs: its idle worker spins (sched_yield) for up
to ~0.1 s after each call, beside the helper thread here; on a busy machine a 2-thread OpenBLAS
call waits for a core another job holds. Measured under load 19 (float32 step, 2 threads, min of
20 steps): 3.9 s with the pool's threads for the GEMMs, 1.2 s with halves (process CPU 1.2 s vs
0.46 s; one thread's step is 0.37 s of CPU).

fn(first half) runs on a helper thread and fn(second half) here. Checked: tests/emulator/
test_halves*.py against the one call, and `bench model --digest` against the unsplit tree.

It splits only on the main thread (virtual ranks are other threads and get 1 BLAS thread each,
emulator/blas.py), with the OpenBLAS pool at >= 2 threads, for arrays of at least MIN_SIZE
elements; otherwise it is one call.
"""

from __future__ import annotations

import contextlib
import os
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


def _forget_after_fork() -> None:
    """A forked child has no helper thread (fork copies only the calling thread): a new one
    there, else its halves would wait for a thread that does not exist (planning/nd_dryrun.py's
    worker processes are forked)."""
    global _lock
    _lock = threading.Lock()
    _pool.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def enabled(size: int) -> bool:
    """Whether an array of ``size`` elements would be split here, now."""
    if size < MIN_SIZE or threading.current_thread() is not threading.main_thread():
        return False
    return (blas.threads() or 1) >= 2


def _two(fn, first, second) -> None:
    """fn(*first) on the helper thread while fn(*second) runs here."""
    fut = _helper().submit(fn, *first)
    try:
        fn(*second)
    finally:
        fut.result(timeout=WAIT_S)  # re-raises the helper's exception, if any


def in_halves(fn, *arrays) -> None:
    """fn(*arrays) for a row-wise fn writing into some of the arrays: elementwise, or reducing
    each row's last axis. The arrays are C-contiguous and share their leading shape (..., X); X
    may differ (e.g. a layernorm's (N, H) and (N, 1))."""
    a0 = arrays[0]
    same = all(a.shape[:-1] == a0.shape[:-1] and a.flags.c_contiguous for a in arrays)
    if not (same and a0.ndim and enabled(max(a.size for a in arrays))):
        fn(*arrays)
        return
    rows = [a.reshape(-1, a.shape[-1]) for a in arrays]  # views: the arrays are C-contiguous
    h = rows[0].shape[0] // 2
    if h == 0:
        fn(*arrays)
        return
    _two(fn, [r[:h] for r in rows], [r[h:] for r in rows])


def by_columns(fn, *arrays) -> None:
    """fn(*arrays) for a fn that treats each index of the last axis on its own (sums over the
    other axes, scatter-adds of rows); the arrays share the last axis' length."""
    n = arrays[0].shape[-1] if arrays[0].ndim else 0
    h = n // 2
    same = all(a.ndim and a.shape[-1] == n for a in arrays)
    if not (same and h and enabled(max(a.size for a in arrays))):
        fn(*arrays)
        return
    _two(fn, [a[..., :h] for a in arrays], [a[..., h:] for a in arrays])


def by_batch(fn, *arrays) -> None:
    """fn(*arrays) for a fn independent along axis 0 (the batch), run on its two halves with the
    BLAS pool at one thread; the arrays share axis 0's length."""
    n = arrays[0].shape[0] if arrays[0].ndim else 0
    h = n // 2
    same = all(a.ndim and a.shape[0] == n for a in arrays)
    if not (same and h and enabled(max(a.size for a in arrays))):
        fn(*arrays)
        return
    with one_blas_thread():
        _two(fn, [a[:h] for a in arrays], [a[h:] for a in arrays])


@contextlib.contextmanager
def one_blas_thread():
    """The OpenBLAS pool at one thread for the block, then back at its size (main thread only:
    ``enabled`` is False elsewhere, so no other thread is using the pool's size meanwhile)."""
    pool = blas.pool()
    saved = None if pool is None else int(pool[0]())
    if saved is not None:
        pool[1](1)
    try:
        yield
    finally:
        if saved is not None:
            pool[1](saved)
