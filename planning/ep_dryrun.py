"""Dry runs of expert parallelism: parallel/expert/train.py's ep_train on one rank, shape-only.

Routing assumption: padded to capacity. Only dispatch="padded" is dry-run: every routing group
sends each expert its full capacity C_g of rows, filled or not (GShard / DeepSpeed's fixed-size
all-to-all), so no message or buffer size depends on which tokens the router picks - the
router's choices read as zeros in a shape-only run (experts 0..K-1 for every token) and steer
values only. dispatch="exact" sends the kept rows themselves (all-to-all-v sized by the routing),
which a shape-only run cannot know: refused by name.

Roles: the mesh is edp x ep; every ep rank owns El = E / ep experts of the same shapes and
sends / receives El x sum_g C_g rows to / from every peer, so rank 0 stands for all ranks
(tests/planning/test_ep_dry_run.py checks it on every rank of real runs). ep joins
parallel.train separately (another branch); this covers ep_train's dp x ep.
"""

from __future__ import annotations

import time

import emulator
from emulator.dry import dry_run
from planning.dryrun import batch, figures
from planning.nd_dryrun import Timing


def run_ep(comm, cfg, ep: int, B: int, S: int, dry: bool, dispatch="padded", **kw):
    from parallel.expert.train import ep_train

    if dry and dispatch != "padded":
        raise ValueError(
            f"dispatch={dispatch!r}: exact dispatch sends the routed rows themselves (sizes follow "
            "the routing), which a dry run cannot know; dry-run dispatch='padded' (every expert "
            "filled to capacity)"
        )
    return ep_train(comm, cfg, 0, batch(cfg, B, S, dry), 1, ep=ep, dispatch=dispatch, **kw)


def representatives(world: int) -> dict:
    return {0: f"rank 0: stands for all {world} ranks (every ep rank holds E / ep experts)"}


def dry_ep(cfg, world: int, ep: int, B: int, S: int, ranks=None, **kw) -> dict:
    """{rank: {"figures", "role", "time"}}; ``kw``: ep_train's (microbatches, grad_sync, ...)."""
    reps = representatives(world) if ranks is None else {r: f"rank {r}" for r in ranks}
    out = {}
    for r, role in reps.items():
        t0, c0 = time.perf_counter(), time.process_time()
        _, comm = dry_run(run_ep, world, r, cfg, ep, B, S, True, **kw)
        t = Timing(time.perf_counter() - t0, time.process_time() - c0)
        out[r] = {"figures": figures(comm), "role": role, "time": t}
    return out


def real_ep(cfg, world: int, ep: int, B: int, S: int, **kw) -> list:
    """Every rank's figures from a real ep_train run on virtual ranks (small sizes)."""

    def body(comm):
        run_ep(comm, cfg, ep, B, S, False, **kw)
        return figures(comm)

    return emulator.spawn(body, world, timeout=300)
