"""`spawn`'s own wait for its ranks: never without a deadline, and Ctrl-C stops the run.

Threads cannot be killed, so the ranks are daemon threads and the spawning thread waits in
short slices (a signal such as Ctrl-C is handled between them) instead of joining. No wait's
deadline expires before every thread runs (`world.started_at`, `mailbox._extend`), so none runs
out while a peer's thread is still being created; an OS refusing a thread is a `RuntimeError`
naming the rank.

- once some rank has returned, a rank that neither communicates (its `progress` counter) nor
  returns for `timeout` seconds, and is not in a communication wait (which has its own
  deadline), is stuck in user code: the world fails with a `CommTimeout` naming it, where its
  thread is (file:line) and every rank's flight recorder;
- once the world has failed, the ranks are given until no rank has exited for `GRACE` seconds;
  ranks still running are named in a note on the re-raised failure;
- KeyboardInterrupt aborts the world (every rank raises `RankAborted` at its next call) and is
  re-raised.
A rank left running outside any communication gets `RankAborted` injected into its thread
(`PyThreadState_SetAsyncExc`): a Python loop stops at once, a sleep or C call when it returns.
"""

from __future__ import annotations

import ctypes
import sys
import time
import traceback

from .rank import CommTimeout, RankAborted

SLICE = 0.2  # seconds between the spawning thread's checks (and Ctrl-C's latency)
GRACE = 1.0  # after a failure: how long to wait for the next rank to exit before giving up


def supervise(w, threads) -> str:
    """Start `threads` (one per rank of world `w`) and wait for them; returns a note naming the
    ranks that did not stop after a failure ('' if every rank stopped)."""
    try:
        for r, t in enumerate(threads):
            try:
                t.start()
            except RuntimeError as exc:  # "can't start new thread": the OS's thread limit
                with w.done:  # the threads never started never finish
                    w.running -= len(threads) - r
                raise RuntimeError(
                    f"spawn: could not start the thread of virtual rank {r} of {w.size} ({exc}); "
                    f"the OS limits threads per process (ulimit -u, memory): use fewer ranks"
                ) from exc
        w.started_at = time.monotonic()  # deadlines may expire from now on
        return _wait(w, threads)
    except BaseException as exc:  # Ctrl-C (or no thread): stop the ranks, then re-raise
        w.abort(-1, RankAborted(f"stopped: the run was interrupted ({type(exc).__name__})"))
        _stop(w, threads, _drain(w, min(GRACE, w.timeout)))
        raise


def _wait(w, threads) -> str:
    first_done = None
    seen: dict = {}  # rank -> (progress, since when)
    while True:
        with w.done:
            if w.running == 0:
                return ""
            w.done.wait(SLICE)
            running = w.running
        if running == 0:
            return ""
        if w.failure is not None:
            # ranks still in a communication wait were woken and are only slow to leave it
            alive = [r for r in _drain(w, min(GRACE, w.timeout)) if not w.states[r].waiting]
            if not alive:
                return ""
            _stop(w, threads, alive)
            return (
                f"rank(s) {alive[:16]} did not stop within {GRACE:g} s of the failure (outside "
                f"any communication; each stops at its next send or receive):\n"
                + _where(threads, alive)
            )
        if running == w.size:
            continue  # nobody has returned: blocked ranks are bounded by their own deadlines
        now = time.monotonic()
        first_done = first_done or now
        stuck = []
        for r, st in enumerate(w.states):
            if w.exited[r]:
                continue
            if st.waiting:
                seen[r] = (st.progress, now)
                continue
            progress, since = seen.get(r, (st.progress, first_done))
            if progress != st.progress:
                progress, since = st.progress, now
            seen[r] = (progress, since)
            if now - since >= w.timeout:
                stuck.append(r)
        if stuck and _fail_stuck(w, threads, stuck):
            return ""


def _fail_stuck(w, threads, stuck: list) -> bool:
    done = [r for r in range(w.size) if w.exited[r]]
    exc = CommTimeout(
        f"spawn waited {w.timeout:g} s for rank(s) {stuck[:16]}, which neither communicated nor "
        f"returned while rank(s) {done[:16]}{' ...' if len(done) > 16 else ''} had returned: "
        f"stuck in user code (a sleep, an endless loop, a rank-dependent branch without "
        f"communication):\n{_where(threads, stuck)}\nflight recorder:\n{w.flight_recorder()}"
    )
    if not w.abort(-1, exc):
        return False  # another failure came first: the failure branch reports it
    _stop(w, threads, stuck)
    return True


def _drain(w, grace: float) -> list:
    """Wait while ranks keep exiting (each exit restarts `grace`); return the ranks left."""
    last, left = time.monotonic(), w.running
    while left and time.monotonic() - last < grace:
        with w.done:
            w.done.wait(SLICE)
            now_left = w.running
        if now_left != left:
            last, left = time.monotonic(), now_left
    return [r for r in range(w.size) if not w.exited[r]]


def _stop(w, threads, ranks) -> None:
    """Inject RankAborted into ranks outside any communication wait (waits were notified)."""
    for r in ranks:
        ident = threads[r].ident
        if ident is not None and not w.exited[r] and not w.states[r].waiting:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(RankAborted)
            )


def _where(threads, ranks, limit: int = 16) -> str:
    """Where each rank's thread is now: its innermost Python frame, file:line and source."""
    frames = sys._current_frames()
    lines = []
    for r in ranks[:limit]:
        frame = frames.get(threads[r].ident)
        if frame is None:
            lines.append(f"  rank {r}: (its thread has ended)")
            continue
        f = traceback.extract_stack(frame)[-1]
        lines.append(f"  rank {r} at {f.filename}:{f.lineno} in {f.name}: {f.line}")
    if len(ranks) > limit:
        lines.append(f"  ... and {len(ranks) - limit} more")
    return "\n".join(lines)
