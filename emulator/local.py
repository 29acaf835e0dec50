"""Virtual ranks: P threads in one process, talking through mailboxes.

`spawn(fn, world_size)` runs `fn(comm, *args, **kwargs)` once per rank, each on its own thread
with its own `Comm`, and returns the list of the ranks' return values. A send copies the array
into the receiver's mailbox (keyed by group, channel and sender, FIFO), so no rank ever sees
another rank's memory. NumPy releases the GIL in large array operations, so big messages move
at memory speed; small ones are dominated by Python overhead.

Failure handling: the first exception on any rank aborts the world - one world-level failure
slot (emulator/world.py, the world's shared state), then every rank blocked in a receive or
about to communicate raises `RankAborted` - and `spawn` re-raises the original exception,
annotated with its rank. A receive that waits longer than `timeout` seconds raises
`CommTimeout` with every rank's flight recorder. A message left unreceived at the end of a
collective or of the run raises `UnreceivedMessage`. `spawn` itself never waits without a
deadline (`emulator.watchdog`): ranks stuck in user code are reported, and Ctrl-C stops the
run.

Locking (deadlock-free by construction): each rank's mailbox has one lock, taken only by the
owner and by senders to it, never while holding another lock. The world lock guards the
failure slot and the cross-rank tables and is never taken while holding a mailbox lock.
A blocked rank sleeps until notified or until its deadline - no periodic wake-ups: at 4,096
ranks, one wake-up per rank per second kept the GIL busy enough that a barrier took 78 s.
"""

from __future__ import annotations

import threading

import numpy as np

from . import blas, watchdog
from .comm import (
    Call,
    Comm,
    CommError,
    RankAborted,
    UnreceivedMessage,
    _bind_state,
)
from .mailbox import leftover_report
from .message import _EXPECTED, _SENDABLE, _expected
from .mpi_call import OpenCall
from .world import VirtualWorld, check_call, gather_objects

DEFAULT_TIMEOUT = 60.0


class VirtualComm(Comm):
    def __init__(self, world, state, ranks: tuple, name: str, key):
        super().__init__(world, state, ranks, name, key)
        self.gid = world.gid(key, name)
        self._out: dict = {}  # group rank -> (its Mailbox, our lane in it): point-to-point
        self._in: dict = {}  # group rank -> its lane in our Mailbox

    def collective(self, op: str, algorithm: str = "", array=None, extra: str = ""):
        """Comm.collective's steps without its generator (emulator.mpi_call.OpenCall, as on
        MPI): ~150 fewer bytecodes a call, and a tp4 SP step makes ~50 calls per rank."""
        return OpenCall(self, op, algorithm, array, extra)

    # -- the message path: Comm.send / Comm.recv with the backend hooks inlined --------------
    # Same checks, same copies, same records, same errors: the uncommon cases (another array
    # type or dtype, a peer given as np.integer or out of range) take Comm's own path. A
    # point-to-point message goes straight into the queue both ends keep (`Mailbox.lane`): no
    # key, no lookup, no lock unless the receiver sleeps (bench messages).
    def send(self, array, dst: int) -> None:
        if type(array) is not np.ndarray or array.dtype not in _SENDABLE or type(dst) is not int:
            return Comm.send(self, array, dst)
        st = self.state
        call = st.current
        if call is None:
            lane = self._out.get(dst)  # filled only for a peer that passed the checks
            if lane is None:
                return Comm.send(self, array, dst)
            w = self.world
            if w.failure is not None:
                w.raise_if_failed()
            box, q = lane
            q.append(array.copy())
            if box.sleeping:
                box.notify()
        else:
            if not 0 <= dst < self.world_size or dst == self.rank:
                return Comm.send(self, array, dst)
            w = self.world
            if w.failure is not None:
                w.raise_if_failed()
            w.boxes[self.ranks[dst]].put(self, call.seq, array.copy())
        self._record("send", dst, array.nbytes)

    def recv(self, src: int, out=None, shape=None, dtype=None):
        if type(src) is not int or not 0 <= src < self.world_size or src == self.rank:
            self._peer(src, "receive from")
        out, shape, dtype = _expected(out, shape, dtype)
        w = self.world
        if w.failure is not None:
            w.raise_if_failed()
        st = self.state
        call = st.current
        s = self.ranks[src]
        if call is None:
            q = self._in.get(src)
            if q is None:
                q = self._in[src] = w.boxes[st.rank].lane((self.gid, -1, s))
            msg = q.popleft() if q else w.boxes[st.rank].get(self, -1, s)
        else:
            msg = w.boxes[st.rank].get(self, call.seq, s)
        if msg.shape != shape or msg.dtype != dtype:  # shape: a tuple (comm._expected)
            self._mismatch(s, shape, dtype, msg)
        if out is not None:
            out[...] = msg
            msg = out
        self._record("recv", src, msg.nbytes)
        return msg

    hands_over = True  # a message is the sender's private copy: the ring passes it on

    def sendrecv(self, array, dst: int, src: int, out=None, shape=None, dtype=None, give=False):
        # A collective's step (every ring step) in one frame: send, then recv - the same
        # checks, copies, records and errors; `give` (an array its caller never touches again,
        # C-ordered: what a copy would be) goes without the copy. Anything else (user traffic,
        # another array type, a peer or receive arguments to check) is Comm.sendrecv.
        call = self.state.current
        p, me = self.world_size, self.rank
        if (
            call is None
            or type(array) is not np.ndarray
            or array.dtype not in _SENDABLE
            or type(dst) is not int
            or type(src) is not int
            or not 0 <= dst < p
            or dst == me
            or not 0 <= src < p
            or src == me
        ):
            return Comm.sendrecv(self, array, dst, src, out, shape, dtype)
        if out is not None:
            if type(out) is not np.ndarray or not out.flags.c_contiguous:
                return Comm.sendrecv(self, array, dst, src, out, shape, dtype)
            want, wdt = out.shape, out.dtype
        else:
            try:
                hit = _EXPECTED.get((shape, dtype))  # normalised by an earlier receive
            except TypeError:  # unhashable: the full checks
                hit = None
            if hit is None:
                return Comm.sendrecv(self, array, dst, src, out, shape, dtype)
            want, wdt = hit
        w = self.world
        if w.failure is not None:
            w.raise_if_failed()
        ranks, seq = self.ranks, call.seq
        msg = array if give and array.flags.c_contiguous else array.copy()
        w.boxes[ranks[dst]].put(self, seq, msg)
        self._record("send", dst, array.nbytes)
        if w.failure is not None:
            w.raise_if_failed()
        s = ranks[src]
        msg = w.boxes[self.state.rank].get(self, seq, s)
        # recv's last lines, inlined as recv inlines them (a shared method measured +2.9%
        # instructions per streamed message, callgrind): change both together
        if msg.shape != want or msg.dtype != wdt:  # want: a tuple (comm._expected)
            self._mismatch(s, want, wdt, msg)
        if out is not None:
            out[...] = msg
            msg = out
        self._record("recv", src, msg.nbytes)
        return msg

    def _mismatch(self, s: int, shape, dtype, msg) -> None:
        me = self.state.rank
        self.world.fail(
            me,
            lambda: CommError(
                f"rank {me} expected {dtype}{list(shape)} from rank {s} in group "
                f"{self.name!r} but received {msg.dtype}{list(msg.shape)}; sender and "
                f"receiver disagree about the message (check both sides' sizes)"
            ),
        )

    def _post(self, array: np.ndarray, dst: int, channel: int) -> None:
        w = self.world
        if w.failure is not None:
            w.raise_if_failed()
        # the receiver owns a private C-ordered copy (a plain ndarray, as np.array would give)
        msg = array.copy() if type(array) is np.ndarray else np.array(array, copy=True, order="C")
        box = w.boxes[self.ranks[dst]]
        box.put(self, channel, msg)
        if channel < 0 and type(dst) is int:  # a checked peer: send's fast path from now on
            self._out[dst] = (box, box.lane((self.gid, -1, self.state.rank)))

    def _take(self, src: int, out, shape, dtype, channel: int) -> np.ndarray:
        w = self.world
        if w.failure is not None:
            w.raise_if_failed()
        me, s = self.state.rank, self.ranks[src]
        msg = w.boxes[me].get(self, channel, s)
        if msg.shape != shape or msg.dtype != dtype:  # shape: a tuple (comm._expected)
            self._mismatch(s, shape, dtype, msg)
        if out is None:
            return msg
        out[...] = msg
        return out

    def _end_call(self, call: Call) -> None:
        w, me = self.world, self.state.rank
        left = w.boxes[me].close(self.gid, call.seq)
        if left:
            w.fail(
                me,
                lambda: UnreceivedMessage(
                    f"rank {me} finished {call.describe()} with message(s) of that collective "
                    f"never received:\n{leftover_report(w, me, (self.gid, call.seq), left)}\n"
                    f"(the collective's sends and receives do not pair up)"
                ),
            )

    # the cross-rank call check and the control-plane gather: world.py, beside their tables
    _check = check_call
    allgather_object = gather_objects

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        return VirtualComm(self.world, self.state, glob, name, key)


def spawn(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, check: bool = True, **kw):
    """Run `fn(comm, *args, **kw)` on `world_size` virtual ranks; return their results in order.

    `timeout` bounds every blocking wait (seconds), spawn's own included: once a rank has
    returned or failed, a rank that neither communicates nor returns for `timeout` is reported
    as stuck (`CommTimeout`). `check` verifies that the ranks of a group issue identical
    collectives (op, algorithm, shape, dtype) before each one runs. The first exception raised
    on any rank is re-raised here, with a note naming the rank. Messages never received raise
    `UnreceivedMessage`. Ctrl-C (KeyboardInterrupt) stops every rank and is re-raised.
    """
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"spawn: timeout must be positive seconds, got {timeout!r}")
    w = VirtualWorld(int(world_size), timeout, check)
    ranks = tuple(range(w.size))
    results: list = [None] * w.size

    def body(r: int) -> None:
        st = w.states[r]
        _bind_state(st)
        try:
            results[r] = fn(VirtualComm(w, st, ranks, "world", ("world",)), *args, **kw)
            st.finished = True
        except RankAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - every failure must stop the world
            w.abort(r, exc)
        finally:
            _bind_state(None)
            w.rank_done(r)

    def run(r: int) -> None:
        try:
            body(r)
        except RankAborted:  # the watchdog's stop, landing after the rank's program ended
            pass

    # daemon threads: a rank stuck in a sleep or a C call cannot be killed, and must not keep
    # the process alive after spawn has reported it
    threads = [
        threading.Thread(target=run, args=(r,), name=f"rank-{r}", daemon=True) for r in ranks
    ]
    with blas.limit(blas.per_rank(w.size)):  # P ranks must not each start a full BLAS pool
        stuck = watchdog.supervise(w, threads)  # starts them; waits, never without a deadline
    if w.failure is not None:
        exc = w.failure
        if hasattr(exc, "add_note"):
            if not isinstance(exc, CommError):
                exc.add_note(f"(raised on virtual rank {w.failed_rank} of {w.size})")
            if stuck:
                exc.add_note(stuck)
        raise exc
    left = [(me, kc, sub) for me, box in enumerate(w.boxes) for kc, sub in box.pending()]
    if left:
        lines = "\n".join(leftover_report(w, me, kc, sub) for me, kc, sub in left[:20])
        more = f"\n  ... and {len(left) - 20} more" if len(left) > 20 else ""
        raise UnreceivedMessage(
            f"the run ended with message(s) sent but never received:\n{lines}{more}\n"
            f"(every send needs a matching receive; point-to-point and collective traffic never "
            f"match each other)"
        )
    return results
