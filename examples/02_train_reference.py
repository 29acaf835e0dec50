"""Train the single-rank reference model on the synthetic delayed-copy task, and check its books.

    python examples/02_train_reference.py          (no distributed runtime needed)
    python examples/02_train_reference.py --d-model 64 --layers 3 --steps 100 --json out.json

One rank does the work; under mpiexec or `run -n P` the other ranks only wait for its verdict.

Prints the loss curve, the parameter count, bytes per parameter by category in float64, float32
and mixed precision (16 B/param), the activation bytes per block for each recompute mode beside
the formula, and the FLOPs per step. Exits non-zero if any formula check fails or the loss does
not fall.
"""

from __future__ import annotations

import sys

import numpy as np

from emulator.data import synthetic_batch
from emulator.flops import (
    activation_bytes_per_block,
    megatron_activation_bytes,
    six_n_flops,
    step_flops,
)
from emulator.memory import MemoryLedger
from emulator.model import RECOMPUTE, ModelConfig, init_params, model_forward, n_params
from emulator.reference import reference_train
from tools import args as cli
from tools.run import progress, record, run_example, say_verdict

SIZES = {"vocab": 16, "seq": 16, "d_model": 32, "heads": 2, "layers": 2}


def main(comm, a) -> int:
    if comm.rank:
        return 0  # a single-rank example: rank 0 does the work and prints
    np.seterr(all="raise", under="ignore")
    SHAPE, B, S, STEPS = cli.model_kwargs(a), a.batch, a.seq, a.steps
    failures = []

    def check(ok, what):
        print(f"  [{'ok' if ok else 'FAIL'}] {what}")
        if not ok:
            failures.append(what)

    cfg = ModelConfig(**SHAPE)
    N = n_params(cfg)
    print(f"model {SHAPE}: {N:,} parameters; batch B={B} S={S}")

    def batches(step):
        return synthetic_batch(a.seed, step, B, S, cfg.vocab_size)

    print(f"\n1. training {STEPS} steps, float64, AdamW lr=1e-2, clip 1.0")
    run = reference_train(cfg, a.seed, progress(batches, STEPS, "training step"), STEPS, lr=1e-2,
                          max_norm=1.0)  # fmt: skip
    for s in sorted({x for x in (0, 24, 49, 99, 149, STEPS - 1) if x < STEPS}):
        print(f"  step {s + 1:4d}  loss {run.losses[s]:.4f}")
    check(run.losses[-1] < 0.1 * run.losses[0], "loss fell by more than 10x")

    print("\n2. bytes per parameter (params + grads + optimizer), from the memory ledger")
    for dt, want in (("float64", 32), ("float32", 16), ("mixed", 16)):
        mem = MemoryLedger()
        reference_train(ModelConfig(**SHAPE, dtype=dt), a.seed, batches, 1, mem=mem)
        cats = {c: mem.current(c) / N for c in ("params", "grads", "optimizer")}
        record(**{f"bytes_per_param_{dt}": cats})
        parts = " + ".join(f"{c} {v:g}" for c, v in cats.items())
        check(sum(cats.values()) == want, f"{dt:8s} {parts} = {sum(cats.values()):g} B/param")

    print("\n3. activation bytes per block (ledger vs formula; Megatron's sbh(34+5as/h) in bf16)")
    tokens, targets = batches(0)
    for dt in ("float64", "mixed"):
        c = ModelConfig(**SHAPE, dtype=dt)
        for mode in RECOMPUTE:
            mem = MemoryLedger()
            model_forward(init_params(c, a.seed), tokens, targets, c, recompute=mode, mem=mem)
            got, want = (
                mem.nbytes("activations", "blocks.0"),
                activation_bytes_per_block(c, B, S, mode),
            )
            check(got == want, f"{dt:8s} {mode:9s} ledger {got:8,d}  formula {want:8,d}")
            record(**{f"activation_bytes_per_block_{dt}_{mode}": got})
    mega = megatron_activation_bytes(B, S, cfg.d_model, cfg.n_heads)
    print(f"  (Megatron eq. 1 for the same shape, 16-bit with dropout: {mega:,.0f} bytes)")

    print("\n4. matmul FLOPs per step")
    for mode in RECOMPUTE:
        f = step_flops(cfg, B, S, recompute=mode)
        print(f"  {mode:9s} model {f['model']:12,d}  hardware {f['hardware']:12,d}"
              f"  (HFU/MFU = {f['hardware'] / f['model']:.3f})")  # fmt: skip
    check(
        step_flops(cfg, B, S)["model"] == six_n_flops(cfg, B, S),
        "model FLOPs == 6N + 12LSH per token",
    )

    summary = (
        f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.4f} in {STEPS} steps; bytes/param "
        f"(params + grads + optimizer, 3 precisions), activation bytes and FLOPs == formulas"
    )
    print()
    say_verdict(failures, summary, losses=[float(x) for x in run.losses], n_params=N)
    return 0 if not failures else 1


def parse(argv=None):
    p = cli.parser(__doc__)
    cli.add_common(p, model=SIZES, batch=8, steps=200)
    return cli.parse(p, argv)


if __name__ == "__main__":
    a = parse()
    sys.exit(run_example(lambda comm: main(comm, a), a, world_size=1))
