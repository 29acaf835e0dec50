"""A collective call's bookkeeping, lean: the call frame (both backends) and its label (MPI).

`Comm.collective` is a generator context manager; under MPI a small all-reduce is a few tens of
microseconds, and that generator alone measured ~2 us a call (virtual ranks use the frame too:
a tp4 SP step makes ~50 collective calls per rank). `OpenCall` does the same steps
in the same order as an object with `__enter__` / `__exit__` (the flight recorder's `Call`,
the sequence number, the ledger label, the depth for nested calls, `_check` / `_end_call` /
`_failed_call`), and `label` gives byte-for-byte what `Call.describe()` gives, from a cache: the
label's text without the sequence number is the same for every repeat of a call. The ledger's
records are `Comm._record`'s (cached Records, shared by both backends).
tests/emulator/test_mpi_call.py checks both against the originals.
"""

from __future__ import annotations

import functools

import numpy as np

from .comm import P2P, Call
from .message import _dtype_name

_NAMES: dict = {}  # dtype -> _dtype_name(dtype): str(dtype) is computed in Python by NumPy


def _name(dtype) -> str:
    name = _NAMES[dtype] = _dtype_name(dtype)
    return name


class OpenCall:
    """`with comm.collective(op, algorithm, array, extra):` on an MPIComm (see Comm.collective:
    only the outermost call is recorded and checked; a failing body goes to `_failed_call`,
    a clean one to `_end_call`; the frame is closed in every case)."""

    __slots__ = ("algorithm", "array", "call", "comm", "extra", "op")

    def __init__(self, comm, op: str, algorithm: str, array, extra: str):
        self.comm, self.op, self.algorithm, self.array, self.extra = (
            comm,
            op,
            algorithm,
            array,
            extra,
        )
        self.call = None

    def __enter__(self) -> None:
        comm = self.comm
        st = comm.state
        if st.depth:  # nested in another collective: counted and checked as the outer one
            st.depth += 1
            return
        seq = st.seqs.get(comm.key, 0)
        st.seqs[comm.key] = seq + 1
        a = self.array
        if a is None:
            shape, dtype = (), "-"
        else:
            if type(a) is not np.ndarray:
                a = np.asarray(a)
            dt = a.dtype
            shape, dtype = a.shape, _NAMES.get(dt) or _name(dt)  # ndarray.shape: a tuple
        call = self.call = Call(seq, self.op, self.algorithm, comm.name, shape, dtype, self.extra)
        st.calls.append(call)
        st.current = call
        st.label = (call.op, call.algorithm, seq)  # as Comm.collective sets it (comm.py's _record)
        st.depth = 1
        st.progress += 1
        try:
            comm._check(call)
        except BaseException:
            st.depth = 0
            st.current = None
            st.label = P2P
            raise

    def __exit__(self, kind, exc, tb) -> bool:
        st = self.comm.state
        call = self.call
        if call is None:
            st.depth -= 1
            return False
        try:
            if kind is None:
                self.comm._end_call(call)  # only after a clean exit
            else:
                self.comm._failed_call(call, exc)  # may raise the error it explains instead
        finally:
            st.depth = 0
            st.current = None
            st.label = P2P
        return False


@functools.lru_cache(maxsize=1024)
def _after_seq(op: str, algorithm: str, group: str, shape: tuple, dtype: str, extra: str) -> str:
    text = Call(0, op, algorithm, group, shape, dtype, extra).describe()
    return text[len(op) + 2 :]  # describe() is f"{op}#{seq}(...)": the "(...)" part


def label(call: Call) -> str:
    """== call.describe(), with the part after the sequence number cached per signature."""
    try:
        rest = _after_seq(call.op, call.algorithm, call.group, call.shape, call.dtype, call.extra)
    except TypeError:  # an unhashable field (never from collectives.api): the plain text
        return call.describe()
    return f"{call.op}#{call.seq}{rest}"
