"""`python -m emulator dryrun --preset NAME --dp D [--tp T] [--pp P] [--cp C] [--ep E] ...`

Runs the layout's training code - the one N-D program parallel.train, for every layout - one
step on shape-only arrays, one representative rank per role (planning/nd_dryrun.py: one per
pipeline stage and cp rank), and prints per rank the memory ledger's peak bytes per category and
the bytes it sent per axis, each checked against parallel/nd_cost.py's closed forms and shown
beside the course's analytic figures (planning/nd_report.py).

Context parallelism: --cp C with --cp-method ring | all-gather | ulysses and --cp-balance zigzag
| contiguous. Expert parallelism: --ep E on an MoE version of the preset (--experts, --top-k,
--capacity-factor; the ep group drawn from the dp ranks, so E divides --dp), under the stated
routing assumption "padded to capacity" (--dispatch padded); exact dispatch's sizes follow the
routing and are refused by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from planning import memory, presets


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m emulator dryrun", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", required=True, help=f"one of {', '.join(presets.PRESETS)}")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel degree")
    ap.add_argument("--cp-method", default="ring", help="ring | all-gather | ulysses")
    ap.add_argument("--cp-balance", default="zigzag", help="zigzag | contiguous")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel degree (divides --dp)")
    ap.add_argument("--experts", type=int, default=None, help="MoE: experts per block")
    ap.add_argument("--top-k", type=int, default=2, help="MoE: experts per token")
    ap.add_argument("--capacity-factor", type=float, default=1.25, help="MoE: slots per expert")
    ap.add_argument("--dispatch", default="padded", help="ep: padded (exact is refused)")
    ap.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    ap.add_argument("--seq", type=int, default=None, help="default: the preset's")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--microbatches", type=int, default=None, help="per step (pp: default pp)")
    ap.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | interleaved | zb-h1")
    ap.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved)")
    ap.add_argument("--sequence-parallel", action="store_true", help="with --tp")
    ap.add_argument("--recompute", choices=memory.RECOMPUTE, default="none")
    ap.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next unit early")
    ap.add_argument("--no-reshard", action="store_true", help="ZeRO-3: keep units gathered")
    ap.add_argument("--ranks", default=None, help="comma-separated ranks (default: one per role)")
    ap.add_argument("--tags", action="store_true", help="each rank's top 8 ledger tags")
    ap.add_argument("--workers", type=int, default=2, help="processes running representatives")
    ap.add_argument("--json", action="store_true")
    return ap


def model_config(a, p, seq: int):
    """The preset's shape; with --experts (or --ep > 1) every block an MoE of that many experts."""
    cfg = p.model_config(seq)
    if a.experts is None and a.ep > 1:
        raise ValueError(f"--ep {a.ep} needs an MoE model: give --experts E (E divisible by ep)")
    if a.experts is None:
        return cfg
    return dataclasses.replace(
        cfg, n_experts=a.experts, moe_top_k=a.top_k, capacity_factor=a.capacity_factor
    )  # fmt: skip (ValueError if bad)


def main(argv=None) -> int:
    from emulator.config import n_params
    from parallel.layout import Layout
    from planning import nd_report
    from planning.nd_dryrun import Timing, cpu_seconds, dry_nd, peak_rss_mib

    a = parser().parse_args(argv)
    try:
        p = presets.get(a.preset)
        seq = a.seq or p.seq
        m = a.microbatches or max(1, a.pp)
        lay = Layout(dp=a.dp, pp=a.pp, tp=a.tp, cp=a.cp, cp_method=a.cp_method,
                     cp_balance=a.cp_balance, ep=a.ep, zero=a.zero,
                     microbatches=m, schedule=a.schedule, chunks=a.chunks,
                     sequence_parallel=a.sequence_parallel, recompute=a.recompute, dtype="mixed",
                     prefetch=a.prefetch, reshard_after_forward=not a.no_reshard)  # fmt: skip
        lay = dataclasses.replace(lay, dispatch=a.dispatch) if a.ep > 1 else lay
        cfg, B = model_config(a, p, seq), a.dp * a.micro_batch * m
        bad = lay.problems(lay.world, cfg, (B, seq))
        if bad:
            raise ValueError(f"{lay} cannot run: " + "; ".join(bad))
        # the course's formulas have no cp or ep term: priced on dp x tp x pp at the full sequence
        course = memory.plan(p, lay.world // lay.cp, a.dp, a.tp, a.pp, a.zero, a.recompute, seq,
                             a.micro_batch, 0.0, even_pp=False)  # fmt: skip
        ranks = None if a.ranks is None else [int(r) for r in a.ranks.split(",")]
        if ranks and not all(0 <= r < lay.world for r in ranks):
            raise ValueError(f"--ranks {a.ranks}: ranks are 0..{lay.world - 1}")
        t0 = time.perf_counter()
        runs = dry_nd(cfg, lay, B, seq, ranks, workers=a.workers)
        total = Timing(time.perf_counter() - t0, cpu_seconds(runs))
    except ValueError as exc:
        print(f"dryrun: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    checks = nd_report.check_all(cfg, lay, B, seq, runs)
    if a.json:
        print(json.dumps(nd_report.as_json(lay, runs, checks, total, peak_rss_mib())))
    else:
        print(nd_report.report(p, lay, B, seq, runs, checks, total, course, n_params(cfg), a.tags))
        print(f"peak resident memory of this process: {peak_rss_mib():.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
