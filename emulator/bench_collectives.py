"""Benchmark of our collectives, nccl-tests style: size, time, algbw, busbw (a benchmark, not a test).

    python -m emulator.bench_collectives                 # virtual ranks (threads in one process)
    mpiexec -n 4 python -m emulator.bench_collectives    # MPI: beside mpi4py's native Allreduce

algbw = S / t; busbw = algbw * 2(p-1)/p for all-reduce (nccl-tests' PERFORMANCE.md), so busbw
is comparable with one link's bandwidth whatever p is. Times are the median over iterations of
the slowest rank, each iteration starting after a barrier.
Virtual ranks: a 64 MiB float32 all-reduce over 8 ranks against the same work done by NumPy in
one thread (sum of the 8 buffers + 8 copies of the result), then 256 ranks on a small buffer.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

MiB = 1 << 20


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _iters(nbytes: int, budget: int) -> int:
    return int(max(3, min(50, budget // max(nbytes, 1))))


def _fmt_size(b: int) -> str:
    return f"{b // MiB} MiB" if b >= MiB else f"{b // 1024} KiB"


def _row(nbytes, t, p):
    from collectives.cost import bus_factor

    alg = nbytes / t / 1e9
    return [
        _fmt_size(nbytes),
        f"{t * 1e6:.1f}",
        f"{alg:.2f}",
        f"{alg * bus_factor('all_reduce', p):.2f}",
    ]


def bench_mpi(args) -> int:
    from mpi4py import MPI

    import collectives as C
    from emulator.ledger import format_table
    from emulator.mpi import world_comm

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

    for nbytes in _sizes(args.min, args.max):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        it = _iters(nbytes, args.budget)
        C.all_reduce(comm, x, algorithm=args.algorithm)  # warm-up
        ours = timed(lambda x=x: C.all_reduce(comm, x, algorithm=args.algorithm), it)
        native = timed(lambda x=x, out=out: world.Allreduce(x, out, op=MPI.SUM), it)
        rows.append(_row(nbytes, ours, p) + _row(nbytes, native, p)[1:] + [f"{ours / native:.2f}x"])
    if comm.rank == 0:
        print(
            f"all_reduce float32, algorithm={args.algorithm!r}, {p} MPI ranks (ours vs MPI_Allreduce)"
        )
        head = [
            "size",
            "time us",
            "algbw GB/s",
            "busbw GB/s",
            "native us",
            "native algbw",
            "native busbw",
            "ours/native",
        ]
        print(format_table(head, rows))
    comm.world.finish(comm)
    return 0


def bench_virtual(args) -> int:
    import collectives as C
    import emulator
    from emulator.ledger import format_table

    p, rows = args.ranks, []

    def job(comm, x_all, iters):
        ts = []
        for _ in range(iters):
            comm.barrier()  # uncounted control plane
            t0 = time.perf_counter()
            C.all_reduce(comm, x_all[comm.rank], algorithm=args.algorithm)
            ts.append(max(comm.allgather_object(time.perf_counter() - t0)))
        return float(np.median(ts))

    for nbytes in _sizes(args.min, args.max):
        xs = [
            np.random.default_rng(r).standard_normal(nbytes // 4).astype(np.float32)
            for r in range(p)
        ]
        t = emulator.spawn(job, p, xs, _iters(nbytes, args.budget), timeout=120)[0]
        rows.append(_row(nbytes, t, p))
    print(f"all_reduce float32, algorithm={args.algorithm!r}, {p} virtual ranks")
    print(format_table(["size", "time us", "algbw GB/s", "busbw GB/s"], rows))

    xs = [
        np.random.default_rng(r).standard_normal(args.max // 4).astype(np.float32) for r in range(p)
    ]
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        acc = xs[0].copy()
        for x in xs[1:]:
            np.add(acc, x, out=acc)
        _ = [acc.copy() for _ in range(p)]
        ts.append(time.perf_counter() - t0)
    base = float(np.median(ts))
    ours = emulator.spawn(job, p, xs, 3, timeout=120)[0]
    print(
        f"\n{_fmt_size(args.max)} over {p} virtual ranks: all_reduce {ours * 1e3:.1f} ms vs NumPy "
        f"sum of {p} buffers + {p} copies {base * 1e3:.1f} ms: ratio {ours / base:.2f}x (goal <= 3x)"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench collectives", description=__doc__.splitlines()[0])
    ap.add_argument("--min", type=int, default=4 * 1024, help="smallest message in bytes")
    ap.add_argument("--max", type=int, default=64 * MiB, help="largest message in bytes")
    ap.add_argument("--algorithm", default="ring", choices=["ring", "tree", "auto"])
    ap.add_argument("--ranks", type=int, default=8, help="virtual ranks for the table")
    ap.add_argument("--many", type=int, default=256, help="virtual ranks for the small case")
    ap.add_argument("--budget", type=int, default=512 * MiB, help="bytes per size (iterations)")
    args = ap.parse_args(argv)
    from emulator import under_mpi

    return bench_mpi(args) if under_mpi() else bench_virtual(args)


if __name__ == "__main__":
    sys.exit(main())
