"""Benchmark (not a test): dry runs of real layouts at real model sizes, one rank each.

    python -m emulator bench dryrun [--quick]

Each row runs one optimizer step of the layout's training code for one representative rank
(rank 0) on shape-only arrays (planning/dryrun.py) and prints the wall time, the peak resident
memory of this process so far (it only grows: rows run in order) and the ledger's figures. The
model is this project's GPT block at the preset's shape (its own parameter count, printed).
Wall time on a loaded 2-core machine includes waiting for a core; CPU time is printed beside it.
"""

from __future__ import annotations

import argparse
import resource
import time

from emulator.ledger import format_table
from planning import presets
from planning.dryrun import Layout, dry_layout

GIB = 2**30
CASES = [
    ("llama2-70b", Layout(dp=8, zero=0)),
    ("llama2-70b", Layout(dp=8, zero=1)),
    ("llama2-70b", Layout(dp=8, zero=2)),
    ("llama2-70b", Layout(dp=8, zero=3)),
    ("llama2-70b", Layout(dp=64, zero=3)),
    ("llama2-70b", Layout(dp=512, zero=3)),
    ("llama2-70b", Layout(dp=8, tp=8, sp=True)),
    ("llama2-70b", Layout(dp=8, pp=8, zero=1, microbatches=8)),
    # Llama 3's 16,384-GPU layout is tp 8 x pp 16 x dp 128; tp x pp together needs the N-D
    # driver (parallel.train), so this row runs its pp 16 x dp 128 part (2,048 ranks)
    ("llama3-405b", Layout(dp=128, pp=16, zero=1, microbatches=16)),
]
QUICK = [CASES[3], CASES[6]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m emulator bench dryrun", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="two rows only")
    ap.add_argument("--micro-batch", type=int, default=1)
    a = ap.parse_args(argv)
    rows = []
    for name, lay in QUICK if a.quick else CASES:
        p = presets.get(name)
        cfg = p.model_config()
        t0, c0 = time.perf_counter(), time.process_time()
        fig = dry_layout(cfg, lay, lay.dp * a.micro_batch * lay.microbatches, p.seq, [0])[0]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        peak = fig["figures"]["memory"]["peak"]
        sent = sum(n for k, n in fig["figures"]["bytes"].items() if k[3] == "send")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        axes = f"dp={lay.dp} tp={lay.tp} pp={lay.pp} z{lay.zero}"
        rows.append([name, axes, lay.size, f"{wall:.1f}", f"{cpu:.1f}", f"{rss:.0f}",
                     f"{sum(peak[c] for c in ('params', 'grads', 'optimizer')) / GIB:.1f}",
                     f"{peak['activations'] / GIB:.1f}", f"{sent / GIB:.1f}"])  # fmt: skip
    print(format_table(["preset", "layout", "ranks", "wall s", "cpu s", "peak RSS MiB",
                        "state GiB", "activ GiB", "sent GiB"], rows))  # fmt: skip
    print("one step, rank 0 only, shape-only arrays; state = params + grads + optimizer peaks as "
          "the driver ledgers them (the tp / pp drivers ledger activations and dp buckets only)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
