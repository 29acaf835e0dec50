"""How much of the `bench model` step can use two threads: a load-robust split of its CPU time.

    python -m benchmarks.model_serial [--dtype float32 float64] [--steps 5]
    PYTHONPATH=OTHER_TREE python benchmarks/model_serial.py    # another tree, the same measure

On a shared machine a 2-thread step's wall time says more about the other jobs than about the
code, so this runs the step on ONE thread (BLAS pool at 1) and splits each step's CPU time
(time.thread_time) into three parts:

  gemm    the linear layers' GEMMs, which run on the BLAS pool's two threads at 2 threads
  halves  what emulator/halves.py would split over two threads at 2 threads (the same calls,
          run here as one call and timed): the elementwise chains, row and column sums, and the
          attention core by batch halves
  serial  the rest: one thread busy while the other core idles (small arrays, Python, the
          per-head GEMMs of a tree whose attention is not split)

and prints the 2-thread step it implies if the two parallel parts halved exactly,
serial + (gemm + halves) / 2, and serial's share of it (the step's time with one thread busy).
It is a model of the 2-thread step from 1-thread CPU times, not a measurement of it.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time

import numpy as np

from emulator import blas, block, halves, model, ops, optim
from emulator.data import synthetic_batch
from emulator.optim import AdamW

try:  # the linear layers' GEMM half (a tree from before emulator/linear.py: ops')
    from emulator.linear import _matmul_into as _matmul
except ImportError:
    _matmul = getattr(ops, "_matmul_into", None)

_acc = {"gemm": 0.0, "halves": 0.0, "inner": 0.0}


def _timed(kind, fn, would_split=lambda *a: True):
    @functools.wraps(fn)
    def run(*args, **kw):
        if not would_split(*args):
            return fn(*args, **kw)
        t0, inner0 = time.thread_time(), _acc["inner"]
        try:
            return fn(*args, **kw)
        finally:
            dt = time.thread_time() - t0
            _acc[kind] += dt - (_acc["inner"] - inner0)  # exclusive of nested parts
            _acc["inner"] += dt

    return run


def _big(axis):
    """Whether halves.py would split these arrays at 2 threads (size and a splittable axis)."""

    def check(fn, *arrays):
        big = max(np.size(a) for a in arrays) >= halves.MIN_SIZE
        return big and np.ndim(arrays[0]) > 0 and np.shape(arrays[0])[axis] >= 2

    return check


def _jobs_big(*jobs):
    """Whether halves.together would split these jobs at 2 threads (every job splits)."""
    axis = {"rows": 0, "columns": -1, "batch": 0}
    return all(kind in axis and _big(axis[kind])(fn, *arrays) for kind, fn, arrays in jobs)


def _together(real):
    """halves.together timed as "gemm" when a job is a linear layer's GEMM, else "halves"."""
    gemm = _timed("gemm", real, _jobs_big)
    rest = _timed("halves", real, _jobs_big)

    def run(*jobs):
        is_gemm = any(getattr(fn, "func", None) is _matmul for _, fn, _ in jobs)
        return (gemm if is_gemm else rest)(*jobs)

    return run


def _independent(one):
    """halves.independent timed job by job: each that would split or run whole beside another
    as ``one`` (together) times it; at 2 threads only a GEMM too small to halve runs alone."""

    def run(*jobs):
        for job in jobs:
            one(job)

    return run


def instrument() -> None:
    """Wrap this tree's split points and linear layers (whichever exist in it)."""
    from emulator import moe

    mods = [ops, block, model, optim, moe]
    for extra in ("attention", "linear"):
        try:  # a tree from before emulator/attention.py (linear.py)
            mods.append(importlib.import_module(f"emulator.{extra}"))
        except ImportError:
            pass
    for name, axis in (("in_halves", 0), ("by_columns", -1), ("by_batch", 0)):
        real = getattr(halves, name, None)
        if real is None:
            continue
        one = _timed("halves", lambda fn, *a: fn(*a), _big(axis))
        for mod in mods:
            if getattr(mod, name, None) is real:
                setattr(mod, name, one)
    real = getattr(halves, "together", None)
    if real is not None:  # the fourth pass: jobs handed off together
        one = _together(lambda *jobs: [fn(*arrays) for _, fn, arrays in jobs])
        for mod in [halves, *mods]:  # halves: its deferred and together_then call it
            if getattr(mod, "together", None) is real:
                mod.together = one
    real = getattr(halves, "independent", None)
    if real is not None:  # the fifth pass: AdamW's and the weight gradients' jobs at once
        for mod in [halves, *mods]:
            if getattr(mod, "independent", None) is real:
                mod.independent = _independent(one)
    for name in ("linear_forward", "linear_backward"):
        real = getattr(ops, name)
        for mod in mods:
            if getattr(mod, name, None) is real:
                setattr(mod, name, _timed("gemm", real))


def measure(dtype: str, steps: int) -> dict:
    from benchmarks.model import SHAPE

    cfg = model.ModelConfig(**SHAPE, dtype=dtype)
    params = model.init_params(cfg, 0)
    opt = AdamW(params)
    tokens, targets = synthetic_batch(0, 0, 8, cfg.max_seq_len, cfg.vocab_size)
    per = []
    with blas.limit(1):
        for i in range(steps + 1):
            for k in _acc:
                _acc[k] = 0.0
            t0 = time.thread_time()
            _, cache = model.model_forward(params, tokens, targets, cfg)
            opt.step(params, model.model_backward(cache))
            total = time.thread_time() - t0
            if i:  # the first step warms caches
                per.append({"total": total, "gemm": _acc["gemm"], "halves": _acc["halves"]})
    return {k: sorted(p[k] for p in per)[len(per) // 2] * 1e3 for k in per[0]}  # medians, ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "float64"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    instrument()
    print(f"tree {halves.__file__.rsplit('/emulator/', 1)[0]}; 1-thread CPU per step, ms")
    for dt in args.dtype:
        m = measure(dt, args.steps)
        serial = m["total"] - m["gemm"] - m["halves"]
        two = serial + (m["gemm"] + m["halves"]) / 2
        print(f"{dt:8s} total {m['total']:6.1f}  gemm {m['gemm']:6.1f}  halves {m['halves']:6.1f}"
              f"  serial {serial:5.1f}  -> ideal 2-thread {two:6.1f} ms, one thread busy "
              f"{serial / two:5.1%} of it")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
