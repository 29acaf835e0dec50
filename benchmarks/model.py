"""Benchmark: one forward + backward + AdamW step of the reference model on this machine.

Shape: V=512, T=128, H=256, A=4, L=4, B=8, S=128 (about 3.5 M parameters), float32 and float64.
Wired as ``python -m emulator bench model``; also ``python -m benchmarks.model``.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

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


def bench_model(argv=None) -> int:
    ap = cli.parser(__doc__, prog="python -m emulator bench model")
    ap.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=DTYPES)
    ap.add_argument("--batch", type=cli.positive_int, default=8)
    ap.add_argument("--repeats", type=cli.positive_int, default=3, help="timed steps (best of)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    args = ap.parse_args(argv)
    print(blas_info())
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
