"""The MPI backend's lean collective path (emulator.mpi_call, the receive/send fast paths, the
trees' and ring's cached plans) against independent references: mpi4py's native Allreduce, the
same program on virtual ranks (bitwise: the same reduction order), the closed-form byte counts
of collectives/cost.py, and Records built by the dataclass's own constructor."""

from __future__ import annotations

from dataclasses import asdict

import ml_dtypes
import numpy as np
import pytest

import collectives as C
import emulator
from collectives import cost
from emulator.ledger import Record

pytestmark = pytest.mark.mpi
ALGOS = ["ring", "tree", "double_tree"]
# (dtype, elements): the benchmark's 4 KiB float32, an odd float64 count, bfloat16, empty, 1
SIZES = [(np.float32, 1024), (np.float64, 1001), (ml_dtypes.bfloat16, 513), (np.float64, 0),
         (np.int64, 1)]  # fmt: skip


def _inputs(p, n, dtype):
    rngs = [np.random.default_rng(100 + r) for r in range(p)]
    if np.dtype(dtype).kind == "i":
        return [g.integers(-99, 99, n).astype(dtype) for g in rngs]
    return [g.standard_normal(n).astype(dtype) for g in rngs]


def _key(rec: Record) -> tuple:  # a record without its call number (the session's own count)
    d = asdict(rec)
    d.pop("seq")
    return tuple(sorted(d.items()))


@pytest.mark.parametrize("dtype,n", SIZES)
@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_small_all_reduce_matches_virtual_bitwise_native_and_formulas(
    comm, MPI, algo, op, dtype, n
):
    if op == "avg" and np.dtype(dtype).kind == "i":
        pytest.skip("integer avg is refused by design")
    p, r = comm.size, comm.rank
    xs = _inputs(p, n, dtype)
    mark = comm.ledger.mark()
    with emulator.scope("lean"):
        ours = C.all_reduce(comm, xs[r], op=op, algorithm=algo)
    recs = comm.ledger.since(mark)

    def job(c):
        with emulator.scope("lean"):
            out = C.all_reduce(c, xs[c.rank], op=op, algorithm=algo)
        return out, list(c.ledger.records)

    virt, virt_recs = emulator.spawn(job, p, timeout=20)[r]
    native = None
    if np.dtype(dtype) != ml_dtypes.bfloat16 and op != "avg":
        native = np.empty_like(xs[r])
        MPI.COMM_WORLD.Allreduce(xs[r], native, op={"sum": MPI.SUM, "max": MPI.MAX}[op])

    assert ours.dtype == xs[r].dtype and ours.shape == xs[r].shape
    assert ours.tobytes() == virt.tobytes(), f"{algo}/{op}: MPI and virtual results differ"
    if native is not None:
        tol = 1e-5 if dtype == np.float32 else 1e-12  # float32: another order's rounding
        assert np.allclose(ours, native, rtol=tol, atol=tol), f"{algo}/{op}: vs native"
    # the records: the virtual backend's (same fields, same order; its call is its #0) ...
    assert [_key(a) for a in recs] == [_key(b) for b in virt_recs]
    assert {a.seq for a in recs} <= {comm.state.calls[-1].seq}
    # ... each one a Record equal to the one its constructor builds, hashable the same ...
    for a in recs:
        b = Record(**asdict(a))
        assert type(a) is Record and a == b and hash(a) == hash(b) and repr(a) == repr(b)
        assert a.tag == "lean" and a.op == "all_reduce" and a.algorithm == algo
    # ... and the bytes the closed forms give
    sent, received = comm.ledger.sent(recs), comm.ledger.received(recs)
    assert (sent, received) == cost.all_reduce(n, p, np.dtype(dtype).itemsize, r, algo)


def test_nested_and_failed_calls_leave_the_frame_as_the_generator_did(comm):
    st = comm.state
    n0 = len(st.calls)
    with comm.collective("outer", "x", np.ones(2)):
        assert st.depth == 1 and st.current.op == "outer"
        C.all_reduce(comm, np.ones(8), algorithm="tree")  # nested: not a call of its own
        assert st.depth == 1 and st.current.op == "outer"
    assert st.depth == 0 and st.current is None and len(st.calls) == n0 + 1
    bad = pytest.raises(ValueError, match="cannot receive from itself")
    with bad, comm.collective("bad", "x"):
        comm.recv(comm.rank, out=np.empty(1))  # a receive from itself: a named error
    assert st.depth == 0 and st.current is None
    assert np.array_equal(C.all_reduce(comm, np.ones(4)), np.full(4, float(comm.size)))
