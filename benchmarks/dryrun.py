"""Benchmark (not a test): dry runs of real layouts at real model sizes through parallel.train.

    python -m emulator bench dryrun [--quick]

Each row runs one optimizer step of the one N-D program (parallel.train) on shape-only arrays
for every representative rank of the layout (planning/nd_dryrun.py: one per pipeline stage and
cp rank, each standing for its dp x tp ranks; --workers processes, default 2, one per core) and
prints the row's wall seconds, the CPU seconds of all its ranks together (each measured in the
worker that ran it), the peak resident memory so far of this process and its workers (it only
grows: rows run in order), the worst representative's ledgered state / activations / bytes sent, and
whether every representative's bytes per axis and memory peaks equal parallel/nd_cost.py's
closed forms. The model is this project's GPT block at the preset's shape (its own parameter
count, printed by `dryrun`; the ep row's an MoE of 8 experts, top-2, at that shape). Rows:
Llama-2-70B on 8..512 ranks (dp, ZeRO, tp, pp), Llama-3-405B at Llama 3's 16,384-GPU layout,
one cp row (dp8 x cp4 x tp8 at 16K tokens, all-gather attention) and one ep row (dp64 x tp8
with ep8 of the dp ranks, padded to capacity). Wall time on a loaded 2-core machine includes
waiting for a core; CPU time is printed beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from emulator.ledger import format_table
from parallel.layout import Layout
from planning import presets
from planning.nd_dryrun import cpu_seconds, dry_nd, peak_rss_mib
from planning.nd_report import check_all

GIB = 2**30
MIXED = {"dtype": "mixed"}
CASES = [
    ("llama2-70b", Layout(dp=8, zero=0, **MIXED)),
    ("llama2-70b", Layout(dp=8, zero=1, **MIXED)),
    ("llama2-70b", Layout(dp=8, zero=2, **MIXED)),
    ("llama2-70b", Layout(dp=8, zero=3, **MIXED)),
    ("llama2-70b", Layout(dp=64, zero=3, **MIXED)),
    ("llama2-70b", Layout(dp=512, zero=3, **MIXED)),
    ("llama2-70b", Layout(dp=8, tp=8, zero=1, sequence_parallel=True, **MIXED)),
    ("llama2-70b", Layout(dp=8, pp=8, zero=1, microbatches=8, **MIXED)),
    ("llama2-70b", Layout(dp=4, pp=4, tp=8, zero=1, microbatches=4, **MIXED)),
    # Llama 3's 16,384-GPU layout (Dubey et al. 2024, section 3.3.2): tp 8 x pp 16 x dp 128,
    # 16 sequences of 8192 per dp rank (2,048 x 8,192 = 16M tokens per step)
    ("llama3-405b", Layout(dp=128, pp=16, tp=8, zero=1, microbatches=16, **MIXED)),
    # context parallelism: 16K-token sequences over cp 4 inside tp 8 x dp 8, all-gather
    # attention (Llama 3's CP method, section 3.3.2); 4 representatives, one per cp rank
    (
        "llama2-70b",
        Layout(dp=8, cp=4, tp=8, zero=1, cp_method="all-gather", **MIXED),
        {"seq": 16384},
    ),
    # expert parallelism: every block an MoE of 8 experts, top-2, over ep 8 of dp 64, padded
    # to capacity (the dry run's routing assumption)
    (
        "llama2-70b",
        Layout(dp=64, tp=8, ep=8, dispatch="padded", **MIXED),
        {"n_experts": 8, "moe_top_k": 2},
    ),
]
QUICK = [CASES[3], CASES[8], CASES[11]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator bench dryrun", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two rows only")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2, help="processes running representatives")
    a = ap.parse_args(argv)
    rows = []
    for name, lay, *extra in QUICK if a.quick else CASES:
        p, kw = presets.get(name), dict(*extra)
        seq = kw.pop("seq", p.seq)
        cfg = dataclasses.replace(p.model_config(seq), **kw)  # kw: the MoE shape, if any
        B = lay.dp * a.micro_batch * lay.microbatches
        t0 = time.perf_counter()
        runs = dry_nd(cfg, lay, B, seq, workers=a.workers)
        wall, cpu = time.perf_counter() - t0, cpu_seconds(runs)
        peaks = [v["figures"]["run_memory"]["peak"] for v in runs.values()]
        state = max(sum(pk[c] for c in ("params", "grads", "optimizer")) for pk in peaks)
        act = max(pk["activations"] for pk in peaks)
        sent = max(sum(v["figures"]["axes"].values()) for v in runs.values())
        equal = not any(check_all(cfg, lay, B, seq, runs).values())
        axes = " x ".join(
            f"{k}{getattr(lay, k)}" for k in ("dp", "pp", "cp", "tp", "ep") if getattr(lay, k) > 1
        )
        axes += f" z{lay.zero}" + (" sp" if lay.sequence_parallel else "")
        axes += f" {lay.cp_method} S={seq}" if lay.cp > 1 else ""
        axes += f" E{cfg.n_experts} K{cfg.moe_top_k} padded" if lay.ep > 1 else ""
        rows.append([name, axes, lay.world, len(runs), f"{wall:.1f}", f"{cpu:.1f}",
                     f"{peak_rss_mib():.0f}", f"{state / GIB:.1f}", f"{act / GIB:.1f}",
                     f"{sent / GIB:.1f}", "equal" if equal else "DIFFERENT"])  # fmt: skip
        print(" | ".join(map(str, rows[-1])), flush=True)
    print()
    print(format_table(["preset", "layout", "ranks", "ran", "wall s", "cpu s", "peak RSS MiB",
                        "state GiB", "activ GiB", "sent GiB", "= nd_cost"], rows))  # fmt: skip
    print("one step of parallel.train per representative rank (ran: how many), shape-only arrays; "
          "GiB: the worst representative's ledger peaks, per GPU; sent: bytes one rank sent in "
          "the step; = nd_cost: every representative's bytes per axis and memory peaks equal "
          "parallel/nd_cost.py's closed forms")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
