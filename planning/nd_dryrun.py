"""Dry runs of the one N-D program: `parallel.train` on one rank, shape-only, at any layout.

    runs = dry_nd(cfg, Layout(dp=128, pp=16, tp=8, zero=1, microbatches=16, dtype="mixed"), B, S)

runs `parallel.train(comm, layout, cfg, [(tokens, targets)], 1)` - the very program a real run
executes on every rank - on a `emulator.dry.DryComm` (the rank's peers do not exist) with
shape-only arrays (emulator/shapes.py), once per representative rank, and returns what each
rank's ledgers recorded: bytes per (tag, op, algorithm, direction, peer, group) and the memory
ledger's snapshot (current and peak per category) after the step, and `NDRun.memory` (the same
snapshot taken before the run frees its buffers). `real_nd` runs the same layout for real on
virtual ranks (small sizes) and returns every rank's figures in the same form.

Roles (rank symmetry). The mesh is dp x pp x cp x tp, row-major (parallel/layout.py), so world
rank ((d pp + s) cp + c) tp + t has coordinates (d, s, c, t). Ranks of one pipeline stage s (and
one cp rank c) run the same code on the same shapes: the same stage's parameters (Megatron cuts
every tp-sharded tensor into t equal parts, Layout refuses any other), the same dp flat buffers
(padded to a multiple of dp), the same micro-batches in flight. So one rank, (0, s, c, 0), stands
for the dp x tp ranks of its (stage, cp rank); `representatives` says which, and
tests/planning/test_nd_dry_run.py checks the claim on every rank of real runs: equal memory and
equal bytes per (tag, op, direction, group), except the position-dependent tags of
role_figures (the clipping norm's one-element all-reduce, whose ring chunks fall unevenly by
rank). With ep > 1 the ep ranks are dp ranks (dp = edp x ep) and (0, s, c, 0) stands for them
too: under the dry run's routing assumption, padded to capacity, every ep rank holds E / ep
experts of the same shapes and sends each peer El C rows per all-to-all; exact dispatch (sizes
from the routing) is refused by name.
"""

from __future__ import annotations

import dataclasses
import resource
import time

import numpy as np

import emulator
from emulator.dry import dry_run
from emulator.shapes import ShapeArray


def batch(cfg, B: int, S: int, dry: bool, seed: int = 1):
    """One step's (tokens, targets): shape-only in a dry run, random ids otherwise."""
    if dry:
        t = ShapeArray.new((B, S), np.int64)
        return [(t, t)]
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, cfg.vocab_size, (B, S)) for _ in range(2))]


def role_figures(fig: dict) -> tuple:
    """What ranks of one role share: bytes per (tag, op, direction, group) without the
    position-dependent tags - the clipping norm's one-element all-reduce (dp/clip: its ring
    chunks fall unevenly, 8 or 16 bytes by rank) and DDP's one-off initial broadcast
    (*init_broadcast: a binomial tree, root, inner and leaf ranks move different bytes) - and the
    memory snapshot."""
    by: dict = {}
    for (tag, op, _alg, direction, _peer, group), n in fig["bytes"].items():
        if not (tag.startswith("dp/clip") or tag.endswith("init_broadcast")):
            by[(tag, op, direction, group)] = by.get((tag, op, direction, group), 0) + n
    return by, fig["memory"]


def run_nd(comm, cfg, layout, B: int, S: int, dry: bool, steps: int = 1):
    """parallel.train on ``steps`` copies of one (B, S) batch: shape-only ids in a dry run."""
    import parallel

    return parallel.train(comm, layout, cfg, batch(cfg, B, S, dry) * steps, steps)


def figures(comm, run) -> dict:
    by: dict = {}
    for r in comm.ledger.records:
        key = (r.tag, r.op, r.algorithm, r.direction, r.peer, r.group)
        by[key] = by.get(key, 0) + r.nbytes
    # axes: bytes sent per axis in the steps (NDRun.step_bytes, summed); setup: bytes sent
    # before the first step (DDP's initial broadcast of the parameters), the rest of the ledger
    axes: dict = {}
    for step in run.step_bytes:
        for a, n in step.items():
            axes[a] = axes.get(a, 0) + n
    total = sum(r.nbytes for r in comm.ledger.records if r.direction == "send")
    return {"bytes": by, "axes": axes, "setup": total - sum(axes.values()),
            "memory": comm.memory.snapshot(), "run_memory": run.memory}  # fmt: skip


def rank_of(layout, d: int = 0, s: int = 0, c: int = 0, t: int = 0) -> int:
    """World rank of mesh coordinates (dp d, pp s, cp c, tp t): row-major dp, pp, cp, tp."""
    return ((d * layout.pp + s) * layout.cp + c) * layout.tp + t


def representative(layout, rank: int) -> int:
    """The rank whose dry run stands for ``rank``: its own stage and cp rank at dp = tp = 0."""
    s = rank // (layout.cp * layout.tp) % layout.pp
    c = rank // layout.tp % layout.cp
    return rank_of(layout, 0, s, c, 0)


def stands_for(layout, rep: int) -> list:
    """Every world rank ``rep`` stands for (those whose representative it is)."""
    return [r for r in range(layout.world) if representative(layout, r) == rep]


def representatives(layout) -> dict:
    """{representative world rank: which ranks it stands for, in words}."""
    out = {}
    for s in range(layout.pp):
        for c in range(layout.cp):
            where = f"pp stage {s}" + (f", cp rank {c}" if layout.cp > 1 else "")
            n = layout.dp * layout.tp
            who = (f"its {n} ranks dp 0..{layout.dp - 1} x tp 0..{layout.tp - 1}" if n > 1
                   else "itself")  # fmt: skip
            out[rank_of(layout, 0, s, c, 0)] = f"{where}: stands for {who}"
    return out


@dataclasses.dataclass
class Timing:
    wall: float  # seconds of wall time
    cpu: float  # seconds of this process's CPU time (wall - cpu: waiting for a core)


def dry_nd(cfg, layout, B: int, S: int, ranks=None, workers: int = 1) -> dict:
    """{rank: {"figures", "role", "time": Timing}} for every representative (or ``ranks``).
    ``workers`` > 1 runs the ranks in that many forked processes (they are independent: each
    DryComm is alone); each rank's Timing is measured in the process that ran it."""
    layout.validate(layout.world, cfg, (B, S))
    if layout.ep > 1 and layout.dispatch != "padded":
        raise ValueError(
            f"dispatch={layout.dispatch!r}: exact dispatch sends the routed rows themselves (sizes "
            "follow the routing), which a dry run cannot know; dry-run dispatch='padded' (every "
            "expert filled to capacity)"
        )
    reps = representatives(layout)
    if ranks is not None:
        reps = {r: reps.get(r, f"rank {r} (stands for itself)") for r in ranks}
    if workers > 1 and len(reps) > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        ctx = mp.get_context("fork")  # no re-import; jobs and figures are small to pickle
        with cf.ProcessPoolExecutor(min(workers, len(reps)), mp_context=ctx) as pool:
            done = pool.map(_one, [(cfg, layout, B, S, r) for r in reps])
            return {r: {**res, "role": reps[r]} for r, res in zip(reps, done)}
    return {r: {**_one((cfg, layout, B, S, r)), "role": role} for r, role in reps.items()}


def _one(job) -> dict:
    cfg, layout, B, S, r = job
    t0, c0 = time.perf_counter(), time.process_time()
    run, comm = dry_run(run_nd, layout.world, r, cfg, layout, B, S, True)
    t = Timing(time.perf_counter() - t0, time.process_time() - c0)
    return {"figures": figures(comm, run), "time": t, "rss_mib": peak_rss_mib()}


def real_nd(cfg, layout, B: int, S: int) -> list:
    """Every rank's figures from a real parallel.train run on virtual ranks (small sizes)."""

    def body(comm):
        return figures(comm, run_nd(comm, cfg, layout, B, S, False))

    return emulator.spawn(body, layout.world, timeout=300)


def cpu_seconds(runs: dict) -> float:
    """CPU seconds of the ranks' dry runs together (each measured where it ran)."""
    return sum(v["time"].cpu for v in runs.values())


def peak_rss_mib() -> float:
    """The peak resident set so far of this process or of any worker it waited for (Linux
    reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
