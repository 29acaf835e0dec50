"""reduce_scatter / all_gather with axis= on MPI ranks: bitwise the virtual ranks' result (the
same ring order), NumPy's definitions (np.array_split of the sum, np.concatenate), the same
records as the virtual backend and as the axis-0 call on the moved-axis array."""

from __future__ import annotations

from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

import collectives as C
import emulator
from collectives import cost, reference

pytestmark = pytest.mark.mpi
DTYPES = [np.float64, np.float32, np.int64, ml_dtypes.bfloat16]


def _key(rec) -> tuple:  # a record without its call number (the session's own count)
    d = asdict(rec)
    d.pop("seq")
    return tuple(sorted(d.items()))


def _inputs(p, shape, dtype, seed=0):
    rngs = [np.random.default_rng(seed + r) for r in range(p)]
    if np.dtype(dtype).kind == "i":
        return [g.integers(-99, 99, shape).astype(dtype) for g in rngs]
    return [g.standard_normal(shape).astype(dtype) for g in rngs]


def _both(comm, fn):
    """fn(c) on this MPI rank and on virtual ranks: ((ours, records), (virtual's, records))."""
    mark = comm.ledger.mark()
    ours = fn(comm)
    recs = comm.ledger.since(mark)

    def job(c):
        return fn(c), list(c.ledger.records)

    return (ours, recs), emulator.spawn(job, comm.size, timeout=20)[comm.rank]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_reduce_scatter_along_axis(comm, axis, dtype):
    p, r = comm.size, comm.rank
    shape = [3, 4]
    shape.insert(axis % 3, 2 * p + 1)  # uneven along the cut axis
    xs = _inputs(p, tuple(shape), dtype, seed=10)
    (ours, recs), (virt, vrecs) = _both(comm, lambda c: C.reduce_scatter(c, xs[c.rank], axis=axis))
    (zero, zrecs), _ = _both(comm, lambda c: C.reduce_scatter(c, np.moveaxis(xs[c.rank], axis, 0)))

    want = np.array_split(reference.reduce_all(xs), p, axis=axis)[r]
    assert ours.shape == want.shape and ours.dtype == want.dtype and ours.flags.c_contiguous
    assert ours.tobytes() == virt.tobytes(), "MPI and virtual results differ"
    assert ours.tobytes() == np.moveaxis(zero, 0, axis).tobytes(), "!= the axis-0 call"
    if np.dtype(dtype).kind == "i":
        assert np.array_equal(ours, want)
    else:
        assert np.allclose(ours.astype(np.float64), want.astype(np.float64), rtol=0.05, atol=0.05)
    assert [_key(a) for a in recs] == [_key(b) for b in vrecs]
    assert [(a.peer, a.direction, a.nbytes) for a in recs] == [
        (a.peer, a.direction, a.nbytes) for a in zrecs
    ]
    k = 12  # elements per index of the cut axis
    counts = [c * k for c in cost.chunk_counts(2 * p + 1, p)]
    sent, received = comm.ledger.sent(recs), comm.ledger.received(recs)
    assert (sent, received) == cost.ring_reduce_scatter(counts, np.dtype(dtype).itemsize, r)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("axis", [1, 2, -1])
def test_all_gather_along_axis_with_sizes(comm, axis, dtype):
    p, r = comm.size, comm.rank
    sizes = [(j * 2 + 1) % 4 for j in range(p)]  # uneven, zero-length chunks included
    xs = []
    for j in range(p):
        shape = [2, 3]
        shape.insert(axis % 3, sizes[j])
        xs.append(_inputs(1, tuple(shape), dtype, seed=20 + j)[0])
    (ours, recs), (virt, vrecs) = _both(
        comm, lambda c: C.all_gather(c, xs[c.rank], sizes=sizes, axis=axis)
    )
    want = np.concatenate(xs, axis=axis)
    assert ours.shape == want.shape and ours.flags.c_contiguous
    assert ours.tobytes() == want.tobytes() == virt.tobytes()
    assert [_key(a) for a in recs] == [_key(b) for b in vrecs]
    counts = [s * 6 for s in sizes]
    sent, received = comm.ledger.sent(recs), comm.ledger.received(recs)
    assert (sent, received) == cost.ring_all_gather(counts, np.dtype(dtype).itemsize, r)
