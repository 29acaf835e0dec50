"""`python -m emulator dryrun --preset NAME --dp D [--tp T] [--pp P] [--zero Z] ...`

Runs the layout's real training code, one step, on shape-only arrays, one representative rank
per role, and prints per rank the memory ledger's peak bytes per category and the bytes it sent.
Without --cp the code is the one N-D program parallel.train (planning/nd_dryrun.py: dp x pp x tp,
SP, ZeRO 0-3, every schedule; one rank per pipeline stage), checked against parallel/nd_cost.py's
closed forms and shown beside the course's analytic figures (planning/nd_report.py). With --cp the
layout is dp x cp through parallel/context/train.py (planning/dryrun.py), shown beside the
course's and this model's exact formulas (planning/exact.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from planning import exact, memory, presets
from planning.dryrun import Layout, dry_layout
from planning.nd_report import tags

GIB = memory.GIB
STATE = ("params", "grads", "optimizer")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m emulator dryrun", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--preset", required=True, help=f"one of {', '.join(presets.PRESETS)}")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel degree (dp x cp)")
    ap.add_argument("--cp-method", default="ring", help="ring | all-gather | ulysses")
    ap.add_argument("--cp-balance", default="zigzag", help="zigzag | contiguous")
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


def dp_formula(cfg, lay: Layout) -> int:
    """The ZeRO paper's per-step bytes as this code moves them (padding, k micro-batches)."""
    from emulator.config import param_shapes
    from parallel.data import cost
    from parallel.data.flat import fsdp_units, make_buckets

    shapes = param_shapes(cfg)
    stage = "ddp" if lay.zero == 0 else str(lay.zero)
    layouts = fsdp_units(shapes, lay.dp) if lay.zero == 3 else make_buckets(shapes, lay.dp, 25.0, 2)
    b = cost.step_bytes(stage, layouts, cfg.dtype, lay.microbatches, lay.reshard)
    return b["grads"] + b["params"]


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return _main_cp(a) if a.cp > 1 else _main_nd(a)


def _main_nd(a) -> int:
    from emulator.config import n_params
    from parallel.layout import Layout as NDLayout
    from planning import nd_report
    from planning.nd_dryrun import Timing, cpu_seconds, dry_nd, peak_rss_mib

    try:
        p = presets.get(a.preset)
        seq = a.seq or p.seq
        m = a.microbatches or max(1, a.pp)
        lay = NDLayout(dp=a.dp, pp=a.pp, tp=a.tp, zero=a.zero, microbatches=m,
                       schedule=a.schedule, chunks=a.chunks, sequence_parallel=a.sequence_parallel,
                       recompute=a.recompute, dtype="mixed", prefetch=a.prefetch,
                       reshard_after_forward=not a.no_reshard)  # fmt: skip
        cfg, B = p.model_config(seq), a.dp * a.micro_batch * m
        bad = lay.problems(lay.world, cfg, (B, seq))
        if bad:
            raise ValueError(f"{lay} cannot run: " + "; ".join(bad))
        course = memory.plan(p, lay.world, a.dp, a.tp, a.pp, a.zero, a.recompute, seq,
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


def _main_cp(a) -> int:
    try:
        p = presets.get(a.preset)
        seq = a.seq or p.seq
        m = a.microbatches or (max(1, a.pp))
        lay = Layout(dp=a.dp, tp=a.tp, pp=a.pp, zero=a.zero, microbatches=m, schedule=a.schedule,
                     sp=a.sequence_parallel, recompute=a.recompute, prefetch=a.prefetch,
                     reshard=not a.no_reshard, cp=a.cp, cp_method=a.cp_method,
                     cp_balance=a.cp_balance)  # fmt: skip
        lay.check()
        # the course's formulas and this model's have no cp term: priced without it (dp x tp x pp)
        row = memory.plan(p, lay.size // lay.cp, a.dp, a.tp, a.pp, a.zero, a.recompute, seq,
                          a.micro_batch, 0.0, even_pp=False)  # fmt: skip
        ranks = None if a.ranks is None else [int(r) for r in a.ranks.split(",")]
        t0 = time.perf_counter()
        runs = dry_layout(p.model_config(seq), lay, a.dp * a.micro_batch * m, seq, ranks)
        total = time.perf_counter() - t0
    except ValueError as exc:
        print(f"dryrun: {exc}", file=sys.stderr)
        return 2
    ex = exact.price(p, row, seq, a.micro_batch, reshard_after_forward=not a.no_reshard,
                     prefetch=a.prefetch)  # fmt: skip
    if a.json:
        print(json.dumps({"layout": vars(lay), "seconds": total, "ranks": {
            r: {"role": v["role"], "seconds": v["seconds"], "memory": v["figures"]["memory"],
                "bytes_sent_by_tag": tags(v["figures"])} for r, v in runs.items()}}))  # fmt: skip
        return 0
    print(f"dry run: {p.name} as this model ({ex.params / 1e9:.2f}B params; published "
          f"{p.params / 1e9:.1f}B), seq={seq}, micro-batch={a.micro_batch}, {m} micro-batch(es), "
          f"recompute={a.recompute}")  # fmt: skip
    print(f"layout : dp={a.dp} tp={a.tp} pp={a.pp} cp={a.cp} zero={a.zero} = {lay.size} ranks; ran "
          f"{len(runs)} representative rank(s) in {total:.2f} s")  # fmt: skip
    for r, v in runs.items():
        peak = v["figures"]["memory"]["peak"]
        state = sum(peak[c] for c in STATE)
        print(f"\nrank {r}: {v['role']} ({v['seconds']:.2f} s)")
        print(f"  {'GiB per GPU':<14}{'dry run':>10}{'this model':>12}{'course':>10}")
        for c in STATE:
            print(f"  {c:<14}{peak[c] / GIB:10.2f}")
        print(f"  {'state':<14}{state / GIB:10.2f}{ex.state / GIB:12.2f}{row.state / GIB:10.2f}")
        act = peak["activations"]
        print(
            f"  {'activations':<14}{act / GIB:10.2f}{ex.activ / GIB:12.2f}{row.activ / GIB:10.2f}"
        )
        sent = tags(v["figures"])
        print(f"  bytes sent, one step: {sum(sent.values()):,}")
        if lay.tp == lay.pp == lay.cp == 1 and lay.dp > 1:
            want = dp_formula(p.model_config(seq), lay)
            got = sent.get("dp/grads", 0) + sent.get("dp/params", 0)
            print(f"  dp/grads + dp/params {got:,} = parallel/data/cost.step_bytes {want:,}: "
                  f"{'equal' if got == want else 'DIFFERENT'}")  # fmt: skip
        for k in sorted(sent, key=sent.get, reverse=True)[:8]:
            print(f"    {k:<28}{sent[k]:>20,}")
    if lay.cp > 1:
        print(f"\ncp={lay.cp}: 'this model' and 'course' are priced without context parallelism")
    print("\npeaks per category are each category's own maximum over the step; 'this model' "
          "prices the worst stage, 'course' the course's formulas at the published count")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
