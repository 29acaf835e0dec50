"""The expert-parallel MoE layer under MPI: == the reference on the gathered groups (1e-12),
bytes == parallel/expert/cost.py, and bitwise == the same program on virtual ranks."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from tests.parallel.expert.helpers import case, check, check_bytes

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_ep_layer_under_mpi(comm, mode):
    P = comm.size
    ref, fn = case(P, 2 * P, 2, 0.75, mode=mode, seed=11)
    mark = comm.ledger.mark()
    try:
        mine = fn(comm)
    finally:  # the session's ledger is shared: other tests read it whole (test_vs_native.py)
        del comm.ledger.records[mark:]
    everyone = comm.allgather_object(mine)  # uncounted control plane
    local = emulator.spawn(fn, P, timeout=30)[comm.rank]
    check(ref, everyone, P)
    check_bytes(ref, everyone, mode)
    for a, b in (
        (mine[0], local[0]),
        (mine[2], local[2]),
        *((mine[3][n], local[3][n]) for n in mine[3]),
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert mine[4] == local[4]
