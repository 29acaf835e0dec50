"""Where virtual ranks run: all on one core while their work is too small to overlap.

P virtual ranks are P threads under one GIL, so only one runs Python at a time; a second core
helps only while a rank is inside a GIL-free call (a BLAS matmul, a large NumPy loop). What it
costs is a hand-off between cores each time a rank blocks on a message or takes the GIL back
from NumPy: a futex wake of a thread on the other core, often idle, plus the caches. Measured
on the 2-core machine (docs/performance.md, "TP / SP / CP at the small size, fourth pass"):
4 ranks doing 300 tiny all-gathers took 154 ms CPU and wall on two cores and 71 ms on one; a
tp4 step at the small size (H 64, S 32) 182 ms CPU on two cores and 100 ms on one, 2.57x the
single-rank step's wall on two and 2.18x on one; at H 128, S 64 two cores win (1.15x against
1.55x), because there the matmuls overlap.

So a training program that knows its per-rank work is small runs its rank threads on one core
(`one_core`), and gives the cores back at its end. Only virtual ranks (threads of this process,
`shares_memory`): an MPI rank is a process of its own, and pinning every one to the same
core would serialise the job.
"""

from __future__ import annotations

import contextlib
import os

# Below this many GEMM FLOPs per block forward, rank and micro-batch (gemm_flops) a training
# program runs its rank threads on one core. Measured on the 2-core machine: at 3-13 M (every
# layout of bench layouts' small size, H 64, S 32) one core gives 0.6-0.85x the wall and
# 0.5-0.6x the CPU of two; at 50-100 M (H 128, S 64: the 3-D and tp4 rows) two cores win,
# 1.15-1.33x against 1.48-1.55x the reference's wall.
ONE_CORE_FLOPS = 25e6


def gemm_flops(cfg, tokens: int, tp: int = 1) -> float:
    """GEMM FLOPs of one block's forward on ``tokens`` tokens of one rank, its linear layers
    cut tp ways: 2 m (4 H^2 + 2 H F) / tp (attention's S x S products left out)."""
    H, F = cfg.d_model, cfg.d_ff
    return 2.0 * tokens * (4 * H * H + 2 * H * F) / tp


@contextlib.contextmanager
def one_core(comm, enabled: bool = True):
    """Run the calling rank's thread on one core until the block ends, when ``enabled`` and
    comm's ranks are threads of this process; else change nothing. Yields whether it pinned.
    Call on every rank of ``comm`` with the same ``enabled``: the ranks agree (an uncounted
    control-plane gather) on the core rank 0 runs on now - the one the scheduler found free,
    rather than a fixed one another job may hold."""
    before = _allowed() if enabled and shares_memory(comm) else None
    if not before or len(before) < 2:  # the same on every rank: threads inherit the set
        yield False
        return
    # only rank 0's core is used: the others send None instead of reading /proc (~26 us each)
    core = comm.allgather_object(_running_on(before) if comm.rank == 0 else None)[0]
    os.sched_setaffinity(0, {core})  # 0: the calling thread (Linux)
    try:
        yield True
    finally:
        os.sched_setaffinity(0, before)


def shares_memory(comm) -> bool:
    """True if comm's ranks are threads of this process (virtual ranks): an object passed
    through its control plane is then shared, not copied."""
    from .local import VirtualComm  # here: local.py's imports reach most of the emulator

    return isinstance(comm, VirtualComm)


def share(group) -> tuple[int, int]:
    """(i, R): on virtual ranks (``shares_memory``) rank i of group's R takes the items i, i + R,
    ... of work every rank would otherwise repeat on the same shared objects (an end-of-run
    check, an unshard); elsewhere, or alone, (0, 1): every item."""
    if group is not None and group.size > 1 and shares_memory(group):
        return group.rank, group.size
    return 0, 1


def shared_map(group, keys: list, fn) -> dict:
    """{k: fn(k) for k in keys}, in keys' order. On virtual ranks (``share``) rank i of the
    group's R computes the keys i, i + R, ... and the results are exchanged as objects
    (uncounted), so the group computes each once instead of R times and its ranks share the
    results (an end-of-run unshard); elsewhere, or alone, every rank computes every key."""
    at, R = share(group)
    got = {k: fn(k) for k in keys[at::R]}
    if R > 1:
        got = {k: v for theirs in group.allgather_object(got) for k, v in theirs.items()}
        got = {k: got[k] for k in keys}
    return got


def merge_found(group, found: list, R: int) -> list:
    """This rank's findings of its share, (order key, ..., label) tuples -> the labels of every
    rank's, in the order one rank doing every item would have found them (gathered uncounted)."""
    if R > 1:
        found = sorted(f for theirs in group.allgather_object(found) for f in theirs)
    return [f[-1] for f in found]


def _allowed() -> set | None:
    """The cores this thread may run on, or None where the platform cannot set them."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    try:
        return os.sched_getaffinity(0)
    except OSError:
        return None


def _running_on(allowed: set) -> int:
    """The core the calling thread last ran on (/proc: field 39 of its stat), else the lowest
    allowed one."""
    try:
        with open("/proc/thread-self/stat") as f:
            core = int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return min(allowed)
    return core if core in allowed else min(allowed)
