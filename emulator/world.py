"""The shared state of one virtual world (a `spawn`): its ranks' states and mailboxes, the
group ids, the cross-rank tables, and the one failure slot.

Failure handling: the first exception on any rank aborts the world - `abort` fills the failure
slot once and wakes every waiter, so every rank blocked in a receive or about to communicate
raises `RankAborted` (or, for a `CommError`, the same diagnosis) through `raise_if_failed`.
`fail` builds a report only on the first failing rank (1,024 ranks timing out together build
one flight recorder, not 1,024).

Locking: the world lock guards the failure slot, the group ids and the cross-rank tables
(`calls`, `objects`: their users `check_call` and `gather_objects` are VirtualComm's `_check`
and `allgather_object`) and is never taken while holding a mailbox lock; `done` is the
spawner's condition (emulator/local.py, emulator/watchdog.py).
"""

from __future__ import annotations

import threading

from .comm import CollectiveMismatch, CommError, RankAborted, RankState, mismatch_message
from .ledger import Ledger
from .mailbox import Mailbox


class VirtualWorld:
    def __init__(self, world_size: int, timeout: float, check: bool):
        self.size = world_size
        self.timeout = float(timeout)
        self.check = check
        self.states = [RankState(rank=r, ledger=Ledger(r)) for r in range(world_size)]
        self.boxes = [Mailbox(self, r) for r in range(world_size)]
        self.gids: dict = {("world",): 0}  # group key -> small int id (the mailboxes' keys)
        self.names: dict = {0: "world"}  # group id -> group name (for reports)
        self.lock = threading.Lock()
        self.calls: dict = {}  # (group key, seq) -> [first global rank, its Call, arrivals]
        self.objects: dict = {}  # control plane: (key, n) -> {group rank: obj}
        self.failure: BaseException | None = None
        self.failed_rank: int | None = None
        self.done = threading.Condition(threading.Lock())  # the spawner waits on it
        self.started_at: float | None = None  # when every thread ran (no deadline ends before)
        self.running = world_size
        self.exited = [False] * world_size  # the rank's thread has left the user's program
        self.waiters = [set() for _ in range(world_size)]  # rank -> ranks receiving from it

    # -- failure ----------------------------------------------------------------------------
    def abort(self, rank: int, exc: BaseException) -> bool:
        """Record the first failure and wake every waiter; True if this was the first."""
        with self.lock:
            if self.failure is not None:
                return False
            self.failure, self.failed_rank = exc, rank
        for box in self.boxes:  # one lock at a time, none held: no lock-order cycle
            box.wake()
        with self.done:
            self.done.notify_all()
        return True

    def fail(self, rank: int, make) -> None:
        """Raise the world's failure; if there is none yet, make it (`make()`) and raise it.

        Only the first failing rank builds its report (a flight recorder of every rank), so
        1,024 ranks timing out together build one report, not 1,024.
        """
        with self.lock:
            first = self.failure is None
            if first:
                self.failure, self.failed_rank = make(), rank
        if first:
            for box in self.boxes:
                box.wake()
            with self.done:
                self.done.notify_all()
            raise self.failure
        self.raise_if_failed()

    def gid(self, key, name: str) -> int:
        """The small int id of group `key` (one per key, whichever member asks first)."""
        with self.lock:
            g = self.gids.get(key)
            if g is None:
                g = self.gids[key] = len(self.gids)
                self.names[g] = name
            return g

    def raise_if_failed(self) -> None:
        exc = self.failure
        if exc is not None:
            if isinstance(exc, CommError):
                raise type(exc)(str(exc))  # every rank sees the same diagnosis
            raise RankAborted(
                f"stopped because rank {self.failed_rank} raised {type(exc).__name__}: {exc}"
            )

    def flight_recorder(self) -> str:
        return "\n".join("  " + s.flight() for s in self.states)

    def rank_done(self, rank: int) -> None:
        """`rank`'s thread has left its program: wake the spawner and every rank blocked in a
        receive from it (nothing more can come: Mailbox._wait tells them)."""
        with self.done:
            self.running -= 1
            self.exited[rank] = True
            self.done.notify_all()
        for r in list(self.waiters[rank]):
            self.boxes[r].wake()


# VirtualComm's two users of the world's cross-rank tables (`self` is the VirtualComm)
def check_call(self, call) -> None:
    """VirtualComm._check: every rank of the group must issue the same call (signature);
    the first arrival's call is the one the others are compared with."""
    w = self.world
    if w.failure is not None:
        w.raise_if_failed()
    if not w.check:
        return
    key = (self.key, call.seq)
    me = self.state.rank
    with w.lock:
        entry = w.calls.get(key)
        if entry is None:
            w.calls[key] = entry = [me, call, 0]
        entry[2] += 1
        if entry[2] == self.world_size:
            del w.calls[key]
    first_rank, first = entry[0], entry[1]
    if first is not call and first.signature() != call.signature():
        exc = CollectiveMismatch(
            mismatch_message(self.name, (first_rank, first.describe()), (me, call.describe()))
        )
        w.abort(me, exc)
        raise exc


def gather_objects(self, obj) -> list:
    """VirtualComm.allgather_object: every member's `obj`, in group order (uncounted)."""
    w, st = self.world, self.state
    n = st.seqs.get(("objects", self.key), 0)
    st.seqs[("objects", self.key)] = n + 1
    if w.failure is not None:
        w.raise_if_failed()
    with w.lock:
        objs = w.objects.setdefault((self.key, n), {})
        objs[self.rank] = obj
        complete = len(objs) == self.world_size
        if complete:  # every member holds `objs` already: the table entry can go
            del w.objects[(self.key, n)]
    st.progress += 1
    if complete:  # the last arrival wakes the others: O(p) per gather, not O(p^2)
        for g in self.ranks:
            w.boxes[g].wake()
    else:
        w.boxes[st.rank].wait_for(
            lambda: len(objs) == self.world_size,
            lambda: (
                f"rank {st.rank} waited {w.timeout:g} s in a control-plane gather of group "
                f"{self.name!r}; ranks "
                f"{sorted(set(range(self.world_size)) - set(objs))} never arrived."
            ),
        )
    return [objs[r] for r in range(self.world_size)]
