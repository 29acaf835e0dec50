"""Benchmark (not a test): one optimizer step of DDP and ZeRO-1/2/3 on P virtual ranks against
the single-rank reference step on the same global batch, as a ratio printed in the same run.
Both sides run with the BLAS threads of one virtual rank (emulator/blas.py).

    python -m emulator bench layouts [--ranks 4] [--repeat 3] [--d-model 64] [--layers 4]

Virtual ranks are threads of one process, so the ratio measures the emulator's overhead
(messages are copied through mailboxes, per-layer hooks, flat-buffer copies), not a speed-up:
the P ranks share the same cores that run the reference. Both sides include init_params;
the layouts also include starting the P threads (emulator.spawn).
"""

from __future__ import annotations

import time

import emulator
from emulator import blas
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig, n_params
from emulator.reference import reference_train
from parallel.data.train import train_data_parallel
from tools import args as cli

LAYOUTS = [("ddp", {}), ("1", {}), ("2", {}), ("3", {}), ("3", {"prefetch": True}),
           ("3", {"reshard_after_forward": False})]  # fmt: skip


def _best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    p = cli.parser(__doc__, prog="python -m emulator bench layouts")
    p.add_argument("--ranks", type=cli.ranks_flag, default=4)
    p.add_argument("--repeat", type=cli.positive_int, default=3)
    p.add_argument("--d-model", type=cli.positive_int, default=64, help="H (4 heads)")
    p.add_argument("--layers", type=cli.positive_int, default=4)
    p.add_argument("--batch", type=cli.positive_int, default=16)
    p.add_argument("--seq", type=cli.positive_int, default=32)
    args = p.parse_args(argv)
    if args.d_model % 4:
        p.error(f"argument --d-model: {args.d_model} is not a multiple of the 4 heads")
    if args.batch % args.ranks:
        p.error(f"argument --batch: {args.batch} is not a multiple of --ranks {args.ranks}")
    cfg = ModelConfig(vocab_size=256, max_seq_len=args.seq, d_model=args.d_model, n_heads=4,
                      n_layers=args.layers)  # fmt: skip
    P = args.ranks

    def batches(step):
        return synthetic_batch(0, step, args.batch, args.seq, cfg.vocab_size)

    with blas.limit(blas.per_rank(P)):  # what each of the P ranks gets inside spawn
        ref_t = _best(lambda: reference_train(cfg, 0, batches, 1, microbatches=P), args.repeat)
    rows = [["reference (1 rank)", "-", f"{ref_t * 1e3:.1f}", "1.00", "0"]]
    for stage, kw in LAYOUTS:
        out = {}

        def step(stage=stage, kw=kw, out=out):
            out["runs"] = emulator.spawn(
                lambda c: train_data_parallel(c, cfg, 0, batches, 1, stage=stage, **kw), P
            )

        t = _best(step, args.repeat)
        sb = out["runs"][0].step_bytes[0]
        sent = sb["grads"][0] + sb["params"][0]
        label = f"{'DDP' if stage == 'ddp' else 'ZeRO-' + stage}" + "".join(
            f" {k}={v}" for k, v in kw.items()
        )
        rows.append([label, P, f"{t * 1e3:.1f}", f"{t / ref_t:.2f}", sent])
    print(f"one optimizer step, global batch {args.batch} x {args.seq} tokens, "
          f"Psi = {n_params(cfg)} parameters (float64), best of {args.repeat}; BLAS threads per "
          f"rank {blas.per_rank(P)} (pool {blas.threads()})")  # fmt: skip
    head = ["layout", "ranks", "ms / step", "x reference", "bytes sent / rank"]
    print(format_table(head, rows))
    return 0
