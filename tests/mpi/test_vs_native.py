"""Our collectives under MPI == mpi4py's native ones, and == the virtual backend bitwise."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
import emulator
from collectives import cost

pytestmark = pytest.mark.mpi
CASES = [(np.float64, 1000), (np.float32, 4099), (np.int64, 37), (np.float32, 3), (np.int64, 0)]


def inputs(p, n, dtype, seed=0):
    """Every process builds every rank's input, so it can rerun the job on virtual ranks."""
    rngs = [np.random.default_rng(seed * 1000 + r) for r in range(p)]
    if np.dtype(dtype).kind == "i":
        return [g.integers(-1000, 1000, n).astype(dtype) for g in rngs]
    return [g.standard_normal(n).astype(dtype) for g in rngs]


def virtual(fn, p):
    """The same program on p virtual ranks inside this process."""
    return emulator.spawn(fn, p, timeout=20)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def close(a, b, dtype) -> bool:
    if np.dtype(dtype).kind == "i":
        return np.array_equal(a, b)
    tol = 1e-5 if np.dtype(dtype) == np.float32 else 1e-12
    return np.allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,n", CASES)
@pytest.mark.parametrize("algo", ["ring", "tree", "double_tree"])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce(comm, MPI, dtype, n, algo, op):
    p, r = comm.size, comm.rank
    xs = inputs(p, n, dtype, seed=n)
    native = np.empty_like(xs[r])
    MPI.COMM_WORLD.Allreduce(xs[r], native, op={"sum": MPI.SUM, "max": MPI.MAX}[op])
    ours = C.all_reduce(comm, xs[r], op=op, algorithm=algo)
    virt = virtual(lambda c: C.all_reduce(c, xs[c.rank], op=op, algorithm=algo), p)[r]
    assert close(ours, native, dtype), f"{op}/{algo}: vs native Allreduce"
    assert same_bits(ours, virt), f"{op}/{algo}: MPI and virtual backends differ bitwise"


@pytest.mark.parametrize("dtype,n", CASES)
def test_reduce_scatter(comm, MPI, dtype, n):
    p, r = comm.size, comm.rank
    xs = inputs(p, n, dtype, seed=n + 1)
    counts = cost.chunk_counts(n, p)
    native = np.empty(counts[r], dtype)
    MPI.COMM_WORLD.Reduce_scatter(xs[r], native, recvcounts=counts, op=MPI.SUM)
    ours = C.reduce_scatter(comm, xs[r])
    virt = virtual(lambda c: C.reduce_scatter(c, xs[c.rank]), p)[r]
    assert close(ours, native, dtype) and same_bits(ours, virt)


def test_reduce_scatter_block(comm, MPI):
    p, r = comm.size, comm.rank
    xs = inputs(p, 8 * p, np.int64, seed=5)
    native = np.empty(8, np.int64)
    MPI.COMM_WORLD.Reduce_scatter_block(xs[r], native, op=MPI.SUM)
    assert np.array_equal(C.reduce_scatter(comm, xs[r]), native)


@pytest.mark.parametrize("dtype,n", CASES)
def test_all_gather_uneven(comm, MPI, dtype, n):
    p, r = comm.size, comm.rank
    sizes = [(n + 3 * j) % 7 for j in range(p)]
    xs = [x[: sizes[j]] for j, x in enumerate(inputs(p, 7, dtype, seed=n))]
    native = np.empty(sum(sizes), dtype)
    displs = cost.offsets(sizes)[:-1]
    MPI.COMM_WORLD.Allgatherv(xs[r], [native, sizes, displs, MPI._typedict[native.dtype.char]])
    ours = C.all_gather(comm, xs[r], sizes=sizes)
    virt = virtual(lambda c: C.all_gather(c, xs[c.rank], sizes=sizes), p)[r]
    assert np.array_equal(ours, native) and same_bits(ours, virt)


def test_all_gather_even(comm, MPI):
    p, r = comm.size, comm.rank
    xs = inputs(p, 10, np.float32, seed=9)
    native = np.empty(10 * p, np.float32)
    MPI.COMM_WORLD.Allgather(xs[r], native)
    assert np.array_equal(C.all_gather(comm, xs[r]), native)


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast(comm, MPI, root):
    p, r = comm.size, comm.rank
    root %= p
    xs = inputs(p, 33, np.float64, seed=root)
    native = xs[r].copy()
    MPI.COMM_WORLD.Bcast(native, root=root)
    ours = C.broadcast(comm, xs[r], root=root)
    assert np.array_equal(ours, native)


def test_all_to_allv(comm, MPI):
    p, r = comm.size, comm.rank
    rows = (np.arange(p * p).reshape(p, p) * 7) % 5  # rows[src][dst]
    data = [inputs(1, int(rows[r].sum()), np.float32, seed=r)[0]]
    sc, rc = rows[r].tolist(), rows[:, r].tolist()
    native = np.empty(sum(rc), np.float32)
    MPI.COMM_WORLD.Alltoallv(
        [data[0], sc, cost.offsets(sc)[:-1], MPI.FLOAT],
        [native, rc, cost.offsets(rc)[:-1], MPI.FLOAT],
    )
    off = cost.offsets(sc)
    sends = [data[0][off[j] : off[j + 1]] for j in range(p)]
    ours = np.concatenate(C.all_to_allv(comm, sends))
    sent, recv = comm.ledger.sent(op="all_to_allv"), comm.ledger.received(op="all_to_allv")
    assert np.array_equal(ours, native)
    assert (sent, recv) == cost.pairwise_all_to_allv(sc, rc, 4, r, exchange=True)


@pytest.mark.parametrize("algo", ["ring", "tree", "double_tree"])
def test_ledger_matches_formula_under_mpi(comm, algo):
    p, r = comm.size, comm.rank
    x = np.ones(1001, np.float32)
    mark = comm.ledger.mark()
    C.all_reduce(comm, x, algorithm=algo)
    rec = comm.ledger.since(mark)
    got = (comm.ledger.sent(rec), comm.ledger.received(rec))
    assert got == cost.all_reduce(1001, p, 4, r, algo)
