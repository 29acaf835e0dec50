"""One init_params per virtual world: the ranks of a spawn share one read-only copy.

Every trainer starts each rank from init_params(cfg, seed) and keeps what the rank holds (a
copy, a TP shard, a stage's tensors, a ZeRO flat buffer). On virtual ranks the P ranks are
threads of one process, so drawing the same Psi normals P times is work the reference does once
(3-D ZeRO-3, 8 ranks at H 256: 8 x 40 ms of a ~1.9 s step's CPU). ``shared_init_params`` draws
them once per (world, config, seed) and hands every rank of that world the same dict of arrays,
marked read-only: a rank that wrote into it instead of copying first fails with NumPy's
"assignment destination is read-only" instead of corrupting its neighbours' start.

    full = shared_init_params(comm, cfg, seed)   # read-only; copy or slice what the rank holds

Kept per world (a spawn), not per process: a program that spawns again - a benchmark's next
round - draws again, as the single-rank reference does on every call. Once as many calls as
the world has ranks took a key, the slot drops it (the arrays then live as long as a rank holds
them, not until the world is collected: a world is freed by the cycle collector, and arrays
held that long are fresh pages for the next spawn); a later call draws again. Under MPI every rank is a
process of its own and this is init_params itself. A seed that is not an int (None: fresh
entropy on every call) is never shared: each rank draws its own, as before.
The memory ledger never charged the initial full-shape draw and does not now (what a rank holds
is charged by the trainer); the arrays are bitwise those of a fresh init_params(cfg, seed).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from emulator.config import ModelConfig, init_params
from emulator.local import VirtualComm

_worlds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # VirtualWorld -> _Slot
_guard = threading.Lock()  # held only to find or make a world's slot (no waiting inside)


class _Slot:
    def __init__(self):
        self.lock = threading.Lock()  # held while the world's first caller draws
        self.params: dict = {}  # (cfg, seed) -> {name: read-only array}
        self.takers: dict = {}  # (cfg, seed) -> calls so far


def _shareable(seed) -> bool:
    return isinstance(seed, (int, np.integer)) and not isinstance(seed, bool)


def shared_init_params(comm, cfg: ModelConfig, seed) -> dict[str, np.ndarray]:
    """init_params(cfg, seed), drawn once per virtual world and shared read-only by its ranks
    (any group of the world); a fresh, writable init_params(cfg, seed) off virtual ranks."""
    if not isinstance(comm, VirtualComm) or not _shareable(seed):
        return init_params(cfg, seed)
    world = comm.world
    with _guard:
        slot = _worlds.get(world)
        if slot is None:
            slot = _worlds[world] = _Slot()
    # another rank may be drawing: wait for it, never without a deadline
    if not slot.lock.acquire(timeout=world.timeout):
        raise TimeoutError(f"shared_init_params: another rank held the draw for more than the "
                           f"world's timeout ({world.timeout:g} s)")  # fmt: skip
    try:
        key = (cfg, int(seed))
        params = slot.params.get(key)
        if params is None:  # the first caller draws; a failure here leaves nothing behind
            params = init_params(cfg, seed)
            for a in params.values():
                a.flags.writeable = False
            slot.params[key] = params
        slot.takers[key] = slot.takers.get(key, 0) + 1
        if slot.takers[key] == world.size:  # every rank has it: the slot lets go, so the
            del slot.params[key], slot.takers[key]  # arrays go with the last rank's reference
    finally:
        slot.lock.release()
    return dict(params)  # a rank may rebind its dict's entries; the arrays stay shared
