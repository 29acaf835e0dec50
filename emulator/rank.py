"""What a rank is while it runs: its state, its flight recorder, its scopes, and the errors.

`RankState` holds everything one rank owns that all of its communicators share: the byte ledger,
the memory ledger, the open `scope` tags, and the flight recorder of collective calls (`Call`)
that a timeout prints. The backend binds it to the rank's thread, so `emulator.scope(...)` and
`current_state()` work without a communicator in hand.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

from .ledger import Ledger
from .memory import MemoryLedger


class CommError(RuntimeError):
    """A communication failure: the message says which rank, where, and what to do."""


class CommTimeout(CommError):
    """A blocking wait exceeded the world's timeout (a hang, reported instead of waited on)."""


class PeerExited(CommTimeout):
    """Virtual ranks: a receive that can never complete - the rank it waits on has returned
    from its program with nothing more queued for it. Raised at once, not after the timeout."""


class CollectiveMismatch(CommError):
    """Ranks of one group called different collectives (op, algorithm, shape, dtype or group)."""


class RankAborted(CommError):
    """This rank stopped because another rank failed first; the spawner re-raises that failure."""


class UnreceivedMessage(CommError):
    """A message was sent but never received: left over at the end of a collective or a run, or
    sent into a collective its receiver had already finished. Names sender, receiver and size."""


@dataclass
class Call:
    """One collective call, as the flight recorder keeps it."""

    seq: int
    op: str
    algorithm: str
    group: str
    shape: tuple
    dtype: str
    extra: str = ""

    def signature(self) -> tuple:
        """What must be identical on every rank of the group for the call to be valid."""
        return (self.op, self.algorithm, self.group, self.shape, self.dtype, self.extra)

    def describe(self) -> str:
        extra = f", {self.extra}" if self.extra else ""
        return (
            f"{self.op}#{self.seq}(algorithm={self.algorithm!r}, group={self.group!r}, "
            f"{self.dtype}{list(self.shape)}{extra})"
        )


@dataclass
class RankState:
    """Everything one rank owns that is shared by all of its communicators."""

    rank: int
    ledger: Ledger
    memory: MemoryLedger = field(default_factory=MemoryLedger)
    tags: list = field(default_factory=list)
    calls: list = field(default_factory=list)  # flight recorder: every collective call
    current: Call | None = None
    depth: int = 0  # collective nesting (an all-reduce runs a reduce-scatter inside it)
    group_counts: dict = field(default_factory=dict)
    seqs: dict = field(default_factory=dict)  # collectives issued per group key
    finished: bool = False  # the rank's program has returned
    progress: int = 0  # messages + collective calls so far: a watchdog tells a stuck rank by it
    waiting: bool = False  # blocked in a communication wait (which has its own deadline)
    record_cache: dict = field(default_factory=dict)  # ledger Records by value (comm._record)
    label: tuple = ("p2p", "", -1)  # the ledger's (op, algorithm, seq) of `current` (comm.py)

    def flight(self) -> str:
        # O(1): a timeout prints every rank's line, and 1,024 ranks may time out together
        calls = self.calls
        n = len(calls) - (1 if calls and calls[-1] is self.current else 0)
        last = calls[n - 1].describe() if n else "none"
        now = self.current.describe() if self.current else "none (in user code)"
        if self.finished:
            now = "none (its program has returned)"
        return f"rank {self.rank}: last completed {last}; current {now}"


_tls = threading.local()


def current_state() -> RankState | None:
    """The rank state of the calling thread (set by the backend when a rank starts)."""
    return getattr(_tls, "state", None)


def _bind_state(state: RankState | None) -> None:
    _tls.state = state


@contextlib.contextmanager
def scope(tag: str):
    """Label the traffic (and trace events) inside the block: `with scope("zero3/fwd/block.3")`.

    Scopes nest; the recorded tag is the path of all open scopes joined by "/".
    Outside any rank (plain single-process code) it is a no-op.
    """
    state = current_state()
    if state is None:
        yield
        return
    state.tags.append(str(tag))
    try:
        yield
    finally:
        state.tags.pop()


def mismatch_message(group: str, mine: tuple, theirs: tuple) -> str:
    """The text every rank of a mismatched collective sees: both ranks and both calls."""
    (ra, ca), (rb, cb) = mine, theirs
    return (
        f"collective mismatch in group {group!r}: rank {ra} called {ca} but rank {rb} called "
        f"{cb}. Every rank of a group must issue the same collectives in the same order with "
        f"the same op, algorithm, shape and dtype."
    )
