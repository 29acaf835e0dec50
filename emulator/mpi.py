"""The same `Comm` over MPI: one OS process per rank, through mpi4py's buffer (Uppercase) API.

Every message travels as raw bytes (`uint8` views), so any NumPy dtype - bfloat16 included -
crosses unchanged. Each group owns two MPI communicators: one for data (our sends) and one for
the control plane (collective checks, object gathers), so instrumentation never interleaves
with counted traffic. Blocking waits are polls on nonblocking requests with a deadline, so a
hang becomes a `CommTimeout` naming the waiting rank and its flight recorder; under MPI a rank
can only see its own recorder (the other ranks report theirs when they time out).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time

import numpy as np

from .comm import (
    Call,
    CollectiveMismatch,
    Comm,
    CommError,
    CommTimeout,
    RankState,
    _bind_state,
    _expected,
    mismatch_message,
)
from .ledger import Ledger


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the MPI backend needs mpi4py and an MPI library: pip install -e '.[mpi]'"
        ) from exc
    return MPI


class MPIComm(Comm):
    def __init__(self, world, state, ranks, name, key, data, ctrl):
        super().__init__(world, state, ranks, name, key)
        self.mpi, self.ctrl = data, ctrl

    # -- waiting with a deadline ----------------------------------------------------------------
    def _wait(self, done, what: str) -> None:
        # Poll, giving the core away between polls: ranks often outnumber cores (4 ranks on a
        # 2-core laptop), and a spinning rank would starve the peer it waits for. sched_yield
        # returns at once when nothing else is runnable; after 50 ms we sleep between polls so
        # a long wait does not burn a core. Never wait without a deadline.
        start = time.monotonic()
        deadline = start + self.world.timeout
        while not done():
            now = time.monotonic()
            if now - start < 0.05:
                os.sched_yield()
            else:
                time.sleep(2e-4)
            if now > deadline:
                raise CommTimeout(
                    f"rank {self.state.rank} waited {self.world.timeout:g} s {what} in "
                    f"group {self.name!r} (a hang: some rank skipped a call or is stuck). "
                    f"Under MPI each rank reports its own flight recorder:\n  "
                    f"{self.state.flight()}"
                )

    # -- data plane -----------------------------------------------------------------------------
    def _post(self, array: np.ndarray, dst: int, channel: int) -> None:
        buf = np.array(array, copy=True, order="C").reshape(-1).view(np.uint8)
        req = self.mpi.Isend(buf, dest=dst, tag=0)
        pending = self.world.pending
        pending.append((req, buf))
        if len(pending) > 32:
            pending[:] = [p for p in pending if not p[0].Test()]

    def _take(self, src: int, out, shape, dtype, channel: int) -> np.ndarray:
        req, out = self._irecv(src, out, shape, dtype)
        self._complete(req, src, out)
        return out

    def _irecv(self, src: int, out, shape, dtype):
        if out is None:
            out = np.empty(shape, dtype)
        return self.mpi.Irecv(out.reshape(-1).view(np.uint8), source=src, tag=0), out

    def _complete(self, req, src: int, out, send_req=None) -> None:
        """Wait for a posted receive (and our matching send); check the message's size."""
        MPI = _mpi()
        status = MPI.Status()
        peer = self.ranks[src]
        try:
            self._wait(lambda: req.Test(status), f"to receive from rank {peer}")
        except MPI.Exception as exc:  # a larger message than expected: MPI_ERR_TRUNCATE
            raise self._size_error(src, out, f"more than {out.nbytes}") from exc
        if status.Get_count(MPI.BYTE) != out.nbytes:
            raise self._size_error(src, out, str(status.Get_count(MPI.BYTE)))
        if send_req is not None:
            self._wait(send_req.Test, f"for rank {peer} to take our message")

    def _size_error(self, src: int, out, got: str) -> CommError:
        return CommError(
            f"rank {self.state.rank} expected {out.dtype}{list(out.shape)} ({out.nbytes} bytes) "
            f"from rank {self.ranks[src]} in group {self.name!r} but the message has {got} "
            f"bytes; sender and receiver disagree about the message"
        )

    def sendrecv(self, array, dst: int, src: int, out=None, shape=None, dtype=None):
        # Post the receive first (the data lands in place), then send without an eager copy:
        # the send buffer is untouched until both halves complete here.
        array = self._as_message(array, "sendrecv")
        self._peer(dst, "send to")
        self._peer(src, "receive from")
        out, shape, dtype = _expected(out, shape, dtype)
        rreq, out = self._irecv(src, out, shape, dtype)
        sreq = self.mpi.Isend(np.ascontiguousarray(array).reshape(-1).view(np.uint8), dest=dst)
        self._record("send", dst, array.nbytes)
        self._complete(rreq, src, out, send_req=sreq)
        self._record("recv", src, out.nbytes)
        return out

    # -- control plane ----------------------------------------------------------------------------
    def _check(self, call: Call) -> None:
        # One 8-byte digest per rank per collective keeps the check cheap; only when digests
        # differ do the ranks exchange their full descriptions, so every rank can name both.
        if not self.world.check:
            return
        digest = hashlib.blake2b(repr(call.signature()).encode(), digest_size=8).digest()
        mine = np.frombuffer(digest, dtype=np.uint64).copy()
        every = np.empty(self.world_size, np.uint64)
        req = self.ctrl.Iallgather(mine, every)
        self._wait(req.Test, f"to check collective {call.describe()} against the other ranks")
        if np.all(every == mine[0]):
            return
        calls = self.allgather_object(call.describe())
        other = next(r for r in range(self.world_size) if calls[r] != calls[self.rank])
        raise CollectiveMismatch(
            mismatch_message(
                self.name, (self.state.rank, calls[self.rank]), (self.ranks[other], calls[other])
            )
        )

    def allgather_object(self, obj) -> list:
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.empty(self.world_size, np.int64)
        req = self.ctrl.Iallgather(np.array([data.size], np.int64), sizes)
        self._wait(req.Test, "in a control-plane gather")
        every = np.empty(int(sizes.sum()), np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        req = self.ctrl.Iallgatherv(data, [every, sizes, offsets, _mpi().BYTE])
        self._wait(req.Test, "in a control-plane gather")
        return [pickle.loads(every[o : o + s].tobytes()) for o, s in zip(offsets, sizes)]

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        MPI = _mpi()
        world = MPI.COMM_WORLD
        data = world.Create_group(world.Get_group().Incl(list(glob)))
        return MPIComm(self.world, self.state, glob, name, key, data, data.Dup())


class MPIWorld:
    def __init__(self, timeout: float, check: bool):
        self.timeout = float(timeout)
        self.check = check
        self.pending: list = []

    def finish(self, comm: MPIComm) -> None:
        """Complete every outstanding eager send (each rank's sends must be received)."""
        for req, _ in self.pending:
            comm._wait(req.Test, "for a sent message to be received at exit")
        self.pending.clear()


def world_comm(timeout: float, check: bool = True) -> MPIComm:
    """This process's world communicator (MPI must have been launched with mpiexec)."""
    MPI = _mpi()
    w = MPIWorld(timeout, check)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    state = RankState(rank=rank, ledger=Ledger(rank))
    _bind_state(state)
    data = MPI.COMM_WORLD.Dup()
    return MPIComm(w, state, tuple(range(size)), "world", ("world",), data, data.Dup())
