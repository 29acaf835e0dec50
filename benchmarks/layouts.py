"""Benchmark (not a test): one optimizer step of every layout on virtual ranks against the
single-rank reference step on the same global batch, interleaved, as ratios from the same run.

    python -m emulator bench layouts [--size small|compute|both|tiny] [--rounds 5] [--only ddp]
    python -m emulator bench layouts --costs [--only ddp]   # profile categories + ledger share

Rounds interleave A B A B: each round times the reference step (A) and then the layout (B) and
keeps the ratio B / A of that round, so a disturbance on this shared machine hits one round's
pair, not a whole column. Printed: the layout's min / median / max ms, the reference's, and the
ratio's min / median / max over the rounds, with the load average and the CPU seconds burnt per
wall second (the layouts' ranks are threads: cores busy < ranks means the GIL or waits); before
the ratio, the per-step process CPU of each side, medians (the figure other jobs on the machine
disturb least), and the process's minor page faults per step.
BLAS threads: `emulator.spawn` runs the P ranks under blas.limit(blas.per_rank(P)) (cores // P,
and 1 on a machine with <= 4 cores; DISTEMU_BLAS_THREADS overrides); the reference runs under
the same limit, so both sides get one virtual rank's BLAS threads.
Virtual ranks share the cores the reference runs on: the ratio is the emulator's overhead
(message copies through mailboxes, per-layer hooks, flat buffers, the ledger), not a speed-up.
Both sides include init_params (the layouts' P ranks share one draw per spawn:
emulator/shared_init.py); the layouts also include starting P threads and gathering the
full-shape parameters at the end of parallel.train (uncounted, for the checks).
Sizes: small (H 64, S 32, 4 layers: messages and Python dominate) and compute (H 256, S 64,
4 layers: the matmuls dominate), "both" of them the goal's sizes; tiny (H 16, S 8, 4 layers,
V 32: what one hypothesis example of parallel.testing costs, the per-call floors alone) only
when asked for; global batch 16 on every size. The EP rows come twice: with
ep_train's default grad_sync="allreduce" (one ring all-reduce per gradient tensor) and with
"buckets" (grad_sync="ddp": DDP's 25 MB buckets, as the other data-parallel rows sync theirs).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import statistics
import time

import emulator
from emulator import blas
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig, n_params
from emulator.reference import reference_train
from tools import args as cli

SIZES = {
    "small": {"d_model": 64, "max_seq_len": 32, "n_layers": 4, "vocab_size": 256},
    "compute": {"d_model": 256, "max_seq_len": 64, "n_layers": 4, "vocab_size": 256},
    "tiny": {"d_model": 16, "max_seq_len": 8, "n_layers": 4, "vocab_size": 32},  # not in "both"
}
GOAL_SIZES = ("small", "compute")  # --size both
BATCH = 16


@dataclasses.dataclass(frozen=True)
class Case:
    label: str
    ranks: int
    ref_microbatches: int  # the reference's micro-batches for the same global batch
    run: object  # run(comm, cfg, batches) -> the layout's run object (one step)
    moe: bool = False


def _dp(stage, **kw):
    from parallel.data.train import train_data_parallel

    return lambda c, cfg, b: train_data_parallel(c, cfg, 0, b, 1, stage=stage, **kw)


def _nd(**kw):
    import parallel
    from parallel.layout import Layout

    lay = Layout(**kw)
    return lambda c, cfg, b: parallel.train(c, lay, cfg, b, 1, seed=0)


def _ep(ep, k=1, grad_sync="allreduce"):
    from parallel.expert.train import ep_train

    return lambda c, cfg, b: ep_train(c, cfg, 0, b, 1, ep=ep, microbatches=k, grad_sync=grad_sync)


def _cp(cp, k=1):
    from parallel.context.train import cp_train

    return lambda c, cfg, b: cp_train(c, cfg, 0, b, 1, cp=cp, microbatches=k)


def cases() -> list[Case]:
    return [
        Case("DDP", 4, 4, _dp("ddp")),
        Case("ZeRO-1", 4, 4, _dp("1")),
        Case("ZeRO-2", 4, 4, _dp("2")),
        Case("ZeRO-3", 4, 4, _dp("3")),
        Case("ZeRO-3 prefetch", 4, 4, _dp("3", prefetch=True)),
        Case("tp4", 4, 1, _nd(tp=4)),
        Case("tp4 SP", 4, 1, _nd(tp=4, sequence_parallel=True)),
        Case("pp4 1f1b m4", 4, 4, _nd(pp=4, microbatches=4)),
        Case("dp2 x tp2", 4, 2, _nd(dp=2, tp=2)),
        Case("pp2 x dp2 m2", 4, 4, _nd(dp=2, pp=2, microbatches=2)),
        Case("dp2 x pp2 x tp2 z1 m2", 8, 4, _nd(dp=2, pp=2, tp=2, zero=1, microbatches=2)),
        Case("dp2 x pp2 x tp2 z3 m2", 8, 4, _nd(dp=2, pp=2, tp=2, zero=3, microbatches=2)),
        Case("ep4 (E 4, top-2)", 4, 4, _ep(4), moe=True),
        Case("dp2 x ep2 (E 4, top-2)", 4, 4, _ep(2), moe=True),
        # the same with the replicated and expert gradients in DDP's 25 MB buckets, as the DDP,
        # ZeRO and N-D rows sync theirs (ep_train's default above: one all-reduce per tensor)
        Case("ep4 (E 4, top-2) buckets", 4, 4, _ep(4, grad_sync="ddp"), moe=True),
        Case("dp2 x ep2 (E 4, top-2) buckets", 4, 4, _ep(2, grad_sync="ddp"), moe=True),
        Case("cp4 ring zigzag", 4, 1, _cp(4)),
        Case("dp2 x cp2 ring zigzag", 4, 2, _cp(2)),
    ]


def config(size: str, moe: bool) -> ModelConfig:
    extra = {"n_experts": 4, "moe_top_k": 2} if moe else {}
    return ModelConfig(n_heads=4, **SIZES[size], **extra)


def batches_for(cfg):
    return lambda step: synthetic_batch(0, step, BATCH, cfg.max_seq_len, cfg.vocab_size)


def step_fns(case: Case, size: str, **spawn_kw):
    """(reference step, layout step): zero-argument callables, one optimizer step each."""
    cfg = config(size, case.moe)
    batches = batches_for(cfg)

    def ref():
        with blas.limit(blas.per_rank(case.ranks)):  # what each of the P ranks gets in spawn
            reference_train(cfg, 0, batches, 1, microbatches=case.ref_microbatches)

    def lay():
        emulator.spawn(lambda c: case.run(c, cfg, batches), case.ranks, timeout=600, **spawn_kw)

    return ref, lay


def timed(fn) -> tuple[float, float]:
    """(wall s, CPU s of the whole process: every thread) of one call."""
    return timed_faults(fn)[:2]


def timed_faults(fn) -> tuple[float, float, int]:
    """(wall s, process CPU s, minor page faults of the process) of one call."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    t, c = time.perf_counter() - t0, time.process_time() - c0
    return t, c, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def spread(xs, fmt="{:.1f}", scale=1.0) -> str:
    xs = [x * scale for x in xs]
    return "/".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def interleave(ref, lay, rounds: int) -> dict:
    ref(), lay()  # warm-up: imports, BLAS, allocator
    out = {k: [] for k in ("ref", "lay", "ratio", "ref_cpu", "lay_cpu", "cpu", "faults")}
    for _ in range(rounds):
        (a, ac, af), (b, bc, bf) = timed_faults(ref), timed_faults(lay)
        out["ref"].append(a)
        out["lay"].append(b)
        out["ratio"].append(b / a)
        out["ref_cpu"].append(ac / a)
        out["lay_cpu"].append(bc / b)
        out["cpu"].append((bc, ac))  # process CPU s: the load-robust figure
        out["faults"].append((bf, af))
    return out


def cpu_cells(m) -> list:
    """Per-step process CPU ms layout / reference and their ratio, minor faults per step (layout
    / reference): medians over the rounds."""
    med = statistics.median
    lay, ref = med(c[0] for c in m["cpu"]), med(c[1] for c in m["cpu"])
    faults = f"{med(f[0] for f in m['faults']):.0f}/{med(f[1] for f in m['faults']):.0f}"
    return [f"{1e3 * lay:.0f}/{1e3 * ref:.0f}", f"{lay / ref:.2f}", faults]


def bench(sizes, chosen, rounds: int) -> None:
    for size in sizes:
        rows = []
        print(f"\n== size {size}: {SIZES[size]}, A 4, global batch {BATCH} (float64), "
              f"Psi {n_params(config(size, False)):,} dense / {n_params(config(size, True)):,} "
              f"MoE; load average before {load()}")  # fmt: skip
        for case in chosen:
            m = interleave(*step_fns(case, size), rounds)
            rows.append([case.label, case.ranks, blas.per_rank(case.ranks),
                         spread(m["ref"], scale=1e3), spread(m["lay"], scale=1e3),
                         *cpu_cells(m), spread(m["ratio"], "{:.2f}"),
                         f"{statistics.median(m['lay_cpu']):.2f}",
                         "yes" if statistics.median(m["ratio"]) <= 1.2 else "no"])  # fmt: skip
        print(format_table(["layout", "ranks", "BLAS/rank", "reference ms min/med/max",
                            "layout ms min/med/max", "CPU ms lay/ref", "CPU ratio",
                            "faults lay/ref", "ratio min/med/max", "cores busy", "<= 1.2x"],
                           rows))  # fmt: skip
        print(f"{rounds} interleaved rounds per row (reference, layout); ratio per round; load "
              f"average after {load()}; pool {blas.threads()} BLAS threads outside spawn")  # fmt: skip


def main(argv=None) -> int:
    p = cli.parser(__doc__, prog="python -m emulator bench layouts")
    p.add_argument("--size", default="both", choices=[*SIZES, "both"])
    p.add_argument("--rounds", type=cli.positive_int, default=5)
    p.add_argument("--only", default="", help="comma-separated substrings of layout labels")
    p.add_argument("--costs", action="store_true",
                   help="profile categories and the ledger / call-check share instead")  # fmt: skip
    args = p.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    chosen = [c for c in cases() if not wanted or any(w in c.label for w in wanted)]
    if not chosen:
        p.error(f"argument --only: {args.only!r} matches no layout; labels: "
                f"{', '.join(c.label for c in cases())}")  # fmt: skip
    sizes = list(GOAL_SIZES) if args.size == "both" else [args.size]
    if args.costs:
        from benchmarks.layout_costs import costs

        costs(sizes, chosen, args.rounds)
    else:
        bench(sizes, chosen, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
