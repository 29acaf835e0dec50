"""Benchmark: one forward + backward + AdamW step of the reference model on this machine.

Shape: V=512, T=128, H=256, A=4, L=4, B=8, S=128 (about 3.5 M parameters), float32 and float64.
Wired as ``python -m emulator bench model``; also ``python -m benchmarks.model``.

    python -m emulator bench model --against OLD/emulator/ops.py [--rounds 7]
    python -m emulator bench model --digest      # bitwise fingerprints (benchmarks/model_digest.py)

interleaves the step with this tree's ops and with another ops.py (e.g. `git show REV:emulator/
ops.py > /tmp/ops_old.py`): each round times one step with each (A B, B A, A B ..., after a warm-up) and
the ratio new / old of that round; min / median / max printed. The other file's functions are
swapped into emulator.block / model / moe for its steps (this benchmark only).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

from emulator import blas
from emulator.data import synthetic_batch
from emulator.flops import step_flops
from emulator.model import ModelConfig, init_params, model_backward, model_forward, n_params
from emulator.optim import AdamW
from emulator.precision import DTYPES
from tools import args as cli

SHAPE = {"vocab_size": 512, "max_seq_len": 128, "d_model": 256, "n_heads": 4, "n_layers": 4}


def blas_info() -> str:
    """numpy's BLAS and thread settings (threadpoolctl if installed; no new dependency)."""
    lines = [f"numpy {np.__version__}"]
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg.get("Build Dependencies", {}).get("blas", {})
        lines.append(f"BLAS {blas.get('name', '?')} {blas.get('version', '')}".rstrip())
    except TypeError:  # numpy < 1.25 has no mode=
        lines.append("BLAS: see numpy.show_config()")
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
    env = {k: os.environ[k] for k in names if k in os.environ}
    lines.append(f"cpus {os.cpu_count()}; env {env or 'no thread variables set'}")
    try:
        import threadpoolctl

        for pool in threadpoolctl.threadpool_info():
            lines.append(f"threadpool {pool['internal_api']} threads={pool['num_threads']}")
    except ImportError:
        pass
    return "\n".join(lines)


def time_step(dtype: str, batch: int, repeats: int, recompute: str = "none") -> float:
    """Best-of-``repeats`` seconds of one full training step (after one warm-up step)."""
    cfg = ModelConfig(**SHAPE, dtype=dtype)
    params = init_params(cfg, 0)
    opt = AdamW(params)
    tokens, targets = synthetic_batch(0, 0, batch, cfg.max_seq_len, cfg.vocab_size)
    best = float("inf")
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        _, cache = model_forward(params, tokens, targets, cfg, recompute=recompute)
        opt.step(params, model_backward(cache))
        if i:  # the first step warms caches and BLAS
            best = min(best, time.perf_counter() - t0)
    return best


@contextlib.contextmanager
def ops_from(path: str):
    """Run the block with the layer functions of the ops.py at ``path`` in place of ours."""
    import emulator.block
    import emulator.model
    import emulator.moe
    import emulator.ops

    spec = importlib.util.spec_from_file_location("_bench_other_ops", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    saved = []
    for mod in (emulator.block, emulator.model, emulator.moe):
        for name, fn in vars(emulator.ops).items():
            if callable(fn) and getattr(mod, name, None) is fn and hasattr(other, name):
                saved.append((mod, name, fn))
                setattr(mod, name, getattr(other, name))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def against(dtype: str, batch: int, rounds: int, path: str, threads: int = 1) -> dict:
    """Interleaved step times (ms) with our ops (new) and the file's (old), one step each per
    round, with the BLAS pool at ``threads``."""
    cfg = ModelConfig(**SHAPE, dtype=dtype)
    params = init_params(cfg, 0)
    opt = AdamW(params)
    tokens, targets = synthetic_batch(0, 0, batch, cfg.max_seq_len, cfg.vocab_size)

    def step():
        t0 = time.perf_counter()
        _, cache = model_forward(params, tokens, targets, cfg)
        opt.step(params, model_backward(cache))
        return time.perf_counter() - t0

    out = {"new": [], "old": []}
    with blas.limit(threads):
        step()
        with ops_from(path):
            step()
        for i in range(rounds):  # A B, then B A: neither side always runs second
            if i % 2:
                with ops_from(path):
                    out["old"].append(step() * 1e3)
            out["new"].append(step() * 1e3)
            if not i % 2:
                with ops_from(path):
                    out["old"].append(step() * 1e3)
    out["ratio"] = [a / b for a, b in zip(out["new"], out["old"], strict=True)]
    return out


def _mmm(xs, fmt):
    return "/".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


def bench_model(argv=None) -> int:
    ap = cli.parser(__doc__, prog="python -m emulator bench model")
    ap.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=DTYPES)
    ap.add_argument("--batch", type=cli.positive_int, default=8)
    ap.add_argument("--repeats", type=cli.positive_int, default=3, help="timed steps (best of)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--against", default=None, help="another ops.py to interleave with")
    ap.add_argument("--rounds", type=cli.positive_int, default=7, help="with --against")
    ap.add_argument("--threads", type=cli.positive_int, default=1, help="BLAS, with --against")
    ap.add_argument("--digest", action="store_true", help="print bitwise fingerprints, no timing")
    args = ap.parse_args(argv)
    if args.digest:
        from benchmarks import model_digest

        return model_digest.main()
    if args.against and not os.path.isfile(args.against):
        ap.error(f"argument --against: {args.against!r} is not a file")
    print(blas_info())
    if args.against:
        print(f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
        for dt in args.dtype:
            m = against(dt, args.batch, args.rounds, args.against, args.threads)
            print(f"{dt:8s} ours ms {_mmm(m['new'], '{:.1f}')}  other ms "
                  f"{_mmm(m['old'], '{:.1f}')}  ours/other {_mmm(m['ratio'], '{:.3f}')} "
                  f"(min/median/max, {args.rounds} interleaved rounds, {args.threads} BLAS "
                  "thread(s))")  # fmt: skip
        return 0
    cfg = ModelConfig(**SHAPE)
    S = cfg.max_seq_len
    fl = step_flops(cfg, args.batch, S, recompute=args.recompute)["hardware"]
    print(
        f"model {SHAPE} B={args.batch} S={S}: {n_params(cfg):,} params, {fl / 1e9:.2f} GFLOP/step"
    )
    for dt in args.dtype:
        sec = time_step(dt, args.batch, args.repeats, args.recompute)
        print(f"{dt:8s} step {sec * 1e3:8.1f} ms   {fl / sec / 1e9:6.1f} GFLOP/s (matmuls only)")
    return 0


if __name__ == "__main__":
    sys.exit(bench_model(sys.argv[1:]))
