"""Benchmark of our collectives, nccl-tests style: size, time, algbw, busbw (a benchmark, not a test).

    python -m benchmarks.collectives                 # virtual ranks (threads in one process)
    mpiexec -n 4 python -m benchmarks.collectives    # MPI: beside mpi4py's native collectives
    ... --algorithm double_tree --ops all_reduce         # one all-reduce algorithm, one op

Rows: all-reduce (with --algorithm), ring reduce-scatter and ring all-gather; under MPI beside
Allreduce, Reduce_scatter_block and Allgather. S, the size column, is the whole array as in
nccl-tests: the all-reduce's input, the reduce-scatter's input (each rank keeps S/p), the
all-gather's output (each rank gives S/p); S is rounded down to a multiple of 4p bytes.
algbw = S / t; busbw = algbw * 2(p-1)/p for all-reduce and algbw * (p-1)/p for reduce-scatter
and all-gather (nccl-tests' PERFORMANCE.md), so busbw is comparable with one link's bandwidth
whatever p is. Times are the median over iterations of the slowest rank, each iteration
starting after a barrier; under MPI ours and native alternate for --rounds rounds, the time
columns show the best round's and the ratio column the per-round ratio's min / median / max.
`--unchecked` (MPI) times our collectives a second time in the same rounds on a world made by
`world_comm(check=False)` - the cross-rank call check off, the same messages and bytes - so the
table shows what the check costs at each size beside the rest of our layers.
Native's algorithm: MPICH picks one per size and p unless its variable names one, as NCCL_ALGO
does for NCCL (at 1 MiB on 4 ranks its choice is as fast as its reduce-scatter + all-gather,
Rabenseifner's: 2 log2 p steps to the ring's 2(p-1)); `MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring
mpiexec -n 4 ...` times MPICH's own ring beside ours (the table's second line says which ran; a
misspelled value makes MPICH abort in MPI_Init).
Virtual ranks: a 64 MiB float32 all-reduce over 8 ranks against the same work done by NumPy in
one thread (sum of the 8 buffers + 8 copies of the result), then 256 ranks on a small buffer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from tools import args as cli

MiB = 1 << 20
OPS = ("all_reduce", "reduce_scatter", "all_gather")
ALGORITHM_VARS = {  # MPICH's variable naming each native collective's algorithm (native_note)
    "all_reduce": "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM",
    "reduce_scatter": "MPIR_CVAR_REDUCE_SCATTER_BLOCK_INTRA_ALGORITHM",
    "all_gather": "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM",
}


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _iters(nbytes: int, budget: int) -> int:
    return int(max(3, min(50, budget // max(nbytes, 1))))


def _fmt_size(b: int) -> str:
    if b % 1024:
        return f"{b} B"
    return f"{b // MiB} MiB" if b % MiB == 0 else f"{b // 1024} KiB"


def _row(op, nbytes, t, p):
    from collectives.cost import bus_factor

    alg = nbytes / t / 1e9
    return [
        op,
        _fmt_size(nbytes),
        f"{t * 1e6:.1f}",
        f"{alg:.2f}",
        f"{alg * bus_factor(op, p):.2f}",
    ]


def _elements(nbytes: int, p: int) -> int:
    """float32 elements of S, a multiple of p (Reduce_scatter_block needs equal blocks)."""
    return nbytes // 4 // p * p


def _input(op: str, n: int, p: int, rank: int) -> np.ndarray:
    """Rank's float32 input: the whole array (all-reduce, reduce-scatter) or its 1/p block."""
    k = n // p if op == "all_gather" else n
    return np.random.default_rng(rank).standard_normal(k).astype(np.float32)


def _ours(op: str, algorithm: str):
    """fn(comm, x) running our collective `op` (all-reduce with `algorithm`)."""
    import collectives as C

    if op == "all_reduce":
        return lambda comm, x: C.all_reduce(comm, x, algorithm=algorithm)
    return {"reduce_scatter": C.reduce_scatter, "all_gather": C.all_gather}[op]


def _ops(args) -> list[str]:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise SystemExit(f"bench collectives: --ops {args.ops!r}: choose from {', '.join(OPS)}")
    return ops


def bench_mpi(args) -> int:
    from mpi4py import MPI

    from emulator.ledger import format_table
    from emulator.mpi import world_comm

    # the unchecked world first: world_comm binds this process's rank state to the last one made
    bare = world_comm(timeout=120, check=False) if args.unchecked else None
    comm, world = world_comm(timeout=120), MPI.COMM_WORLD
    p, rows = comm.size, []

    def timed(fn, iters):
        ts = []
        for _ in range(iters):
            world.Barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(world.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        return float(np.median(ts))

    def native(op, x, out):
        if op == "all_reduce":
            return lambda: world.Allreduce(x, out, op=MPI.SUM)
        if op == "reduce_scatter":
            return lambda: world.Reduce_scatter_block(x, out, op=MPI.SUM)
        return lambda: world.Allgather(x, out)

    ops = _ops(args)
    for op in ops:
        ours_fn = _ours(op, args.algorithm)
        for nbytes in _sizes(args.min, args.max):
            n = _elements(nbytes, p)
            x = _input(op, n, p, comm.rank)
            out = np.empty(n // p if op == "reduce_scatter" else n, np.float32)
            it = _iters(nbytes, args.budget)
            fns = [lambda f=ours_fn, x=x: f(comm, x), native(op, x, out)]
            if bare is not None:
                fns.append(lambda f=ours_fn, x=x: f(bare, x))
            for fn in fns:  # warm-up
                fn()
            # interleaved rounds (ours, native[, unchecked], ours, ...): a shared machine disturbs
            # single rounds, so a ratio is taken per round and its min / median / max printed
            rounds = [[timed(fn, it) for fn in fns] for _ in range(args.rounds)]
            best = [min(r[k] for r in rounds) for k in range(len(fns))]
            row = _row(op, 4 * n, best[0], p) + _row(op, 4 * n, best[1], p)[2:]
            row.append(_spread([r[0] / r[1] for r in rounds]))
            if bare is not None:  # the unchecked call's time, its ratio to native and to ours
                row += [f"{best[2] * 1e6:.1f}", _spread([r[2] / r[1] for r in rounds]),
                        _spread([r[2] / r[0] for r in rounds])]  # fmt: skip
            rows.append(row)
    if comm.rank == 0:
        print(
            f"float32, all_reduce algorithm={args.algorithm!r}, {p} MPI ranks (ours vs mpi4py's "
            "Allreduce / Reduce_scatter_block / Allgather)"
        )
        print(native_note(MPI.Get_library_version(), os.environ, ops))
        head = [
            "op",
            "size",
            "time us",
            "algbw GB/s",
            "busbw GB/s",
            "native us",
            "native algbw",
            "native busbw",
            "ours/native min/med/max",
        ]
        if bare is not None:
            head += ["unchecked us", "unchecked/native", "unchecked/ours"]
        print(format_table(head, rows))
    comm.world.finish(comm)
    if bare is None:
        return 0
    bare.world.finish(bare)
    # the two worlds made the same calls: the same messages and bytes, the check's labels apart
    mine, theirs = _traffic(comm), _traffic(bare)
    if mine != theirs:
        print(f"rank {comm.rank}: the unchecked world moved other messages than the checked "
              f"one (records, bytes sent, bytes received: unchecked {theirs}, checked {mine})", flush=True)  # fmt: skip
        return 1
    return 0


def native_note(library: str, env, ops) -> str:
    """Which algorithms the native column ran. MPICH picks one per size and p unless its variable
    for the collective names one (read at MPI_Init, as NCCL reads NCCL_ALGO)."""
    named = {op: env[ALGORITHM_VARS[op]] for op in ops
             if env.get(ALGORITHM_VARS[op], "auto") not in ("", "auto")}  # fmt: skip
    if not library.startswith("MPICH"):
        lib = library.splitlines()[0].strip() if library.strip() else "this MPI"
        vars_ = ", ".join(f"{ALGORITHM_VARS[op]}={v}" for op, v in named.items())
        return f"native: {lib}'s own choice of algorithms" + (
            f"; {vars_}: MPICH's, no effect here" if named else "")  # fmt: skip
    parts = [f"{op} {named[op]} ({ALGORITHM_VARS[op]}={named[op]})" if op in named
             else f"{op} MPICH's choice" for op in ops]  # fmt: skip
    hint = "" if "all_reduce" not in ops or "all_reduce" in named else (
        f"; {ALGORITHM_VARS['all_reduce']}=ring (or tree, recursive_doubling, "
        "reduce_scatter_allgather) times MPICH's own version of one")  # fmt: skip
    return "native: " + ", ".join(parts) + hint


def _traffic(comm) -> tuple:
    led = comm.ledger
    return len(led.records), led.sent(), led.received()


def _spread(ratios: list) -> str:
    """The per-round ratios' min / median / max, as the table prints them."""
    r = sorted(ratios)
    return f"{r[0]:.2f} / {float(np.median(r)):.2f} / {r[-1]:.2f}"


def bench_virtual(args) -> int:
    import collectives as C
    import emulator
    from emulator.ledger import format_table

    p, rows = args.ranks, []

    def job(comm, fn, x_all, iters):
        ts = []
        for _ in range(iters):
            comm.barrier()  # uncounted control plane
            t0 = time.perf_counter()
            fn(comm, x_all[comm.rank])
            ts.append(max(comm.allgather_object(time.perf_counter() - t0)))
        return float(np.median(ts))

    ops = _ops(args)
    for op in ops:
        for nbytes in _sizes(args.min, args.max):
            n = _elements(nbytes, p)
            xs = [_input(op, n, p, r) for r in range(p)]
            it = _iters(nbytes, args.budget)
            t = emulator.spawn(job, p, _ours(op, args.algorithm), xs, it, timeout=120)[0]
            rows.append(_row(op, 4 * n, t, p))
    print(f"float32, all_reduce algorithm={args.algorithm!r}, {p} virtual ranks")
    print(format_table(["op", "size", "time us", "algbw GB/s", "busbw GB/s"], rows))
    if "all_reduce" not in ops:
        return 0

    xs = [
        np.random.default_rng(r).standard_normal(args.max // 4).astype(np.float32) for r in range(p)
    ]

    def baseline() -> float:
        t0 = time.perf_counter()
        acc = xs[0].copy()
        for x in xs[1:]:
            np.add(acc, x, out=acc)
        _ = [acc.copy() for _ in range(p)]
        return time.perf_counter() - t0

    # Interleave the two in 5 rounds and compare the best of each: on a shared 2-core machine a
    # single round is often disturbed, and the minimum is the least disturbed measurement.
    base, ours = [], []
    for _ in range(5):
        base.append(baseline())
        ours.append(emulator.spawn(job, p, _ours("all_reduce", args.algorithm), xs, 1)[0])
    b, o = min(base), min(ours)
    print(
        f"\n{_fmt_size(args.max)} over {p} virtual ranks, best of 5 interleaved rounds: all_reduce "
        f"{o * 1e3:.1f} ms vs NumPy sum of {p} buffers + {p} copies {b * 1e3:.1f} ms: ratio "
        f"{o / b:.2f}x (goal <= 3x; medians {np.median(ours) * 1e3:.1f} / "
        f"{np.median(base) * 1e3:.1f} ms)"
    )

    small = [np.ones(256, np.float32)] * args.many
    for algo in ("auto", "ring"):
        t0 = time.perf_counter()
        emulator.spawn(
            lambda c, a=algo: C.all_reduce(c, small[c.rank], algorithm=a), args.many, timeout=120
        )
        print(
            f"{args.many} virtual ranks, all_reduce of 1 KiB (algorithm={algo!r}, picks "
            f"{C.cost.auto_all_reduce(1024, args.many) if algo == 'auto' else algo}): "
            f"{time.perf_counter() - t0:.2f} s including thread start-up"
        )
    return 0


def ops_flag(text: str) -> str:
    ops = [o.strip() for o in text.split(",") if o.strip()]
    if not ops or any(o not in OPS for o in ops):
        raise argparse.ArgumentTypeError(f"got {text!r}; need a comma-separated list from {OPS}")
    return text


def main(argv=None) -> int:
    ap = cli.parser(__doc__, prog="python -m emulator bench collectives")
    ap.add_argument("--min", type=cli.positive_int, default=4 * 1024, help="smallest message, B")
    ap.add_argument("--max", type=cli.positive_int, default=64 * MiB, help="largest message, B")
    ap.add_argument(
        "--algorithm",
        default="ring",
        choices=["ring", "tree", "double_tree", "auto"],
        help="all-reduce algorithm (reduce-scatter and all-gather are ring)",
    )
    ap.add_argument(
        "--ops", type=ops_flag, default=",".join(OPS), help=f"comma-separated, from {OPS}"
    )
    ap.add_argument("--rounds", type=cli.positive_int, default=5, help="interleaved rounds (MPI)")
    ap.add_argument("--unchecked", action="store_true",
                    help="MPI: also time ours with the cross-rank call check off, same rounds")  # fmt: skip
    ap.add_argument("--ranks", type=cli.ranks_flag, default=8, help="virtual ranks for the table")
    ap.add_argument("--many", type=cli.ranks_flag, default=256, help="ranks for the small case")
    ap.add_argument("--budget", type=cli.positive_int, default=512 * MiB,
                    help="bytes moved per size (sets the iterations)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.max < args.min:
        ap.error(f"argument --max: {args.max} is below --min {args.min}; the table would be "
                 "empty (need --max >= --min)")  # fmt: skip
    from emulator import under_mpi

    if args.unchecked and not under_mpi():
        ap.error("argument --unchecked: it times MPI ranks against native MPI; run under "
                 "mpiexec -n P (virtual ranks have no native baseline to set it beside)")  # fmt: skip
    return bench_mpi(args) if under_mpi() else bench_virtual(args)


if __name__ == "__main__":
    sys.exit(main())
