"""The ring on a backend that hands messages over (virtual ranks: `hands_over`, each partial
passed on as the copy it arrived in) against the same ring through receive buffers and eager
copies (`hands_over = False`, as on MPI): bitwise the same results and the same ledger."""

from dataclasses import astuple

import ml_dtypes
import numpy as np
import pytest

import collectives as C
import emulator
from emulator.local import VirtualComm


def _program(comm, n, dtype, op):
    g = np.random.default_rng(comm.rank)
    x = (g.standard_normal(n) * 8).astype(dtype)
    rows = x.reshape(-1, 1) if n % 2 else x
    k = lambda j: (j % 2) * (j + 1) + n % 3  # uneven rows, empty ones too
    y = (g.standard_normal(k(comm.rank)) * 8).astype(dtype)
    out = [
        C.reduce_scatter(comm, rows, op=op),
        C.all_gather(comm, x),
        C.all_gather(comm, y, sizes=[k(j) for j in range(comm.size)]),
        C.all_reduce(comm, x, op=op, algorithm="ring"),
    ]
    return [(o.dtype.str, o.shape, o.tobytes()) for o in out], [
        astuple(r) for r in comm.ledger.records
    ]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 40, 1001])
@pytest.mark.parametrize(
    "dtype, op",
    [(np.float64, "sum"), (np.float32, "avg"), (ml_dtypes.bfloat16, "sum"), (np.int32, "max")],
)
def test_handed_over_ring_is_the_buffered_ring(p, n, dtype, op, monkeypatch):
    handed = emulator.spawn(_program, p, n, dtype, op)
    monkeypatch.setattr(VirtualComm, "hands_over", False)
    buffered = emulator.spawn(_program, p, n, dtype, op)
    assert handed == buffered
