"""One virtual rank's incoming messages: a lock, a condition, and FIFO queues per channel.

    box[(group id, channel, sender global rank)] -> deque of arrays (oldest first)

The group id is a small int the world gives each group key (`VirtualWorld.gid`: hashing the
nested key tuple on every message cost more than the rest of the lookup). The channel is -1 for
user point-to-point traffic and the collective's sequence number in its group otherwise
(`Comm._channel`), so a receive only ever matches messages of its own channel. Empty queues are
deleted at once: the box holds only messages in flight, so a leftover is exactly an entry, and
the end of a collective (`close`) finds an empty box in O(1). `closed[group id]` counts the
collectives this rank has finished in the group: a message sent into a closed channel would
never be received.

Only the owning rank waits on the condition, so `notify()` wakes exactly the one waiter, and
a sender notifies only while the owner sleeps (`sleeping`, read and written under the lock).
"""

from __future__ import annotations

import threading
import time
from collections import deque

from .rank import CommTimeout, UnreceivedMessage

MAX_SLEEP = 3600.0  # one wait's longest sleep (Condition.wait rejects an infinite timeout)


class Mailbox:
    __slots__ = ("box", "closed", "cond", "lock", "rank", "sleeping", "world")

    def __init__(self, world, rank: int):
        self.world = world
        self.rank = rank
        self.lock = threading.Lock()  # `with self.lock` (C) is cheaper than `with self.cond`
        self.cond = threading.Condition(self.lock)
        self.sleeping = False  # the owner is in cond.wait: only then does a sender notify
        self.box: dict = {}
        self.closed: dict = {}

    def wake(self) -> None:
        with self.lock:
            self.cond.notify_all()

    # -- the message path ---------------------------------------------------------------------
    def put(self, comm, channel: int, msg) -> None:
        """Append `msg` from `comm`'s rank on (comm's group, channel)."""
        gid, src = comm.gid, comm.state.rank
        with self.lock:
            if channel < 0 or self.closed.get(gid, 0) <= channel:
                q = self.box.get((gid, channel, src))
                if q is None:
                    self.box[(gid, channel, src)] = deque((msg,))
                else:
                    q.append(msg)
                if self.sleeping:
                    self.cond.notify()
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
        k = (comm.gid, channel, src)
        with self.lock:
            q = self.box.get(k)  # `_pop`, inlined: the common case, a message waiting
            if q is not None:
                msg = q.popleft()
                if not q:
                    del self.box[k]
                return msg
            if self._wait(lambda: k in self.box):  # empty queues are deleted: in = a message
                return self._pop(k)
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

    def _pop(self, k):
        q = self.box.get(k)
        if q is None:
            return None
        msg = q.popleft()
        if not q:
            del self.box[k]
        return msg

    # -- waiting ------------------------------------------------------------------------------
    def _wait(self, ready) -> bool:
        """With `cond` held: sleep until `ready()`, the world's failure, or the deadline.

        No periodic wake-ups: a sender's notify, the world's abort, or the deadline ends the
        sleep (4,096 ranks each waking once a second starved the ranks doing the work).
        """
        w = self.world
        st = w.states[self.rank]
        deadline = time.monotonic() + w.timeout
        st.waiting = True
        try:
            while True:
                if w.failure is not None:
                    return False
                if ready():
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    deadline, left = _extend(w, deadline)
                    if left <= 0:
                        return False
                self.sleeping = True
                self.cond.wait(min(left, MAX_SLEEP))
                self.sleeping = False
        finally:
            st.waiting = self.sleeping = False

    def wait_for(self, ready, describe) -> None:
        """Wait until `ready()`; on the deadline fail the world with `describe()` + recorder."""
        with self.lock:
            ok = self._wait(ready)
        if ok:
            return
        w = self.world
        w.raise_if_failed()
        w.fail(
            self.rank,
            lambda: CommTimeout(f"{describe()}\nflight recorder:\n{w.flight_recorder()}"),
        )

    # -- ends of collectives and runs -----------------------------------------------------------
    def close(self, gid: int, seq: int):
        """This rank finished collective `seq` of group `gid`: close its channel and return
        whatever is still queued on it ({sender: deque}, or None)."""
        with self.lock:
            self.closed[gid] = seq + 1
            if not self.box:  # the common case: nothing in flight to this rank at all
                return None
            keys = [k for k in self.box if k[0] == gid and k[1] == seq]
            return {k[2]: self.box.pop(k) for k in keys} or None

    def pending(self) -> list:
        """What is still queued, as [((group id, channel), {sender: deque})]."""
        with self.lock:
            out: dict = {}
            for (gid, channel, src), q in self.box.items():
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
