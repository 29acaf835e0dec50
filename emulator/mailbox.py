"""One virtual rank's incoming messages: a lock, a condition, and FIFO queues per channel.

    box[(group key, channel)][sender global rank] -> deque of arrays (oldest first)

The channel is -1 for user point-to-point traffic and the collective's sequence number in its
group otherwise (`Comm._channel`), so a receive only ever matches messages of its own channel.
Empty queues and channels are deleted at once: the box holds only messages in flight, so a
leftover is exactly a non-empty entry. `closed[group key]` counts the collectives this rank has
finished in the group: a message sent into a closed channel would never be received.

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
        key, src = comm.key, comm.state.rank
        with self.lock:
            if channel < 0 or self.closed.get(key, 0) <= channel:
                sub = self.box.get((key, channel))
                if sub is None:
                    self.box[(key, channel)] = {src: deque((msg,))}
                else:
                    q = sub.get(src)
                    if q is None:
                        sub[src] = deque((msg,))
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
        kc = (comm.key, channel)
        with self.lock:
            msg = self._pop(kc, src)
            if msg is None:
                msg = self._await(kc, src)
        if msg is not None:
            return msg
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

    def _pop(self, kc, src):
        sub = self.box.get(kc)
        if sub is None:
            return None
        q = sub.get(src)
        if q is None:
            return None
        msg = q.popleft()
        if not q:
            del sub[src]
            if not sub:
                del self.box[kc]
        return msg

    # -- waiting ------------------------------------------------------------------------------
    def _await(self, kc, src):
        """`_wait` for one message, inlined (the receive path): the message, or None."""
        w = self.world
        st = w.states[self.rank]
        deadline = time.monotonic() + w.timeout
        st.waiting = True
        try:
            while w.failure is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    deadline, left = _extend(w, deadline)
                    if left <= 0:
                        return None
                self.sleeping = True
                self.cond.wait(min(left, MAX_SLEEP))
                self.sleeping = False
                if w.failure is None:
                    msg = self._pop(kc, src)
                    if msg is not None:
                        return msg
            return None
        finally:
            st.waiting = self.sleeping = False

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
    def close(self, key, seq: int):
        """This rank finished collective `seq` of group `key`: close its channel and return
        whatever is still queued on it ({sender: deque}, or None)."""
        with self.lock:
            self.closed[key] = seq + 1
            return self.box.pop((key, seq), None)

    def pending(self) -> list:
        with self.lock:
            return list(self.box.items())


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
    key, channel = kc
    name = world.names.get(key, repr(key))
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
