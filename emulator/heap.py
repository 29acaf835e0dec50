"""Keep freed array memory in the process between training steps (glibc malloc's settings).

A training step allocates its activations in the forward and frees them in the backward. With
glibc's defaults, malloc hands the freed top of the heap back to the kernel once more than
M_TRIM_THRESHOLD is free there (dynamically 2x the largest array seen so far, a few MiB), so the
next forward page-faults every activation back in, zero-filled by the kernel. Measured on the
`bench model` step (float32, one thread): 16,000 page faults in the forward and 5,700 in the
backward of every step, a fifth to a quarter of the step's CPU time spent in the kernel (PyTorch's
eager step on the same machine: none in most steps). The arrays' values and the
accounted bytes (emulator/memory.py counts arrays, not pages) are unaffected.

``keep_freed_memory()`` sets the thresholds with mallopt(3): M_MMAP_THRESHOLD to 32 MiB (glibc's
ceiling on 64-bit; larger arrays are still mmap'ed and unmapped on free), so arrays below it come
from the heap and return to it, and M_TRIM_THRESHOLD to -1, which glibc reads as "never trim", so
the heap keeps its free memory for the next step instead of handing the top back. Setting one
alone would switch off glibc's dynamic mmap threshold and fault more (measured: 98,000 faults per
step with the trim threshold alone). The process's resident size then stays at its high-water
mark: memory is reused, never more is used. A finite trim threshold (1 GiB until the fourth pass)
is a cliff, not a cap: a spawn of dp2 x ep2 at H 256 grows the heap to 1.9 GiB (the ranks' state
and the full-shape gathers for the checks at the end of parallel.train) and frees it with the
top chunk at 0.94-0.98 GiB, so whether glibc trims depends on where the 15 layouts run before it
left the holes: over the threshold, every spawn trims and faults it back (122,000 faults per step,
1.5x the reference; with the threshold at 600 MiB 65-77 k per step, 3.0 s CPU instead of 1.7 s).
Only in the spawn (-1 while it runs, 1 GiB restored after) is not enough: the caller frees the
ranks' results after the restore, the top is over the threshold again, and the next spawn faults
76 k pages back in (measured with 600 MiB restored). Virtual ranks are threads, and glibc gives
threads arenas of their own, grown in 64 MiB heaps that are unmapped once empty whatever the trim
threshold, so a rank that frees more than one heap's worth faults it back in the next step:
M_ARENA_MAX 1 keeps every thread on the main heap the thresholds govern (3-D ZeRO-3 on 8 ranks at
H 256: 19,000 faults per step -> 8,700, DDP 19,000 -> 700; the ranks hold the GIL when they
allocate, so one arena's lock is seldom contended). emulator/ops.py calls it once on import;
elsewhere than glibc (no ``mallopt``) it does nothing; DISTEMU_KEEP_HEAP=0 leaves malloc's
defaults alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: mallopt refuses more
TRIM_THRESHOLD = -1  # glibc: never trim (a finite threshold is a cliff: see above)
_state = {"done": False, "kept": False}


def _mallopt():
    try:
        return ctypes.CDLL(None).mallopt  # the C library the interpreter runs on
    except (OSError, AttributeError):  # not glibc (musl has no mallopt), or no dlopen(NULL)
        return None


def keep_freed_memory() -> bool:
    """Set both thresholds once per process -> whether they are in effect."""
    if not _state["done"]:
        _state["done"] = True
        fn = None if os.environ.get("DISTEMU_KEEP_HEAP", "1") == "0" else _mallopt()
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            mm = fn(M_MMAP_THRESHOLD, MMAP_THRESHOLD)  # 1 on success, 0 if refused
            trim = mm and fn(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            _state["kept"] = bool(trim and fn(M_ARENA_MAX, 1))  # threads too (virtual ranks)
    return _state["kept"]
