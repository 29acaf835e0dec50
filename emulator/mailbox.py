"""One virtual rank's incoming messages: a lock, a bell to sleep on, and FIFO queues per channel.

    box[(group id, channel, sender global rank)] -> deque of arrays (oldest first)
    p2p[(group id, -1, sender global rank)] -> deque: point-to-point lanes (channel -1)

The group id is a small int the world gives each group key (`VirtualWorld.gid`: hashing the
nested key tuple on every message cost more than the rest of the lookup). The channel is -1 for
user point-to-point traffic and the collective's sequence number in its group otherwise
(`Comm._channel`), so a receive only ever matches messages of its own channel. A collective's
emptied queues stay until this rank ends a collective (`close` removes them, and the finished
collective's queues), so between collectives `box` holds only messages in flight. `closed[group id]` counts
the collectives this rank has finished in the group: a message sent into a closed channel would
never be received. Point-to-point lanes are made once per (group, sender) and stay (possibly
empty): both ends keep a reference (`VirtualComm`), so a message costs no key and no lookup.

Who touches what (the GIL makes each deque or dict operation atomic): only the owner pops,
and only the owner removes queues (`close`), so the owner reads and pops without the lock.
A collective's sender appends under the lock (its closed-channel check and the append are one
step against `close`); a point-to-point sender appends without it (that channel never closes).
Only the owning rank sleeps, so the mailbox needs no Condition (whose wait and notify are
Python, ~130 bytecodes and a new lock per sleep): the owner sleeps by acquiring `bell`, a lock
held while nobody has rung, and a sender wakes it by releasing the bell. A sender rings only
while the owner may sleep (`sleeping`): the owner sets it under the lock before its last look
at the queue, so a sender that appends after that look sees the flag and takes the lock to
ring. Every ring happens under the lock and only if the bell is held (only the owner takes
it, outside the lock, so a held bell stays held until that release); a ring that comes before
the owner's acquire lets the acquire through at once, and one the owner did not need (a wake
while it was awake) costs its next sleep one more look at the queue. The ringer clears the
flag under the lock: the owner is woken, and sets it again before its next look, so the
senders that append until then skip a ring (while a woken owner waits for the GIL, a ring's
later messages found it still flagged: 5,600 notifies for 2,187 sleeps in 500 4-rank
all-gathers).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .rank import CommTimeout, PeerExited, UnreceivedMessage

MAX_SLEEP = 3600.0  # one wait's longest sleep (Condition.wait rejects an infinite timeout)


class Mailbox:
    __slots__ = ("bell", "box", "closed", "lock", "p2p", "rank", "sleeping", "world")

    def __init__(self, world, rank: int):
        self.world = world
        self.rank = rank
        self.lock = threading.Lock()
        self.bell = threading.Lock()  # held until rung: the owner sleeps in bell.acquire
        self.bell.acquire()
        self.sleeping = False  # the owner may be asleep: a sender rings
        self.box: dict = {}
        self.p2p: dict = {}
        self.closed: dict = {}

    def wake(self) -> None:
        with self.lock:
            if self.bell.locked():
                self.bell.release()

    def notify(self) -> None:
        """A lock-free sender appended while the owner may sleep: wake it."""
        with self.lock:
            self.sleeping = False  # woken: later senders need not ring (see the docstring)
            if self.bell.locked():
                self.bell.release()

    # -- the message path ---------------------------------------------------------------------
    def lane(self, key) -> deque:
        """The point-to-point queue of key (group id, -1, sender), made on first use."""
        q = self.p2p.get(key)
        if q is None:
            with self.lock:  # sender and owner may both make it first: one queue either way
                q = self.p2p.get(key)
                if q is None:
                    q = self.p2p[key] = deque()
        return q

    def put(self, comm, channel: int, msg) -> None:
        """Append `msg` from `comm`'s rank on (comm's group, channel)."""
        gid, src = comm.gid, comm.state.rank
        if channel < 0:
            self.lane((gid, -1, src)).append(msg)
            if self.sleeping:
                self.notify()
            return
        with self.lock:
            if self.closed.get(gid, 0) <= channel:
                q = self.box.get((gid, channel, src))
                if q is None:
                    self.box[(gid, channel, src)] = deque((msg,))
                else:
                    q.append(msg)
                if self.sleeping:
                    self.sleeping = False
                    if self.bell.locked():
                        self.bell.release()
                return
        call = comm.state.current
        self.world.fail(
            src,
            lambda: UnreceivedMessage(
                f"rank {src} sent rank {self.rank} {msg.nbytes} bytes ({msg.dtype}"
                f"{list(msg.shape)}) in group {comm.name!r} for {call.describe()} after rank "
                f"{self.rank} had finished that collective: it would never be received (the "
                f"collective's sends and receives do not pair up)"
            ),
        )

    def get(self, comm, channel: int, src: int):
        """The oldest message from global rank `src` on (comm's group, channel); waits for it."""
        if channel < 0:
            q = self.lane((comm.gid, -1, src))
            if q:
                return q.popleft()
            with self.lock:
                why = self._wait(q.__len__, src)
            if why is None:
                return q.popleft()
        else:
            k, box = (comm.gid, channel, src), self.box
            q = box.get(k)
            if q:
                return q.popleft()
            with self.lock:  # the sender may make the queue meanwhile
                why = self._wait(lambda: box.get(k), src)
            if why is None:
                return box[k].popleft()
        if why == src:
            self.peer_exited(comm, channel, src)
        self.timed_out(comm, src)

    def timed_out(self, comm, src: int) -> None:
        """A receive from global rank `src` in comm's group waited out the deadline."""
        w = self.world
        w.raise_if_failed()
        w.fail(
            self.rank,
            lambda: CommTimeout(
                f"rank {self.rank} waited {w.timeout:g} s to receive from rank {src} in group "
                f"{comm.name!r} and nothing arrived (a hang: some rank skipped a send or is "
                f"stuck).\nflight recorder:\n{w.flight_recorder()}"
            ),
        )

    def peer_exited(self, comm, channel: int, src: int) -> None:
        """A receive from global rank `src` can never complete: src's program has returned."""
        w = self.world
        w.raise_if_failed()
        call = comm.state.current
        inside = "" if channel < 0 or call is None else f", in {call.describe()},"
        w.fail(
            self.rank,
            lambda: PeerExited(
                f"rank {self.rank}{inside} waits to receive from rank {src} in group "
                f"{comm.name!r}, but rank {src}'s program has returned with nothing more sent "
                f"to it: the receive can never complete (a hang, found before the "
                f"{w.timeout:g} s timeout: a skipped send, or a rank that ran fewer steps or "
                f"returned early).\nflight recorder:\n{w.flight_recorder()}"
            ),
        )

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self, ready, src: int = -1) -> int | None:
        """With `lock` held: sleep until `ready()` (-> None), the world's failure or the deadline
        (-> -1), or - for a receive from global rank `src` - until src's program has returned
        with nothing ready (-> src: nothing more can come).

        No periodic wake-ups: a sender's notify, the world's abort, src's return
        (`VirtualWorld.rank_done` wakes the ranks in `waiters[src]`) or the deadline ends the
        sleep (4,096 ranks each waking once a second starved the ranks doing the work).
        """
        w = self.world
        st = w.states[self.rank]
        deadline = time.monotonic() + w.timeout
        st.waiting = True
        if src >= 0:  # before the first look at `exited`: rank_done reads the set after
            w.waiters[src].add(self.rank)  # setting it, so one of the two sees the other
        try:
            while True:
                self.sleeping = True  # before the look at `ready`: see the module docstring
                if w.failure is not None:
                    return -1
                if ready():
                    return None
                if src >= 0 and w.exited[src]:  # its sends were all queued before it returned
                    return None if ready() else src
                left = deadline - time.monotonic()
                if left <= 0:
                    deadline, left = _extend(w, deadline)
                    if left <= 0:
                        return -1
                lock = self.lock
                lock.release()  # asleep without the lock, as Condition.wait would be
                try:
                    self.bell.acquire(True, min(left, MAX_SLEEP))
                finally:
                    lock.acquire()
        finally:
            st.waiting = self.sleeping = False
            if src >= 0:
                w.waiters[src].discard(self.rank)

    def wait_for(self, ready, describe) -> None:
        """Wait until `ready()`; on the deadline fail the world with `describe()` + recorder."""
        with self.lock:
            why = self._wait(ready)
        if why is None:
            return
        w = self.world
        w.raise_if_failed()
        w.fail(
            self.rank,
            lambda: CommTimeout(f"{describe()}\nflight recorder:\n{w.flight_recorder()}"),
        )

    # -- ends of collectives and runs -----------------------------------------------------------
    def close(self, gid: int, seq: int):
        """This rank finished collective `seq` of group `gid`: close its channel, remove its
        queues and return whatever is still queued on it ({sender: deque}, or None)."""
        with self.lock:
            self.closed[gid] = seq + 1
            box = self.box
            if not box:  # the common case: nothing in flight to this rank at all
                return None
            left = {}
            for k in list(box):  # the owner's own step: no lock-free pop runs meanwhile
                q = box[k]
                if k[0] == gid and k[1] == seq:
                    del box[k]
                    if q:
                        left[k[2]] = q
                elif not q:  # an emptied queue of any collective (a nested group's too)
                    del box[k]
            return left or None

    def pending(self) -> list:
        """What is still queued, as [((group id, channel), {sender: deque})]."""
        with self.lock:
            out: dict = {}
            for table in (self.box, self.p2p):
                for (gid, channel, src), q in table.items():
                    if q:
                        out.setdefault((gid, channel), {})[src] = q
            return list(out.items())


def _extend(world, deadline: float) -> tuple:
    """An expired deadline, unless the world is still starting: (deadline, seconds left).

    No deadline expires before every rank's thread runs (`world.started_at`): starting 1,024
    threads takes 0.3-1 s, and a 1 s wait must not expire while its peer's thread is created.
    Ranks still start in order as their threads do, so the first ranks run first.
    """
    now = time.monotonic()
    start = world.started_at
    if start is None:
        return now + 0.05, 0.05  # still starting: look again shortly (start-up only)
    if start + world.timeout > now:
        return start + world.timeout, start + world.timeout - now
    return deadline, 0.0


def leftover_report(world, receiver: int, kc, sub) -> str:
    """One line per unreceived message: sender, receiver, group, channel, bytes, dtype, shape."""
    gid, channel = kc
    name = world.names.get(gid, f"group #{gid}")
    lines = []
    for src, q in sub.items():
        what = "point-to-point" if channel < 0 else _collective(world.states[src], name, channel)
        for m in q:
            lines.append(
                f"  rank {src} -> rank {receiver} in group {name!r}, {what}: {m.nbytes} bytes "
                f"({m.dtype}{list(m.shape)})"
            )
    return "\n".join(lines)


def _collective(state, group: str, seq: int) -> str:
    for call in reversed(state.calls):
        if call.seq == seq and call.group == group:
            return call.describe()
    return f"collective #{seq}"
