"""Every collective, twice: what it means (collectives/reference.py) and how it runs on send/recv.

    mpiexec -n 4 python examples/01_collectives.py        # one process per rank (MPI)
    python -m emulator run -n 16 examples/01_collectives.py  # 16 virtual ranks
    python examples/01_collectives.py                      # 4 virtual ranks
    python examples/01_collectives.py --seed 3 --sizes 0,5,4096 --json bytes.json

Each rank runs every op and algorithm on a few sizes (uneven and empty too), measures its bytes
in the ledger, and compares them with collectives/cost.py and its result with the reference.
Rank 0 prints an nccl-tests-like table and a VERDICT line; any mismatch exits non-zero.
Flags: --seed (the inputs), --sizes (elements), --json PATH (every rank's bytes, per peer too).
There is no model here, so the model-size flags of the other examples do not apply.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from collectives import api, cost, reference
from emulator.ledger import format_table
from tools import args as cli
from tools.run import run_example, say_verdict

SIZES = (0, 7, 1000, 65537)  # elements; 7 and 65537 are not divisible by most p


def inputs(p, n, seed=0, dtype=np.float32):
    """Every rank can build every rank's input (seeded by rank), so each checks the oracle."""
    return [np.random.default_rng([seed, r]).standard_normal(n).astype(dtype) for r in range(p)]


def cases(p, n):
    """(op label, algorithm, run(comm, xs) -> result, reference per rank, formula(rank))."""
    w, rows = 4, cost.chunk_counts(n, p)
    yield (
        "all_reduce",
        "ring",
        lambda c, xs: api.all_reduce(c, xs[c.rank], algorithm="ring"),
        lambda xs: reference.all_reduce(xs),
        lambda r: cost.ring_all_reduce(n, p, w, r),
    )
    yield (
        "all_reduce",
        "tree",
        lambda c, xs: api.all_reduce(c, xs[c.rank], algorithm="tree"),
        lambda xs: reference.all_reduce(xs),
        lambda r: cost.tree_all_reduce(n, p, w, r),
    )
    yield (
        "all_reduce",
        "double_tree",
        lambda c, xs: api.all_reduce(c, xs[c.rank], algorithm="double_tree"),
        lambda xs: reference.all_reduce(xs),
        lambda r: cost.double_tree_all_reduce(n, p, w, r),
    )
    yield (
        "reduce_scatter",
        "ring",
        lambda c, xs: api.reduce_scatter(c, xs[c.rank]),
        lambda xs: reference.reduce_scatter(xs),
        lambda r: cost.ring_reduce_scatter(rows, w, r),
    )
    yield (
        "all_gather",
        "ring",
        lambda c, xs: api.all_gather(c, xs[c.rank]),
        lambda xs: reference.all_gather(xs),
        lambda r: cost.ring_all_gather([n] * p, w, r),
    )
    yield (
        "broadcast",
        "tree",
        lambda c, xs: api.broadcast(c, xs[c.rank], root=p - 1),
        lambda xs: reference.broadcast(xs, p - 1),
        lambda r: cost.tree_broadcast(n, p, w, r, p - 1),
    )
    yield (
        "reduce",
        "tree",
        lambda c, xs: api.reduce(c, xs[c.rank], root=0),
        lambda xs: reference.reduce(xs, 0),
        lambda r: cost.tree_reduce(n, p, w, r, 0),
    )
    k = n - n % p
    yield (
        "all_to_all",
        "pairwise",
        lambda c, xs: api.all_to_all(c, xs[c.rank][:k]),
        lambda xs: reference.all_to_all([x[:k] for x in xs]),
        lambda r: cost.pairwise_all_to_all(k, p, w, r),
    )


def max_diff(got, want) -> float:
    if want is None or got is None:
        return 0.0 if got is want else float("inf")
    if got.shape != want.shape:
        return float("inf")
    return float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))


def main(comm, sizes=SIZES, seed=0) -> int:
    p, rows, fails, worst_all, sent = comm.size, [], [], 0.0, 0
    for n in sizes:
        xs = inputs(p, n, seed)
        for op, algo, fn, ref, formula in cases(p, n):
            mark = comm.ledger.mark()
            got = fn(comm, xs)
            rec = comm.ledger.since(mark)
            mine = (comm.ledger.sent(rec), comm.ledger.received(rec))
            diff = max_diff(got, ref(xs)[comm.rank])
            every = comm.gather_object((mine, formula(comm.rank), diff))  # uncounted
            if comm.rank == 0:
                match = all(m == f for m, f, _ in every)
                worst = max(d for _, _, d in every)
                good = match and worst <= 1e-4 * p
                worst_all, sent = max(worst_all, worst), sent + sum(m[0] for m, _, _ in every)
                if not match:
                    fails.append(f"{op} {algo} n={n}: bytes differ from cost.py")
                if not worst <= 1e-4 * p:  # also NaN
                    fails.append(f"{op} {algo} n={n}: max |diff| {worst:.2e} > {1e-4 * p:.0e}")
                (s0, r0), (fs, fr) = every[0][0], every[0][1]
                rows.append(
                    [
                        op,
                        algo,
                        n,
                        n * 4,
                        f"{s0}/{r0}",
                        f"{fs}/{fr}",
                        "yes" if match else "NO",
                        f"{worst:.2e}",
                        "" if good else "<-- FAIL",
                    ]
                )
    if comm.rank == 0:
        head = [
            "op",
            "algorithm",
            "elements",
            "bytes",
            "rank0 sent/recv",
            "formula",
            "all ranks match",
            "max |diff|",
            "",
        ]
        print(f"collectives on {p} ranks (float32; bytes per rank from the ledger)")
        print(format_table(head, rows))
        checked = (
            f"{len(rows)} collective calls on {p} ranks: results vs reference.py max |diff| "
            f"{worst_all:.1e} (<= {1e-4 * p:.0e}); bytes ({sent} B sent in all) == cost.py on "
            "every rank"
        )
        say_verdict(fails, checked, calls=len(rows), bytes_sent=sent, max_diff=worst_all)
    ok = all(comm.allgather_object(not fails))
    return 0 if ok else 1


def sizes_flag(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        out = ()
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(
            f"got {text!r}; need comma-separated element counts >= 0, e.g. 0,7,1000"
        )
    return out


def parse(argv=None):
    p = cli.parser(__doc__)
    p.add_argument("--sizes", type=sizes_flag, default=SIZES, help="element counts, e.g. 0,7,1000")
    cli.add_common(p)
    return cli.parse(p, argv)


if __name__ == "__main__":
    a = parse()
    sys.exit(run_example(lambda comm: main(comm, a.sizes, a.seed), a))
