"""User point-to-point messages under MPI (the 64-byte dtype/shape prefix), timeouts, groups.

Expectations are independent of the backend: the array that was sent (every rank rebuilds it
from the seed), its `nbytes` for the ledger, and the virtual backend's validation rules.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import collectives as C

pytestmark = pytest.mark.mpi

MESSAGES = [
    (np.float64, (2, 3)),
    (np.int8, (5,)),
    (np.complex128, (1, 1, 2)),
    (np.bool_, (7,)),
    (ml_dtypes.bfloat16, (3, 2)),
    (np.float32, ()),  # 0-d
    (np.int64, (0, 4)),  # empty
    (np.uint16, (2,) * 12),  # a long shape: the prefix keeps a digest
]


def message(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(math.prod(shape)) * 100).astype(dtype).reshape(shape)


@pytest.mark.parametrize("dtype,shape", MESSAGES)
def test_user_message_arrives_whole_and_counts_payload_bytes(comm, dtype, shape):
    p, r = comm.size, comm.rank
    mark = comm.ledger.mark()
    x = message(dtype, shape, seed=r)
    if r % 2 == 0 and r + 1 < p:
        comm.send(x, r + 1)
        comm.send(np.asfortranarray(x) if x.ndim > 1 else x, r + 1)  # F-order: its values
    got = []
    if r % 2 == 1:
        got.append(comm.recv(r - 1, shape=shape, dtype=dtype))
        got.append(comm.recv(r - 1, out=np.empty(shape, dtype)))
    recs = comm.ledger.since(mark)
    want = message(dtype, shape, seed=max(r - 1, 0))  # the sender's (odd ranks)
    for g in got:
        assert g.shape == want.shape and g.dtype == want.dtype and g.tobytes() == want.tobytes()
    n = 2 * x.nbytes if (r % 2 == 0 and r + 1 < p) or r % 2 == 1 else 0
    assert comm.ledger.sent(recs) + comm.ledger.received(recs) == n  # the prefix is uncounted


def test_sendrecv_outside_a_collective_is_user_traffic(comm):
    p, r = comm.size, comm.rank
    got = comm.sendrecv(np.full((2, 2), r, np.int32), (r + 1) % p, (r - 1) % p, shape=(2, 2),
                        dtype=np.int32)  # fmt: skip
    assert np.array_equal(got, np.full((2, 2), (r - 1) % p, np.int32))


def test_user_message_and_collective_never_match(comm):
    # A send posted before an all-reduce is received after it: the all-reduce must not take it.
    p, r = comm.size, comm.rank
    comm.send(np.array([-1.0]), (r + 1) % p)
    total = C.all_reduce(comm, np.array([float(r)]), algorithm="ring")
    got = comm.recv((r - 1) % p, shape=1, dtype=np.float64)
    assert total[0] == sum(range(p)) and got[0] == -1.0


def test_group_collectives_and_end_of_run_check(comm):
    p, r = comm.size, comm.rank
    evens = comm.group(range(0, p, 2)) if r % 2 == 0 else comm.group(range(1, p, 2))
    got = C.all_reduce(evens, np.array([r]))
    assert got[0] == sum(range(r % 2, p, 2))
    assert comm.world.finish(comm, ok=(r != 0)) == [False] + [True] * (p - 1)  # verdicts


@pytest.mark.parametrize("bad", [float("nan"), 0, -1.0, float("-inf")])
def test_timeout_is_validated_like_spawn(bad):
    from emulator.mpi import world_comm

    with pytest.raises(ValueError, match="timeout must be positive seconds"):
        world_comm(bad)
    import emulator

    for run in (lambda: emulator.spawn(lambda c: None, 2, timeout=bad), lambda: emulator.launch(
            lambda c: 0, timeout=bad)):  # fmt: skip
        with pytest.raises(ValueError, match="timeout must be positive seconds"):
            run()
