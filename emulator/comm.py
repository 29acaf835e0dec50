"""The communicator: one point-to-point primitive that every byte between ranks passes through.

A `Comm` is a group of ranks, numbered 0..R-1 inside the group, on top of a backend world
(virtual ranks in one process, `emulator.local`; or MPI processes, `emulator.mpi`). It offers
exactly three data-moving calls - `send`, `recv`, `sendrecv` - and records every message in the
rank's byte ledger. Collectives (package `collectives`) are built only on these calls.

Semantics, identical on both backends:
- `send` is eager: it never blocks and the receiver gets a copy, so a later write by the sender
  is never seen by the receiver.
- Messages between a pair of ranks in one group arrive in the order they were sent (FIFO).
- `recv` needs the expected shape and dtype (an `out` buffer, or `shape=` and `dtype=`), as MPI
  does; a message of another shape or dtype is an error, not a silent reinterpretation.
- Every blocking wait has a timeout; on expiry the error names the waiting rank, its peer, and
  every rank's last completed and current collective (the flight recorder).
- Each message travels on a channel: -1 for user point-to-point traffic, else the sequence
  number of the collective it belongs to. A receive matches only its own channel, so a stray
  user send is never consumed by a collective, nor one collective's message by the next.

Control-plane calls (`gather_object`, `allgather_object`) move Python objects for reports and
checks. They are deliberately not counted: they are the emulator's instrumentation, not the
training job's traffic.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .ledger import Ledger, Record, Unfrozen
from .memory import MemoryLedger
from .message import _SENDABLE, _dtype_name, _expected, as_message, check_peer
from .rank import (  # noqa: F401 - re-exported: the backends and users import them from here
    Call,
    CollectiveMismatch,
    CommError,
    CommTimeout,
    PeerExited,
    RankAborted,
    RankState,
    UnreceivedMessage,
    _bind_state,
    current_state,
    mismatch_message,
    scope,
)


class Comm:
    """A group of ranks on one backend world. Subclasses implement `_post`, `_take`, `_check`."""

    def __init__(self, world, state: RankState, ranks: tuple, name: str, key):
        self.world = world
        self.state = state
        self.ranks = tuple(ranks)  # global rank of each group rank
        self.name = name
        self.key = key  # identical on every member; isolates this group's messages
        self.rank = self.ranks.index(state.rank)
        self.world_size = len(self.ranks)

    # -- identity ---------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return self.world_size

    @property
    def global_rank(self) -> int:
        return self.state.rank

    @property
    def ledger(self) -> Ledger:
        return self.state.ledger

    @property
    def memory(self) -> MemoryLedger:
        return self.state.memory

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} rank {self.rank}/{self.world_size}>"

    # -- point to point ---------------------------------------------------------------------
    def send(self, array, dst: int) -> None:
        """Eager send of `array` to group rank `dst`; the receiver gets a copy."""
        # the common cases in one line each (every message passes here); else the full checks
        if type(array) is not np.ndarray or array.dtype not in _SENDABLE:
            array = self._as_message(array, "send")
        if type(dst) is not int or not 0 <= dst < self.world_size or dst == self.rank:
            self._peer(dst, "send to")
        call = self.state.current  # the channel (`_channel`), inlined
        self._post(array, dst, -1 if call is None else call.seq)
        self._record("send", dst, array.nbytes)

    def send_lent(self, array, dst: int) -> None:
        """`send` for a collective that leaves `array` unwritten until it ends: a backend may
        skip the eager copy (MPI does, and waits for the send at the collective's end)."""
        self.send(array, dst)

    def recv(self, src: int, out=None, shape=None, dtype=None):
        """Receive the next message from group rank `src`; returns it (in `out` if given)."""
        if type(src) is not int or not 0 <= src < self.world_size or src == self.rank:
            self._peer(src, "receive from")
        out, shape, dtype = _expected(out, shape, dtype)
        call = self.state.current
        got = self._take(src, out, shape, dtype, -1 if call is None else call.seq)
        self._record("recv", src, got.nbytes)
        return got

    def sendrecv(self, array, dst: int, src: int, out=None, shape=None, dtype=None, give=False):
        """Send to `dst` and receive from `src` (the building block of rings). `give=True`: the
        caller gives `array` away (it never reads or writes it again, and nothing else holds
        it), so a backend that hands messages over (`hands_over`) may skip the eager copy."""
        self.send(array, dst)
        return self.recv(src, out=out, shape=shape, dtype=dtype)

    # True on a backend where a receive without `out` returns the sent copy itself (no copy)
    # and sendrecv(give=True) passes the array on as it is: virtual ranks (collectives.ring).
    hands_over = False

    def _channel(self) -> int:
        """-1 for user point-to-point traffic, else the open collective's sequence number in
        this group: user messages and collective messages never match each other, nor do two
        different collectives' messages."""
        call = self.state.current
        return -1 if call is None else call.seq

    # -- collectives' bookkeeping -------------------------------------------------------------
    @contextlib.contextmanager
    def collective(self, op: str, algorithm: str = "", array=None, extra: str = ""):
        """Mark a collective call: ledger labels, flight recorder and cross-rank check.

        Only the outermost call counts: an all-reduce that runs a reduce-scatter and an
        all-gather inside it is recorded (and checked) once, as an all-reduce.
        """
        st = self.state
        if st.depth:
            st.depth += 1
            try:
                yield
            finally:
                st.depth -= 1
            return
        seq = st.seqs.get(self.key, 0)
        st.seqs[self.key] = seq + 1
        a = None if array is None else np.asarray(array)
        call = Call(
            seq=seq,
            op=op,
            algorithm=algorithm,
            group=self.name,
            shape=() if a is None else tuple(a.shape),
            dtype="-" if a is None else _dtype_name(a.dtype),
            extra=extra,
        )
        st.calls.append(call)
        st.current = call
        st.label = (op, algorithm, seq)
        st.depth = 1
        st.progress += 1
        try:
            self._check(call)
            try:
                yield
            except BaseException as exc:
                self._failed_call(call, exc)  # a backend may name a better cause, else re-raised
                raise
            self._end_call(call)  # only after a clean exit: a failing body is reported as is
        finally:
            st.depth = 0
            st.current = None
            st.label = P2P

    # -- groups -----------------------------------------------------------------------------
    def group(self, ranks, name: str | None = None) -> Comm:
        """A sub-communicator over `ranks` (this group's numbering), called by its members only.

        Every member must call it with the same ranks in the same order; the new group numbers
        them 0..len(ranks)-1 in that order.
        """
        ranks = [int(r) for r in ranks]
        if not ranks:
            raise ValueError("group(ranks): ranks is empty; give at least one rank")
        bad = [r for r in ranks if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(
                f"group(ranks): rank(s) {bad} out of range for {self.name!r} of size "
                f"{self.world_size}; use ranks in 0..{self.world_size - 1}"
            )
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"group(ranks): duplicate ranks in {ranks}; list each rank once")
        if self.rank not in ranks:
            raise ValueError(
                f"group(ranks): rank {self.rank} of {self.name!r} is not in {ranks}; only "
                f"members create a group (see Mesh, which creates every rank's groups)"
            )
        glob = tuple(self.ranks[r] for r in ranks)
        name = name or f"{self.name}{list(ranks)}"
        n = self.state.group_counts.get((name, glob), 0)
        self.state.group_counts[(name, glob)] = n + 1
        return self._make_group(glob, name, (self.key, name, glob, n))

    # -- helpers ----------------------------------------------------------------------------
    def _record(self, direction: str, peer: int, nbytes: int) -> None:
        st = self.state
        st.progress += 1
        ledger = st.ledger
        key = (
            st.label,  # (op, algorithm, seq): set with `current` (collective)
            self.name,
            self.ranks[peer],
            direction,
            nbytes,
            ledger.step,
            "/".join(st.tags) if st.tags else "",
        )
        # Records are frozen values: equal ones are shared (a ring's p-1 steps repeat one); the
        # cache is small and per rank. A new one (every call's first of its kind: it holds the
        # call's number) is filled as an `Unfrozen` and becomes a Record (ledger.py).
        cache = st.record_cache
        rec = cache.get(key)
        if rec is None:  # built here, not in a helper: bench layouts --costs counts _record's
            (op, algo, seq), group, glob, _, _, step, tag = key
            if len(cache) >= 256:
                cache.clear()
            rec = _new(Unfrozen)  # = Record(op, algo, ...) without its 9 object.__setattr__
            rec.op = op
            rec.algorithm = algo
            rec.group = group
            rec.peer = glob
            rec.direction = direction
            rec.nbytes = int(nbytes)
            rec.step = step
            rec.tag = tag
            rec.seq = seq
            rec.__class__ = Record
            cache[key] = rec
        ledger.records.append(rec)  # Ledger.add, without its Python call (every message)

    # the full checks behind the one-line ones (emulator/message.py)
    _peer = check_peer
    _as_message = staticmethod(as_message)

    # -- control plane (not counted) ----------------------------------------------------------
    def gather_object(self, obj, root: int = 0):
        """Every rank's `obj` as a list on `root` (None elsewhere). Uncounted instrumentation."""
        objs = self.allgather_object(obj)
        return objs if self.rank == root else None

    def allgather_object(self, obj) -> list:
        raise NotImplementedError

    def barrier(self) -> None:
        """A control-plane barrier (uncounted). `collectives.barrier` is the counted one."""
        self.allgather_object(None)

    # backend hooks
    def _post(self, array: np.ndarray, dst: int, channel: int) -> None:
        raise NotImplementedError

    def _take(self, src: int, out, shape, dtype, channel: int) -> np.ndarray:
        raise NotImplementedError

    def _check(self, call: Call) -> None:
        raise NotImplementedError

    def _end_call(self, call: Call) -> None:
        """The outermost collective `call` returned on this rank: a backend that can see
        messages of its channel still waiting here raises `UnreceivedMessage`."""

    def _failed_call(self, call: Call, exc: BaseException) -> None:
        """The outermost collective `call`'s body raised `exc` on this rank: a backend may
        raise the error it explains instead (MPI: a collective mismatch its check shows)."""

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        raise NotImplementedError


_new = object.__new__
P2P = ("p2p", "", -1)  # the ledger label (op, algorithm, seq) outside any collective
