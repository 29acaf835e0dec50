"""Dry runs: one rank of a layout executes the real training code on shape-only arrays.

`run_layout(comm, cfg, layout, B, S, dry)` is the one entry both a real run (virtual ranks,
data) and a dry run (emulator.dry.DryComm, emulator.shapes) call, so the two execute the same
code; `figures(comm)` reads what the ledgers recorded: bytes per (tag, op, algorithm, direction,
peer, group) and the memory ledger's snapshot (current and peak per category).

Layouts: dp only (parallel.data.train: DDP, ZeRO-1/2/3), dp x tp (parallel.tensor.train, DDP or
ZeRO-1 over dp, optional sequence parallelism), dp x pp (parallel.pipeline.train, any schedule,
dp_mode none / ddp / zero1), dp x cp (parallel.context.train: ring / all-gather / Ulysses,
contiguous or zigzag). The one N-D program parallel.train (dp x pp x tp together) is dry-run by
planning/nd_dryrun.py, which `python -m emulator dryrun` uses for every layout without cp; this
module stays for the per-axis trainers and dp x cp. Expert parallelism sends data-dependent row
counts (all-to-all-v of the routed tokens), which a dry run cannot know without an assumed
routing, so it is not dry-run yet.

Rank symmetry: ranks with the same role run the same code on the same shapes, so one rank stands
for its role: one per pipeline stage (their in-flight activations differ), at dp = tp = 0
(`representative`; tests/planning/test_dry_run.py checks the claim on every rank).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

import emulator
from emulator.dry import dry_run
from emulator.shapes import ShapeArray


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # 0 = DDP; 1-3 ZeRO (tp > 1 or pp > 1: 0 or 1)
    microbatches: int = 1  # per dp rank (pp: the schedule's m)
    schedule: str = "1f1b"
    chunks: int | None = None
    sp: bool = False
    recompute: str = "none"
    prefetch: bool = False
    reshard: bool = True
    cp: int = 1  # context parallel (parallel.context.train: one DDP over dp x cp)
    cp_method: str = "ring"
    cp_balance: str = "zigzag"

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def check(self) -> None:
        if self.tp > 1 and self.pp > 1:
            raise ValueError(
                f"tp={self.tp} x pp={self.pp}: the per-axis trainers cover dp, dp x tp and dp x pp; "
                "tp x pp together runs through parallel.train (planning/nd_dryrun.py)"
            )
        if self.cp > 1 and (self.tp > 1 or self.pp > 1 or self.zero):
            raise ValueError(f"cp={self.cp}: context parallelism runs over dp x cp with DDP only")
        if self.tp > 1 and self.recompute == "full":
            raise ValueError("tensor parallelism here recomputes 'none' or 'selective', not 'full'")
        if (self.tp > 1 or self.pp > 1) and self.zero > 1:
            raise ValueError(f"zero={self.zero} with tp or pp: those layouts take ZeRO 0 or 1")


def batch(cfg, B: int, S: int, dry: bool, seed: int = 1):
    """One step's (tokens, targets): shape-only in a dry run, random ids otherwise."""
    if dry:
        t = ShapeArray.new((B, S), np.int64)
        return [(t, t)]
    rng = np.random.default_rng(seed)
    return [tuple(rng.integers(0, cfg.vocab_size, (B, S)) for _ in range(2))]


def run_layout(comm, cfg, lay: Layout, B: int, S: int, dry: bool, steps: int = 1):
    from parallel.context.train import cp_train
    from parallel.data.train import train_data_parallel
    from parallel.pipeline.train import pipeline_train
    from parallel.tensor.train import tp_train

    lay.check()
    data = batch(cfg, B, S, dry) * steps
    common = {"recompute": lay.recompute}
    if lay.cp > 1:
        return cp_train(comm, cfg, 0, data, steps, cp=lay.cp, method=lay.cp_method,
                        balance=lay.cp_balance, microbatches=lay.microbatches, **common)  # fmt: skip
    if lay.tp == 1 and lay.pp == 1:
        stage = "ddp" if lay.zero == 0 else lay.zero
        return train_data_parallel(comm, cfg, 0, data, steps, stage=stage,
                                   microbatches=lay.microbatches, prefetch=lay.prefetch,
                                   reshard_after_forward=lay.reshard, **common)  # fmt: skip
    if lay.tp > 1:
        mesh = emulator.Mesh(comm, dp=lay.dp, tp=lay.tp)
        return tp_train(mesh, cfg, 0, data, steps, sequence_parallel=lay.sp,
                        microbatches=lay.microbatches, dp_stage="1" if lay.zero else None,
                        **common)  # fmt: skip
    mesh = emulator.Mesh(comm, dp=lay.dp, pp=lay.pp)
    mode = "none" if lay.dp == 1 else ("zero1" if lay.zero else "ddp")
    return pipeline_train(mesh, cfg, 0, data, steps, schedule=lay.schedule,
                          microbatches=lay.microbatches, chunks=lay.chunks, dp_mode=mode,
                          **common)  # fmt: skip


def figures(comm) -> dict:
    by: dict = {}
    for r in comm.ledger.records:
        key = (r.tag, r.op, r.algorithm, r.direction, r.peer, r.group)
        by[key] = by.get(key, 0) + r.nbytes
    return {"bytes": by, "memory": comm.memory.snapshot()}


def representative(lay: Layout, rank: int) -> int:
    """The rank whose dry run stands for world rank ``rank``: the same pipeline stage at
    dp = tp = 0 (mesh order dp, then tp or pp). Ranks of one stage hold the same memory and send
    the same bytes per tag, direction and group, except two tags whose traffic depends on the
    rank's place in the group: the one-element all-reduce of the clipping norm (dp/clip; its
    ring chunks fall unevenly, 8 or 16 bytes by rank) and DDP's one-off initial broadcast
    (*init_broadcast; a binomial tree: the root sends, inner ranks forward, leaves receive -
    collectives.cost.tree_broadcast gives each rank's bytes)."""
    if lay.cp > 1:
        return rank % lay.cp  # mesh dp x cp: each cp rank holds a different part of the sequence
    return rank % lay.pp if lay.pp > 1 else 0


def representatives(lay: Layout) -> dict:
    """{world rank: what it stands for}."""
    if lay.cp > 1:
        return {c: f"cp rank {c}, for its {lay.dp} dp rank(s)" for c in range(lay.cp)}
    if lay.pp == 1:
        what = f"all {lay.size} ranks" if lay.size > 1 else "the only rank"
        return {0: f"rank 0, for {what}"}
    return {s: f"stage {s}, for its {lay.dp * lay.tp} rank(s)" for s in range(lay.pp)}


def role_figures(fig: dict) -> tuple:
    """What ranks of one role share: bytes per (tag, op, direction, group) without the two
    position-dependent tags (see representative), and the memory snapshot."""
    by: dict = {}
    for (tag, op, _alg, direction, _peer, group), n in fig["bytes"].items():
        # "clip": ep_train's tag for the same one-element norm all-reduce
        if not (tag.startswith(("dp/clip", "clip")) or tag.endswith("init_broadcast")):
            by[(tag, op, direction, group)] = by.get((tag, op, direction, group), 0) + n
    return by, fig["memory"]


def dry_layout(cfg, lay: Layout, B: int, S: int, ranks=None) -> dict:
    """{rank: {"figures", "seconds", "role"}} for each representative rank (or ``ranks``)."""
    lay.check()
    reps = representatives(lay) if ranks is None else {r: f"rank {r}" for r in ranks}
    out = {}
    for r, role in reps.items():
        t0 = time.perf_counter()
        _, comm = dry_run(run_layout, lay.size, r, cfg, lay, B, S, True)
        out[r] = {"figures": figures(comm), "seconds": time.perf_counter() - t0, "role": role}
    return out


def real_layout(cfg, lay: Layout, B: int, S: int) -> list:
    """Every rank's figures from a real run on virtual ranks (small sizes only)."""

    def body(comm):
        run_layout(comm, cfg, lay, B, S, False)
        return figures(comm)

    return emulator.spawn(body, lay.size, timeout=120)
