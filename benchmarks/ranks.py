"""Many virtual ranks: barrier and a 1 KiB all-reduce on P threads, with time and memory.

    python -m emulator bench ranks                      # 4,096 ranks (a benchmark, not a test)
    python -m emulator bench ranks --ranks 1024,4096 --rounds 3

Each row is one `spawn` (best of --rounds, wall seconds): "start-up" runs an empty program
(thread start and join alone), "barrier" the dissemination barrier, "all_reduce" 1 KiB of
float32 with algorithm "auto" (cost.auto_all_reduce picks the tree at this size). Every run
checks itself: the all-reduce equals P times the input on every rank and every rank's bytes
equal cost.py's formula. Memory: the process's peak resident set (ru_maxrss) before and after
the rows of that P, and the difference per rank (each rank is a thread with its own stack,
ledger and mailbox).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import numpy as np


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cases():
    import collectives as C
    from collectives import cost

    x = np.ones(256, np.float32)  # 1 KiB

    def empty(comm):
        return True

    def barrier(comm):
        C.barrier(comm)
        return (comm.ledger.sent(), comm.ledger.received()) == cost.dissemination_barrier(comm.size)

    def all_reduce(comm):
        y = C.all_reduce(comm, x, algorithm="auto")
        algo = cost.auto_all_reduce(x.nbytes, comm.size)
        want = cost.all_reduce(x.size, comm.size, 4, comm.rank, algo)
        got = (comm.ledger.sent(), comm.ledger.received())
        return bool(np.all(y == comm.size)) and got == want

    return [("start-up", empty), ("barrier", barrier), ("all_reduce 1 KiB", all_reduce)]


def main(argv=None) -> int:
    import emulator
    from emulator.ledger import format_table

    ap = argparse.ArgumentParser(prog="bench ranks", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4096", help="comma-separated rank counts")
    ap.add_argument("--rounds", type=int, default=2, help="runs per row (the best is shown)")
    ap.add_argument("--timeout", type=float, default=120.0, help="spawn's timeout (seconds)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.ranks.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.rounds < 1:
        raise SystemExit("bench ranks: --ranks must list positive counts, --rounds >= 1")
    rows, ok = [], True
    for p in sizes:
        before = _peak_mib()
        for name, fn in _cases():
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                good = all(emulator.spawn(fn, p, timeout=args.timeout))
                times.append(time.perf_counter() - t0)
                ok &= good
            rows.append([str(p), name, f"{min(times):.2f}", f"{max(times):.2f}", str(good)])
        after = _peak_mib()
        per_rank = (after - before) * 1024 / p
        rows.append([str(p), "peak RSS", f"{after:.0f} MiB", f"{before:.0f} MiB before", ""])
        rows[-1][-1] = f"+{per_rank:.0f} KiB/rank"
    print(f"virtual ranks, wall seconds per spawn (best / worst of {args.rounds})")
    print(format_table(["ranks", "case", "best s", "worst s", "checked"], rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
