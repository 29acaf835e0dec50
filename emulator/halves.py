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

fn(first half) runs on a helper thread and fn(second half) here. ``together`` hands several such
jobs to the helper at once (a GEMM, its bias add and a residual add on the same rows; a linear
backward's three GEMM-and-sum jobs): one wake-up of the helper per op group instead of one per
job; ``deferred`` queues a whole chain (a dense block's forward, or its backward's dx chain
with ``together_then`` keeping the weight gradients for a second hand-off) and ``independent``
takes AdamW's parameters at once. The helper is one persistent thread woken through a lock
(half a ThreadPoolExecutor's submit-and-wait CPU: ~15 against ~30 us). Checked: tests/emulator/test_halves*.py against the one
call, and `bench model --digest` against the unsplit tree.

It splits only on the main thread (virtual ranks are other threads and get 1 BLAS thread each,
emulator/blas.py), with the OpenBLAS pool at >= 2 threads, for arrays of at least MIN_SIZE
elements; otherwise it is one call.
"""

from __future__ import annotations

import contextlib
import os
import threading

from emulator import blas

MIN_SIZE = 1 << 16  # below this the hand-off (tens of microseconds) costs more than it saves
WAIT_S = 600.0  # a half is milliseconds of arithmetic; waiting longer means something is wrong
ROWS, COLUMNS, BATCH = "rows", "columns", "batch"  # the three ways a job splits (module doc)
ONE = "one"  # a job that is one call (a GEMM too small to halve)
_pool: list = []
_lock = threading.Lock()
_queued: list = []  # [(jobs, later jobs)] inside deferred() (main thread only)
_main = [threading.main_thread().ident]  # compared with get_ident(): one C call per _on()


class _Helper:
    """The helper thread: it sleeps on ``_go``, runs the half it is given, releases ``_done``."""

    def __init__(self):
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._task, self._error, self.busy = None, None, False
        threading.Thread(target=self._loop, name="distemu-halves", daemon=True).start()

    def _loop(self):
        while True:
            self._go.acquire()
            fn, args = self._task
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
                self._error = e
            self._task = None
            self._done.release()

    def two(self, fn, first, second):
        self._task, self.busy = (fn, first), True
        self._go.release()
        try:
            fn(*second)
        finally:
            done = self._done.acquire(timeout=WAIT_S)
            self.busy = False
            if not done:
                raise TimeoutError(f"halves: the helper's half took over {WAIT_S} s")
            error, self._error = self._error, None
            if error is not None:
                raise error


def _helper() -> _Helper:
    with _lock:
        if not _pool:
            _pool.append(_Helper())
        return _pool[0]


def _forget_after_fork() -> None:
    """A forked child has no helper thread (fork copies only the calling thread): a new one
    there, else its halves would wait for a thread that does not exist (planning/nd_dryrun.py's
    worker processes are forked)."""
    global _lock
    _lock = threading.Lock()
    _pool.clear()
    _main[0] = threading.get_ident()  # the forking thread is the child's main thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


def _on() -> bool:
    """Whether this thread splits at all: the main thread, with a >= 2-thread BLAS pool."""
    return threading.get_ident() == _main[0] and (blas.threads() or 1) >= 2


def on() -> bool:
    """Whether this thread splits at all, now (the main thread with a >= 2-thread pool)."""
    return _on()


def enabled(size: int) -> bool:
    """Whether an array of ``size`` elements would be split here, now."""
    return size >= MIN_SIZE and _on()


def _two(fn, first, second) -> None:
    """fn(*first) on the helper thread while fn(*second) runs here (both here, one after the
    other, when a half itself splits: the helper is busy with the outer first half)."""
    helper = _helper()
    if helper.busy:
        fn(*first)
        fn(*second)
        return
    helper.two(fn, first, second)


def _split(kind, arrays):
    """-> (first, second): the arrays' views for each half of a ``kind`` split, or None when the
    job is one call (too small or not splittable; ``_on()`` is the caller's)."""
    a0 = arrays[0]
    if kind == ONE or not a0.ndim or max(a.size for a in arrays) < MIN_SIZE:
        return None
    if kind == ROWS:  # C-contiguous, sharing the leading shape (..., X); X may differ
        if not all(a.shape[:-1] == a0.shape[:-1] and a.flags.c_contiguous for a in arrays):
            return None
        arrays = [a.reshape(-1, a.shape[-1]) for a in arrays]  # views: C-contiguous
        h = arrays[0].shape[0] // 2
        first, second = [a[:h] for a in arrays], [a[h:] for a in arrays]
    elif kind == COLUMNS:  # sharing the last axis' length
        if not all(a.ndim and a.shape[-1] == a0.shape[-1] for a in arrays):
            return None
        h = a0.shape[-1] // 2
        first, second = [a[..., :h] for a in arrays], [a[..., h:] for a in arrays]
    else:  # BATCH: sharing axis 0's length
        if not all(a.ndim and a.shape[0] == a0.shape[0] for a in arrays):
            return None
        h = a0.shape[0] // 2
        first, second = [a[:h] for a in arrays], [a[h:] for a in arrays]
    return (first, second) if h else None


def _each(jobs, halves_) -> None:
    for (_, fn, _), part in zip(jobs, halves_, strict=True):
        fn(*part)


def together(*jobs) -> None:
    """Each job (kind, fn, arrays) is fn(*arrays) split as ``kind`` (ROWS, COLUMNS, BATCH; see
    in_halves, by_columns, by_batch), the jobs in order; when every job splits, all their first
    halves run on the helper in ONE hand-off, and their second halves here. So a job may read
    what an earlier one wrote only in the same rows of the same half: both split at half of the
    same row count (a GEMM's output (N, X) and a ROWS job on it, N rows). A job that does not
    split (too small) runs whole, here, between one hand-off of the jobs before it and one of
    those after: the same operations per element either way."""
    if not _on() or not jobs:  # a virtual rank's thread, or a 1-thread pool: the plain calls
        for _, fn, arrays in jobs:
            fn(*arrays)
        return
    if _queued:
        _queued[0][0].extend(jobs)
        return
    parts = [_split(kind, arrays) for kind, _, arrays in jobs]
    i = 0
    while i < len(jobs):  # each run of consecutive jobs that split in one hand-off, in order
        if parts[i] is None:
            jobs[i][1](*jobs[i][2])
            i += 1
            continue
        j = next((j for j in range(i, len(jobs)) if parts[j] is None), len(jobs))
        _together(jobs[i:j], parts[i:j])
        i = j


def _together(jobs, parts) -> None:
    blas_one = any(kind == BATCH for kind, _, _ in jobs)
    with one_blas_thread() if blas_one else contextlib.nullcontext():
        if len(jobs) == 1:
            _two(jobs[0][1], *parts[0])
        else:
            _two(_each, [jobs, [p[0] for p in parts]], [jobs, [p[1] for p in parts]])


def together_then(jobs, later) -> None:
    """together(*jobs, *later): the ``later`` jobs read every row of arrays that are complete
    before this call (a weight gradient's GEMM x^T dy, a bias or gain sum of dy) and write
    fresh arrays of their own. Inside deferred() the jobs join its hand-off and the later ones
    a second one after it (``independent``), when every row of what the jobs wrote is there
    (their inputs may be outputs of queued jobs)."""
    if _queued and _on():
        _queued[0][0].extend(jobs)
        _queued[0][1].extend(later)
        return
    together(*jobs, *later)


@contextlib.contextmanager
def deferred():
    """Inside, together() (in_halves, by_columns, by_batch too) only queues its jobs, and at the
    end they all run as ONE together(), then together_then's later jobs as a second one: a chain
    of row-wise ops (a layernorm, the GEMMs it feeds, their bias, GELU and residual adds; a
    block's backward, its weight gradients after) in one hand-off. The code inside must not read
    what a queued job writes (no cast of an output, no sum of one) and its jobs must meet at the
    same rows (together's rule: a BATCH job on (B, S, ...) meets ROWS ones on (B S, ...) when B
    is even). Off the main thread, with a 1-thread pool or nested: plain calls."""
    if _queued or not _on():
        yield
        return
    _queued.append(([], []))
    try:
        yield
    finally:
        jobs, later = _queued.pop()
    together(*jobs)
    independent(*later)


def independent(*jobs) -> None:
    """Jobs (kind, fn, arrays) that write disjoint arrays and read none that another writes
    (AdamW's parameters; a backward's weight gradients and sums), in ONE hand-off: the ROWS and
    BATCH ones by halves; the COLUMNS ones (sums over rows) whole, largest first, each on the
    side with less whole work so far (by column halves each thread reads every row, half of
    them from the other core's cache: 3-4x the CPU of the whole sum at 2 threads, measured);
    those too small to split whole on this thread. A whole job's other half is empty (no
    columns, no rows). GEMMs too small to halve (ONE) run after it, at the pool's size."""
    if not _on():
        for _, fn, arrays in jobs:
            fn(*arrays)
        return
    todo, first, second, load, after = [], [], [], [0, 0], []
    for job in sorted(jobs, key=_sums_last_largest_first):  # to balance the whole sums
        kind, _, arrays = job
        part = None if kind in (ONE, COLUMNS) else _split(kind, arrays)
        if part is None and (kind == ONE or not all(a.ndim for a in arrays)):
            after.append(job)
            continue
        if part is None:  # whole on one side, an empty half on the other
            cut = [a[..., :0] if kind == COLUMNS else a[:0] for a in arrays]
            i = int(load[1] < load[0]) if kind == COLUMNS else 1  # 0: the helper's, 1: here
            load[i] += sum(a.size for a in arrays)
            part = (cut, arrays) if i else (arrays, cut)
        todo.append(job)
        first.append(part[0])
        second.append(part[1])
    if any(a.size for part in first for a in part):  # the helper has work
        with one_blas_thread() if any(j[0] == BATCH for j in todo) else contextlib.nullcontext():
            _two(_each, [todo, first], [todo, second])
    else:
        after = todo + after
    for _, fn, arrays in after:
        fn(*arrays)


def _sums_last_largest_first(job):
    kind, _, arrays = job
    return (True, -sum(a.size for a in arrays)) if kind == COLUMNS else (False, 0)


def in_halves(fn, *arrays) -> None:
    """fn(*arrays) for a row-wise fn writing into some of the arrays: elementwise, or reducing
    each row's last axis. The arrays are C-contiguous and share their leading shape (..., X); X
    may differ (e.g. a layernorm's (N, H) and (N, 1))."""
    together((ROWS, fn, arrays))


def by_columns(fn, *arrays) -> None:
    """fn(*arrays) for a fn that treats each index of the last axis on its own (sums over the
    other axes, scatter-adds of rows); the arrays share the last axis' length."""
    together((COLUMNS, fn, arrays))


def by_batch(fn, *arrays) -> None:
    """fn(*arrays) for a fn independent along axis 0 (the batch), run on its two halves with the
    BLAS pool at one thread; the arrays share axis 0's length."""
    together((BATCH, fn, arrays))


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
