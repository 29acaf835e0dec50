"""BLAS threads per virtual rank: P ranks are P threads, and each must not start a full pool.

NumPy's BLAS (OpenBLAS in the wheels) keeps one process-wide thread pool sized to the machine.
With P virtual ranks each calling a matmul, P x cores BLAS threads compete for the cores, and
OpenBLAS's waiting threads spin: on a busy 2-core machine example 02 ran 3-7x slower with the
default pool than with one thread, a `bench layouts` step 3.6-35x (README, "BLAS threads"). So `spawn` runs the ranks under
`limit(per_rank(P))` and restores the pool's size afterwards; under MPI each process (one rank)
gets its share of the cores the same way (tools/run.py).

The pool is found as threadpoolctl finds it - the loaded shared libraries whose name says
openblas, through their `*openblas_set_num_threads*` symbol - without adding that dependency.
Where none is found (another BLAS, no /proc), `limit` does nothing; OPENBLAS_NUM_THREADS /
OMP_NUM_THREADS set before starting Python then do the same job. DISTEMU_BLAS_THREADS=k sets
the threads per rank (k >= 1) instead of the default below.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading

_SUFFIXES = ("64_", "")
_PREFIXES = ("scipy_openblas", "openblas")
_lock = threading.Lock()
_depth = {"n": 0, "saved": None}


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def per_rank(ranks_here: int) -> int:
    """BLAS threads for each of `ranks_here` ranks sharing this machine: cores // ranks, and 1
    for a lone rank too when the machine has few cores (<= 4). A virtual rank is one device;
    the examples' matrices are far too small for a BLAS pool to pay (measured: README, "BLAS
    threads"). DISTEMU_BLAS_THREADS=k (k >= 1) overrides."""
    env = os.environ.get("DISTEMU_BLAS_THREADS", "")
    if env.isdigit() and int(env) >= 1:
        return int(env)
    n = cpus()
    return 1 if n <= 4 else max(1, n // max(1, ranks_here))


def _openblas():
    """(get, set) of the loaded OpenBLAS pool, or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for pre in _PREFIXES:
            for suf in _SUFFIXES:
                get = getattr(lib, f"{pre}_get_num_threads{suf}", None)
                put = getattr(lib, f"{pre}_set_num_threads{suf}", None)
                if get is not None and put is not None:
                    put.argtypes = [ctypes.c_int]
                    return get, put
    return None


_POOL: list = []


def pool():
    if not _POOL:
        import numpy  # noqa: F401 - loads the BLAS library before we look for it

        _POOL.append(_openblas())
    return _POOL[0]


def threads() -> int | None:
    """The pool's current size (None when no OpenBLAS pool was found)."""
    p = pool()
    return None if p is None else int(p[0]())


@contextlib.contextmanager
def limit(n: int):
    """Run the block with the BLAS pool at `n` threads; nested / concurrent uses (spawn inside
    spawn) keep the outermost setting and restore the original size when the last one ends."""
    p = pool()
    with _lock:
        _depth["n"] += 1
        if p is not None and _depth["n"] == 1:
            _depth["saved"] = int(p[0]())
            p[1](max(1, int(n)))
    try:
        yield
    finally:
        with _lock:
            _depth["n"] -= 1
            if p is not None and _depth["n"] == 0 and _depth["saved"] is not None:
                p[1](_depth["saved"])
                _depth["saved"] = None
