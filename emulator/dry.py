"""A solo communicator for dry runs: one rank of a P-rank group runs alone, on shape-only arrays.

`DryComm(size, rank)` is a `Comm` whose peers do not exist. A send records its bytes in this
rank's ledger and goes nowhere; a receive already states the shape and dtype it expects (the
Comm contract, as in MPI), so it records those bytes and returns a shape-only array of exactly
that shape (emulator/shapes.py) without waiting. The collectives, built only on send / recv,
therefore run their real schedule and the ledger holds what a real run's ledger holds for this
rank. Control-plane gathers (`allgather_object`) return this rank's object for every rank: the
rank symmetry a dry run assumes (every rank of a role holds objects of the same shape).

`dry_run(fn, size, rank)` runs `fn(comm)` under `shapes.shape_only()` with the rank's state
bound to the thread (so `emulator.scope` tags land in its ledger) and returns (result, comm).
"""

from __future__ import annotations

from emulator.comm import Call, Comm, _bind_state
from emulator.ledger import Ledger
from emulator.message import _expected
from emulator.rank import RankState
from emulator.shapes import ShapeArray, shape_only


class DryComm(Comm):
    def __init__(self, size: int, rank: int, *, state=None, ranks=None, name="world", key=None):
        if not 0 <= rank < size:
            raise ValueError(f"DryComm: rank {rank} is not in 0..{size - 1}")
        state = state or RankState(rank=rank, ledger=Ledger(rank))
        super().__init__(None, state, ranks or tuple(range(size)), name, key or ("world",))

    def recv(self, src: int, out=None, shape=None, dtype=None):
        self._peer(src, "receive from")
        if isinstance(out, ShapeArray):  # our buffers have no layout to check
            shape, dtype = out.shape, out.dtype
        else:
            out, shape, dtype = _expected(out, shape, dtype)
        got = out if out is not None else ShapeArray.new(shape, dtype)
        self._record("recv", src, got.nbytes)
        return got

    def _post(self, array, dst: int, channel: int) -> None:  # no mailbox: nothing to match
        pass  # nobody is listening: the ledger entry is the message

    def _take(self, src, out, shape, dtype, channel: int):
        raise AssertionError("DryComm.recv does not take messages")

    def _check(self, call: Call) -> None:
        pass  # the peers that would compare calls are not running

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        g = DryComm.__new__(DryComm)
        Comm.__init__(g, None, self.state, glob, name, key)
        return g

    def allgather_object(self, obj) -> list:
        return [obj] * self.world_size


def dry_run(fn, size: int, rank: int = 0, *args, **kw):
    """-> (fn(comm, *args, **kw), comm) with comm a DryComm of `size` ranks as rank `rank`."""
    comm = DryComm(size, rank)
    _bind_state(comm.state)
    try:
        with shape_only():
            return fn(comm, *args, **kw), comm
    finally:
        _bind_state(None)
