"""emulator.mpi_call (the MPI backend's lean call frame) against what it replaces: the label is
Call.describe() byte for byte, and OpenCall runs the same hooks in the same order as
Comm.collective's generator. No MPI needed: a stand-in communicator records the hook calls."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from emulator.comm import Call, Comm
from emulator.ledger import Ledger
from emulator.mpi_call import OpenCall, label
from emulator.rank import RankState

names = st.text(min_size=0, max_size=12)


@given(st.integers(0, 10**9), names, names, names, st.lists(st.integers(0, 99), max_size=4),
       st.sampled_from(["float32", "bfloat16", "-", "int64"]), names)  # fmt: skip
def test_label_is_describe(seq, op, algorithm, group, shape, dtype, extra):
    call = Call(seq, op, algorithm, group, tuple(shape), dtype, extra)
    assert label(call) == call.describe()


def _state(tags=(), current=None) -> RankState:
    s = RankState(rank=3, ledger=Ledger(3))
    s.tags, s.current, s.ledger.step = list(tags), current, 7
    if current is not None:  # what Comm.collective / OpenCall set beside `current`
        s.label = (current.op, current.algorithm, current.seq)
    return s


class _Fake:
    """A communicator whose hooks log their calls (the order Comm.collective runs them in)."""

    def __init__(self, fail_in=None):
        self.state, self.key, self.name, self.log, self.fail_in = _state(), ("k",), "g", [], fail_in

    def _hook(self, what, call, *rest):
        self.log.append((what, call.seq, *[type(e).__name__ for e in rest]))
        if what == self.fail_in:
            raise KeyError(what)

    _check = lambda self, call: self._hook("check", call)
    _end_call = lambda self, call: self._hook("end", call)
    _failed_call = lambda self, call, exc: self._hook("failed", call, exc)


def _run(frame, comm, body_fails=False, nested=False):
    try:
        with frame(comm, "all_reduce", "tree", np.ones((2, 3), np.float32), "op=sum"):
            comm.log.append(("label", comm.state.label))  # what _record labels the bytes with
            if nested:
                with frame(comm, "reduce_scatter", "ring", None, ""):
                    assert comm.state.depth == 2
            if body_fails:
                raise ValueError("body")
    except (ValueError, KeyError) as exc:
        comm.log.append(("raised", type(exc).__name__))
    s = comm.state
    calls = [(c.seq, c.op, c.algorithm, c.group, c.shape, c.dtype, c.extra) for c in s.calls]
    return comm.log, calls, s.depth, s.current, s.label, s.progress, s.seqs


def _generator(comm, *args):
    return Comm.collective(comm, *args)


@pytest.mark.parametrize("fail_in", [None, "check", "end", "failed"])
@pytest.mark.parametrize("body_fails", [False, True])
@pytest.mark.parametrize("nested", [False, True])
def test_open_call_runs_the_generators_steps(fail_in, body_fails, nested):
    got = [_run(OpenCall, _Fake(fail_in), body_fails, nested) for _ in range(2)]
    want = [_run(_generator, _Fake(fail_in), body_fails, nested) for _ in range(2)]
    assert got == want
    assert got[0][2] == 0 and got[0][3] is None  # the frame is closed whatever happened
