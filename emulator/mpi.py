"""The same `Comm` over MPI: one OS process per rank, through mpi4py's buffer (Uppercase) API.

Every message travels as raw bytes (`uint8` views), so any NumPy dtype - bfloat16 included -
crosses unchanged. Each group owns one MPI communicator; its tags keep the data plane (our
sends) apart from the control plane (collective checks, object gathers; `emulator.mpi_control`),
so instrumentation never interleaves with counted traffic. Blocking waits are polls on nonblocking
requests with a deadline, so a hang becomes a `CommTimeout` naming the waiting rank, the peer(s)
it waits for and its flight recorder (under MPI a rank sees only its own recorder).

Channels: user point-to-point messages travel with MPI tag 0, a collective's messages with tag
3 + (its sequence number in the group mod TAG_UB - 3), so they never match each other nor the
control plane's tags 1 and 2. A user message carries a 64-byte prefix naming its dtype and shape
(uncounted, like the checks; `emulator.mpi_p2p`), so a receive of the right byte count but another
dtype or shape is an error naming both sides. A collective's messages carry none: the collective
check compares every rank's op, algorithm, shape and dtype (its labels travel beside the data -
posted right after the call's first send, or before its first wait - and are compared during the
call's waits and before it returns; a size error or hang a differing call causes is reported as
the mismatch; with `check=False` that guard is off). Subgroups: `emulator.mpi_groups`. Collectives send their own buffers without the eager copy
(`send_lent`), waited for at the call's end.
"""

from __future__ import annotations

import functools
import pickle

import numpy as np

from .comm import Call, CollectiveMismatch, Comm, CommError, RankState, _bind_state
from .ledger import Ledger
from .message import _SENDABLE, _expected
from .mpi_call import OpenCall, label
from .mpi_control import CTRL_TAG, OBJECTS, Exchange, MPIWorld, gather, poll, verify
from .mpi_groups import make_group
from .mpi_p2p import take_user, with_header


@functools.cache  # the module, once: a function-level import costs ~1 us a call
def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "the MPI backend needs mpi4py and an MPI library: pip install -e '.[mpi]'"
        ) from exc
    return MPI


class MPIComm(Comm):
    def __init__(self, world, state, ranks, name, key, mpicomm):
        super().__init__(world, state, ranks, name, key)
        self.mpi = self.ctrl = mpicomm  # one communicator; the planes differ by tag
        self.traffic = world.counts(key, name, self.ranks)
        self.tag_ub = _mpi().COMM_WORLD.Get_attr(_mpi().TAG_UB)
        self.checking = None  # the open collective's check (mpi_control.Exchange) until verified
        self.status = _mpi().Status()
        self.byte, self.any_source = _mpi().BYTE, _mpi().ANY_SOURCE  # looked up once
        self.others = {j: g for j, g in enumerate(self.ranks) if j != self.rank}  # -> world rank

    def _wait(self, done, what: str, *args) -> None:
        """Poll done() with the deadline; `what % args` says what we waited for (formatted
        only for the timeout's message: most waits end at the first poll)."""
        if done():  # the common case: already there, no closures
            return
        if self.world.unposted is not None:  # the open call's label goes out before any wait
            self._post_label()

        def ready() -> bool:  # a wait inside a collective also advances its check
            if done():
                return True
            if self.checking is not None and self.checking.progress():
                self._verified()
            return False

        report = lambda: self._hang(what % args if args else what)
        poll(ready, self.world.timeout, report, self.world.spin)

    def _hang(self, what: str) -> str:
        chk = self.checking
        if chk is not None and not chk.progress():  # the likelier cause: name who never came
            return chk.report(f"to check collective {chk.label} against the other ranks")
        return (
            f"rank {self.state.rank} waited {self.world.timeout:g} s {what} in group "
            f"{self.name!r} (a hang: some rank skipped a call, exited or is stuck). Under "
            f"MPI each rank reports its own flight recorder:\n  {self.state.flight()}"
        )

    def _tag(self, channel: int) -> int:
        return 0 if channel < 0 else 3 + channel % (self.tag_ub - 3)

    def collective(self, op: str, algorithm: str = "", array=None, extra: str = ""):
        """Comm.collective's steps without its generator (emulator.mpi_call.OpenCall)."""
        return OpenCall(self, op, algorithm, array, extra)

    # -- data plane -----------------------------------------------------------------------------
    def _post(self, array: np.ndarray, dst: int, channel: int) -> None:
        if channel < 0:  # user message: the header, then the payload, in one buffer (one copy)
            buf = with_header(array)
        else:
            buf = np.array(array, copy=True, order="C").reshape(-1).view(np.uint8)
        self.world.pending.append((self.mpi.Isend(buf, dest=dst, tag=self._tag(channel)), buf))
        self.world.prune()
        if self.world.unposted is not None:
            self._post_label()
        self.traffic.sent_n[dst] += 1
        self.traffic.sent_b[dst] += array.nbytes

    def _take(self, src: int, out, shape, dtype, channel: int) -> np.ndarray:
        if channel < 0:
            got = take_user(self, src, shape, dtype)
            if out is not None:
                out[...] = got
                got = out
        else:
            req, got = self._irecv(src, out, shape, dtype, channel)
            self._complete(req, src, got)
        self.traffic.recv_n[src] += 1
        self.traffic.recv_b[src] += got.nbytes
        return got

    def recv(self, src: int, out=None, shape=None, dtype=None):
        call = self.state.current
        if call is None or type(out) is not np.ndarray or not out.flags.c_contiguous:
            return super().recv(src, out=out, shape=shape, dtype=dtype)  # every other case
        # A collective's receive into its own buffer (every receive of the algorithms): the
        # same checks, request, size check and records as Comm.recv -> _take, in one frame.
        if type(src) is not int or not 0 <= src < self.world_size or src == self.rank:
            self._peer(src, "receive from")
        req = self.mpi.Irecv([out, self.byte], src, 3 + call.seq % (self.tag_ub - 3))
        self._complete(req, src, out)
        t = self.traffic
        t.recv_n[src] += 1
        t.recv_b[src] += out.nbytes
        self._record("recv", src, out.nbytes)
        return out

    def _irecv(self, src: int, out, shape, dtype, channel: int):
        if out is None:
            out = np.empty(shape, dtype)
        # [buffer, MPI.BYTE]: any contiguous dtype (bfloat16 included) as its raw bytes
        return self.mpi.Irecv([out, self.byte], src, self._tag(channel)), out

    def _complete(self, req, src: int, out, send_req=None, dst: int = -1) -> None:
        """Wait for a posted receive (and our send to dst); check the message's size."""
        status = self.status
        try:
            if not req.Test(status):  # the common case is here at once: no closure
                self._wait(lambda: req.Test(status), "to receive from rank %d", self.ranks[src])
        except _mpi().Exception as exc:  # a larger message than expected: MPI_ERR_TRUNCATE
            raise self._size_error(src, out, f"more than {out.nbytes}") from exc
        if status.Get_count(self.byte) != out.nbytes:
            raise self._size_error(src, out, str(status.Get_count(self.byte)))
        if send_req is not None and not send_req.Test():
            self._wait(send_req.Test, "for rank %d to take our message", self.ranks[dst])

    def _size_error(self, src: int, out, got: str) -> CommError:
        return CommError(
            f"rank {self.state.rank} expected {out.dtype}{list(out.shape)} ({out.nbytes} bytes) "
            f"from rank {self.ranks[src]} in group {self.name!r} but the message has {got} "
            f"bytes; sender and receiver disagree about the message"
        )

    def sendrecv(self, array, dst: int, src: int, out=None, shape=None, dtype=None, give=False):
        # (`give` changes nothing here: a collective's sendrecv never copies what it sends)
        call = self.state.current
        if call is None:  # user traffic: headers, through send and recv
            return super().sendrecv(array, dst, src, out=out, shape=shape, dtype=dtype)
        # Post the receive first (the data lands in place), then send without an eager copy:
        # the send buffer is untouched until both halves complete here. The argument checks'
        # common cases are one line each (a ring step is a sendrecv); else the full checks.
        if type(array) is not np.ndarray or array.dtype not in _SENDABLE:
            array = self._as_message(array, "sendrecv")
        size, me = self.world_size, self.rank
        if type(dst) is not int or not 0 <= dst < size or dst == me:
            self._peer(dst, "send to")
        if type(src) is not int or not 0 <= src < size or src == me:
            self._peer(src, "receive from")
        if type(out) is not np.ndarray or not out.flags.c_contiguous:
            out, shape, dtype = _expected(out, shape, dtype)
            if out is None:
                out = np.empty(shape, dtype)
        tag, byte = 3 + call.seq % (self.tag_ub - 3), self.byte  # = self._tag(call.seq)
        rreq = self.mpi.Irecv([out, byte], src, tag)
        sreq = self.mpi.Isend([np.ascontiguousarray(array), byte], dst, tag)
        if self.world.unposted is not None:  # the data first, then the call's label
            self._post_label()
        t = self.traffic
        t.sent_n[dst] += 1
        t.sent_b[dst] += array.nbytes
        self._record("send", dst, array.nbytes)
        self._complete(rreq, src, out, sreq, dst)
        t.recv_n[src] += 1
        t.recv_b[src] += out.nbytes
        self._record("recv", src, out.nbytes)
        return out

    def send_lent(self, array, dst: int) -> None:
        """`send` without the eager copy: the collective that calls it leaves `array` unwritten
        until it ends, and its end waits for the send (same bytes, same records)."""
        if type(array) is not np.ndarray or array.dtype not in _SENDABLE:
            array = self._as_message(array, "send")
        if type(dst) is not int or not 0 <= dst < self.world_size or dst == self.rank:
            self._peer(dst, "send to")
        buf = np.ascontiguousarray(array)  # a view: no copy
        call = self.state.current  # the channel's tag (`_tag(_channel())`), inlined
        tag = 0 if call is None else 3 + call.seq % (self.tag_ub - 3)
        req = self.mpi.Isend([buf, self.byte], dst, tag)
        peer = self.ranks[dst]
        w = self.world
        w.lent.append((req, buf, peer))  # the world's: any group's call
        if w.unposted is not None:  # the data first, then the call's label
            self._post_label()
        t = self.traffic
        t.sent_n[dst] += 1
        t.sent_b[dst] += array.nbytes
        self._record("send", dst, array.nbytes)

    def _end_call(self, call: Call) -> None:
        # The checks of a clean end, in order: the labels (a mismatch explains everything
        # else), our sends without a copy taken, no message of this call left unreceived.
        chk = self.checking
        if chk is not None:
            if self.world.unposted is not None:  # a call that neither sent nor waited
                self._post_label()
            # (twice before waiting: the labels come after the data, and MPICH's first probe
            # may only progress the queues - as in _leftover)
            if not chk.progress() and not chk.progress():
                chk.wait(f"to check collective {chk.label} against the other ranks")
            self.checking = None  # _verified, inlined (every call)
            if chk.same != len(chk.peers):
                verify(self, chk.label, chk.got)
        lent = self.world.lent
        if lent:
            for req, _, peer in lent:
                if not req.Test():
                    self._wait(req.Test, "for rank %d to take our message", peer)
            lent.clear()
        self._leftover(call)

    def _failed_call(self, call: Call, exc: BaseException) -> None:
        self._settle(exc)

    def _leftover(self, call: Call) -> None:
        # A message of this collective that no receive took (one already here; a later one is
        # caught by the end-of-run count): an algorithm sent more than its peers receive.
        # (MPICH's first Iprobe may only progress the queues; the second sees what arrived.)
        status, tag, probe = self.status, 3 + call.seq % (self.tag_ub - 3), self.mpi.Iprobe
        if probe(self.any_source, tag, status) or probe(self.any_source, tag, status):
            raise CommError(
                f"rank {self.ranks[status.Get_source()]} sent rank {self.state.rank} a message "
                f"of {status.Get_count(self.byte)} bytes in {call.describe()} that no receive "
                f"took: a stray send in the collective"
            )

    # -- control plane ----------------------------------------------------------------------------
    # The collective check: every rank sends its call's label to every other rank (right after
    # the call's first data send, or before it first blocks) and goes on with the data plane; the labels are compared as soon as they are
    # in (the data plane's waits advance them) and at the latest at the call's end, before it
    # returns. A mismatch is thus named on every rank, as before, without a round trip of its
    # own: a differing call that makes the data plane fail first (a message of another size)
    # or wait (one that never comes) is reported as the mismatch it is (`_settle`, `_hang`).
    def _check(self, call: Call) -> None:
        if self.world.check and self.world_size > 1:
            # Not yet posted (post=False): `_post_label` posts it after the call's first data
            # send or before its first wait; the waits and the call's end receive the others'.
            chk = Exchange(self, self.ctrl, self.others, label(call), b"", CTRL_TAG, False)
            self.checking = self.world.unposted = chk

    def _post_label(self) -> None:
        # Posted lazily (the data plane's first send goes out first, the label right after;
        # any wait posts it before it blocks), so a mismatch that stalls the data plane is
        # still named on every rank: no rank blocks before its label is out.
        chk, self.world.unposted = self.world.unposted, None
        chk.post()

    def _verified(self) -> None:
        chk, self.checking = self.checking, None
        if chk.same != len(chk.peers):  # some label differs from ours: name it
            verify(self, chk.label, chk.got)

    def _verify_check(self, timeout: float | None = None) -> None:
        if self.world.unposted is not None:
            self._post_label()
        chk = self.checking
        if chk is not None:
            chk.wait(f"to check collective {chk.label} against the other ranks", timeout)
            self._verified()

    def _settle(self, exc: BaseException) -> None:
        """The body of a checked collective failed: if the other ranks' labels (most often
        already here) show a different call, that mismatch is the error; else `exc` stands."""
        w = self.world
        if w.unposted is not None:  # our label goes out whatever failed: the others wait for it
            self._post_label()
        w.pending.extend((req, buf) for req, buf, _ in w.lent)  # buffers alive until sent
        w.lent.clear()
        if self.checking is None or isinstance(exc, CollectiveMismatch):
            self.checking = None
            return
        try:
            self._verify_check(timeout=min(self.world.timeout, 2.0))
        except CollectiveMismatch as mismatch:
            raise mismatch from exc
        except CommError:  # the labels never came: the original error says more
            pass
        finally:
            self.checking = None

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        if self.world.unposted is not None:  # inside a collective: its label before we block
            self._post_label()
        return make_group(self, glob, name, key)

    def allgather_object(self, obj) -> list:
        self._verify_check()  # called inside a collective: its check's labels come first
        every = gather(self, OBJECTS, pickle.dumps(obj), "in a control-plane gather")
        return [pickle.loads(b) for b in every]


def world_comm(timeout: float, check: bool = True) -> MPIComm:
    """This process's world communicator (MPI must have been launched with mpiexec)."""
    if not timeout > 0:  # nan and non-numbers included: the same rule as `spawn`
        raise ValueError(f"world_comm: timeout must be positive seconds, got {timeout!r}")
    MPI = _mpi()
    w = MPIWorld(timeout, check)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    state = RankState(rank=rank, ledger=Ledger(rank))
    _bind_state(state)
    return MPIComm(w, state, tuple(range(size)), "world", ("world",), MPI.COMM_WORLD.Dup())
