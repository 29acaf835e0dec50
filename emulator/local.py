"""Virtual ranks: P threads in one process, talking through mailboxes.

`spawn(fn, world_size)` runs `fn(comm, *args, **kwargs)` once per rank, each on its own thread
with its own `Comm`, and returns the list of the ranks' return values. A send copies the array
into the receiver's mailbox (keyed by group and sender, FIFO), so no rank ever sees another
rank's memory. NumPy releases the GIL in large array operations, so big messages move at
memory speed; small ones are dominated by Python overhead.

Failure handling: the first exception on any rank aborts the world - every rank blocked in a
receive or about to communicate raises `RankAborted` - and `spawn` re-raises the original
exception, annotated with its rank. A receive that waits longer than `timeout` seconds raises
`CommTimeout` with every rank's flight recorder.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from . import blas
from .comm import (
    Call,
    CollectiveMismatch,
    Comm,
    CommError,
    CommTimeout,
    RankAborted,
    RankState,
    _bind_state,
    mismatch_message,
)
from .ledger import Ledger

DEFAULT_TIMEOUT = 60.0


class VirtualWorld:
    def __init__(self, world_size: int, timeout: float, check: bool):
        self.size = world_size
        self.timeout = float(timeout)
        self.check = check
        self.states = [RankState(rank=r, ledger=Ledger(r)) for r in range(world_size)]
        self.inbox = [{} for _ in range(world_size)]  # (key, src) -> deque of arrays
        self.cond = [threading.Condition() for _ in range(world_size)]
        self.lock = threading.Lock()
        self.calls: dict = {}  # (group key, seq) -> [(global rank, Call), arrivals]
        self.objects: dict = {}  # control plane: (key, n) -> {rank: obj}
        self.failure: BaseException | None = None
        self.failed_rank: int | None = None

    # -- failure ----------------------------------------------------------------------------
    def abort(self, rank: int, exc: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure, self.failed_rank = exc, rank
        for c in self.cond:
            with c:
                c.notify_all()

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            exc = self.failure
            if isinstance(exc, CommError):
                raise type(exc)(str(exc))  # every rank sees the same diagnosis
            raise RankAborted(
                f"stopped because rank {self.failed_rank} raised {type(exc).__name__}: {exc}"
            )

    def flight_recorder(self) -> str:
        return "\n".join("  " + s.flight() for s in self.states)


class VirtualComm(Comm):
    def _post(self, array: np.ndarray, dst: int, channel: int) -> None:
        w = self.world
        w.raise_if_failed()
        msg = np.array(array, copy=True, order="C")  # the receiver owns a private copy
        g = self.ranks[dst]
        with w.cond[g]:
            w.inbox[g].setdefault((self.key, self.state.rank), deque()).append(msg)
            w.cond[g].notify_all()

    def _take(self, src: int, out, shape, dtype, channel: int) -> np.ndarray:
        w, me, s = self.world, self.state.rank, self.ranks[src]
        box = w.inbox[me]
        deadline = time.monotonic() + w.timeout
        with w.cond[me]:
            while True:
                w.raise_if_failed()
                q = box.get((self.key, s))
                if q:
                    msg = q.popleft()
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    exc = CommTimeout(
                        f"rank {me} waited {w.timeout:g} s to receive from rank {s} in group "
                        f"{self.name!r} and nothing arrived (a hang: some rank skipped a send "
                        f"or is stuck).\nflight recorder:\n{w.flight_recorder()}"
                    )
                    w.abort(me, exc)
                    raise exc
                w.cond[me].wait(min(left, 1.0))
        if msg.shape != tuple(shape) or msg.dtype != dtype:
            exc = CommError(
                f"rank {me} expected {dtype}{list(shape)} from rank {s} in group {self.name!r} "
                f"but received {msg.dtype}{list(msg.shape)}; sender and receiver disagree "
                f"about the message (check both sides' sizes)"
            )
            w.abort(me, exc)
            raise exc
        if out is None:
            return msg
        out[...] = msg
        return out

    def _check(self, call: Call) -> None:
        w = self.world
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
        if first.signature() != call.signature():
            exc = CollectiveMismatch(
                mismatch_message(self.name, (first_rank, first.describe()), (me, call.describe()))
            )
            w.abort(me, exc)
            raise exc

    def _make_group(self, glob: tuple, name: str, key) -> Comm:
        return VirtualComm(self.world, self.state, glob, name, key)

    def allgather_object(self, obj) -> list:
        w, st = self.world, self.state
        n = st.seqs.get(("objects", self.key), 0)
        st.seqs[("objects", self.key)] = n + 1
        key = (self.key, n)
        deadline = time.monotonic() + w.timeout
        with w.lock:
            w.objects.setdefault(key, {})[self.rank] = obj
        for c in (w.cond[g] for g in self.ranks):
            with c:
                c.notify_all()
        me = w.cond[st.rank]
        with me:
            while len(w.objects[key]) < self.world_size:
                w.raise_if_failed()
                if time.monotonic() > deadline:
                    exc = CommTimeout(
                        f"rank {st.rank} waited {w.timeout:g} s in a control-plane gather of "
                        f"group {self.name!r}; ranks "
                        f"{sorted(set(range(self.world_size)) - set(w.objects[key]))} never "
                        f"arrived.\nflight recorder:\n{w.flight_recorder()}"
                    )
                    w.abort(st.rank, exc)
                    raise exc
                me.wait(0.05)
        objs = w.objects[key]
        return [objs[r] for r in range(self.world_size)]


def spawn(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, check: bool = True, **kw):
    """Run `fn(comm, *args, **kw)` on `world_size` virtual ranks; return their results in order.

    `timeout` bounds every blocking wait (seconds). `check` verifies that the ranks of a group
    issue identical collectives (op, algorithm, shape, dtype) before each one runs.
    The first exception raised on any rank is re-raised here, with a note naming the rank.
    """
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"spawn: timeout must be positive seconds, got {timeout!r}")
    w = VirtualWorld(int(world_size), timeout, check)
    ranks = tuple(range(w.size))
    results: list = [None] * w.size

    def run(r: int) -> None:
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

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in ranks]
    with blas.limit(blas.per_rank(w.size)):  # P ranks must not each start a full BLAS pool
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if w.failure is not None:
        exc = w.failure
        if hasattr(exc, "add_note") and not isinstance(exc, CommError):
            exc.add_note(f"(raised on virtual rank {w.failed_rank} of {w.size})")
        raise exc
    return results
