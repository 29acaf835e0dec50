"""Virtual-rank faults that must end in a named error within the timeout (issue: hardening).

Each test's bug, planted, fails it: one mailbox key for every channel (the stray send is
broadcast), no end-of-collective check, spawn joining its threads (3600 s), a timing-out rank
aborting while holding its own lock (1,024 ranks deadlock).
"""

import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import collectives as C
import emulator
from emulator import CommTimeout, UnreceivedMessage

F8 = np.float64


def test_a_stray_send_is_not_consumed_by_the_next_collective():
    got = {}

    def fn(c):
        if c.rank == 0:
            c.send(np.array([-7.0]), 1)  # user point-to-point, never received
        got[c.rank] = C.broadcast(c, np.array([float(c.rank) + 42.0]), root=0, algorithm="tree")

    with pytest.raises(UnreceivedMessage) as info:
        emulator.spawn(fn, 4, timeout=10)
    # the broadcast is independent of the stray message: every rank holds root 0's value
    assert {r: v.tolist() for r, v in got.items()} == {r: [42.0] for r in range(4)}
    text = str(info.value)
    assert "rank 0 -> rank 1 in group 'world', point-to-point: 8 bytes (float64[1])" in text


def test_a_message_left_at_the_end_of_a_collective_names_sender_receiver_and_size():
    def fn(c):
        with c.collective("all_reduce", "ring", np.ones(3)):
            if c.rank == 0:
                c.send(np.ones(3), 1)
                c.send(np.ones((2, 3), np.float32), 1)  # one send too many
            c.barrier()  # uncounted: both sends are queued before rank 1 leaves the collective
            if c.rank == 1:
                c.recv(0, shape=3, dtype=F8)

    with pytest.raises(UnreceivedMessage) as info:
        emulator.spawn(fn, 2, timeout=10)
    text = str(info.value)
    assert "rank 1 finished all_reduce#0(algorithm='ring', group='world', float64[3])" in text
    assert "rank 0 -> rank 1 in group 'world', all_reduce#0" in text
    assert "24 bytes (float32[2, 3])" in text


def test_a_send_into_a_finished_collective_is_an_error():
    def fn(c):
        sub = c.group([0, 1], name="pair")
        with sub.collective("broadcast", "tree", np.ones(2)):
            if sub.rank == 0:
                c.barrier()  # rank 1 has left the collective when this returns
                sub.send(np.ones(2), 1)
        if sub.rank == 1:
            c.barrier()

    with pytest.raises(UnreceivedMessage) as info:
        emulator.spawn(fn, 2, timeout=10)
    text = str(info.value)
    assert "rank 0 sent rank 1 16 bytes (float64[2]) in group 'pair' for broadcast#0" in text
    assert "after rank 1 had finished that collective" in text


def test_user_messages_and_collectives_interleave_in_their_own_order():
    def fn(c):
        peer = 1 - c.rank
        c.send(np.array([c.rank + 10]), peer)  # user message first ...
        s = C.all_reduce(c, np.array([c.rank + 1.0]), algorithm="ring")
        u = c.recv(peer, shape=1, dtype=np.int64)  # ... received after the collective
        return float(s[0]), int(u[0]), c.ledger.sent(op="p2p"), c.ledger.sent(op="all_reduce")

    # all-reduce of 1.0 and 2.0; each rank gets the other's user message; p2p bytes: one int64;
    # ring all-reduce of 1 float64 on 2 ranks: chunks (1, 0): 8 bytes out (cost.ring_all_reduce)
    assert emulator.spawn(fn, 2, timeout=10) == [(3.0, 11, 8, 8), (3.0, 10, 8, 8)]


def _sleep_forever(c):
    if c.rank == 1:
        time.sleep(3600)
    else:
        c.recv(1, shape=1, dtype=F8)


def test_a_rank_asleep_in_user_code_ends_the_run_in_seconds():
    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:  # no rank returns: only rank 0's wait expires
        emulator.spawn(_sleep_forever, 2, timeout=1)
    assert time.monotonic() - t0 < 30  # not 3600 s (generous: a loaded machine)
    assert "rank 0 waited 1 s to receive from rank 1" in str(info.value)
    assert "rank 1: last completed none; current none (in user code)" in str(info.value)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "rank(s) [1] did not stop" in notes and "time.sleep(3600)" in notes


def test_a_rank_stuck_after_the_others_returned_is_named():
    with pytest.raises(CommTimeout) as info:
        emulator.spawn(lambda c: time.sleep(3600) if c.rank == 2 else None, 3, timeout=1)
    text = str(info.value)
    assert "spawn waited 1 s for rank(s) [2], which neither communicated nor returned" in text
    assert "rank(s) [0, 1] had returned" in text and "time.sleep(3600)" in text
    assert "rank 2: last completed none; current none (in user code)" in text


def test_an_endless_python_loop_is_stopped():
    threads = []

    def fn(c):
        if c.rank == 1:
            threads.append(threading.current_thread())
            n = 0
            while True:  # no communication, no sleep: only the injected stop ends it
                n += 1

    with pytest.raises(CommTimeout, match=r"rank\(s\) \[1\], which neither communicated"):
        emulator.spawn(fn, 2, timeout=1)
    deadline = time.monotonic() + 30
    while threads[0].is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not threads[0].is_alive()


INTERRUPTED = textwrap.dedent(
    """
    import threading, time
    import numpy as np
    import emulator

    def fn(c):
        if c.rank == 0:
            print("ranks started", flush=True)
            c.recv(1, shape=1, dtype=np.float64)  # blocked in a receive
        elif c.rank == 1:
            while True:  # an endless Python loop
                pass
        else:
            time.sleep(3600)  # a sleep: cannot be stopped before it returns

    try:
        emulator.spawn(fn, 3, timeout=600)
    except KeyboardInterrupt:
        deadline = time.monotonic() + 20
        alive = lambda: sorted(t.name for t in threading.enumerate() if t.name.startswith("rank-"))
        while alive() != ["rank-2"] and time.monotonic() < deadline:
            time.sleep(0.05)
        print("still running:", alive(), flush=True)
        raise
    """
)


def test_ctrl_c_stops_the_ranks_and_is_reraised(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ranks started"
        time.sleep(0.3)  # let rank 1 enter its loop
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # 600 s timeout, 3600 s sleep: not waited on
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert "still running: ['rank-2']" in out  # ranks 0 and 1 stopped; the sleeper cannot


def test_a_rank_computing_between_messages_is_not_stuck():
    def fn(c):
        if c.rank == 0:
            return None  # returns at once; rank 1 keeps communicating with rank 2
        for _ in range(8):
            time.sleep(0.3)  # 2.4 s of "compute" in all, more than the timeout; each gap less
            c.sendrecv(np.ones(1), 3 - c.rank, 3 - c.rank, shape=1, dtype=F8)
        return c.rank

    assert emulator.spawn(fn, 3, timeout=2) == [None, 1, 2]


def test_a_control_plane_gather_missing_a_rank_times_out_naming_it():
    def fn(c):
        if c.rank != 1:  # rank 1 skips the gather (stuck in user code; nobody returns)
            c.allgather_object(c.rank)
        else:
            time.sleep(3600)

    with pytest.raises(CommTimeout, match=r"control-plane gather of group 'world'; ranks \[1\]"):
        emulator.spawn(fn, 3, timeout=0.5)


def test_an_infinite_timeout_still_runs():
    # each sleep is capped (Condition.wait rejects inf): a receive that must wait still works
    def fn(c):
        if c.rank == 1:
            time.sleep(0.2)  # rank 0 is asleep in its receive by now
            c.send(np.ones(1), 0)
            return None
        return float(c.recv(1, shape=1, dtype=F8)[0])

    assert emulator.spawn(fn, 2, timeout=float("inf")) == [1.0, None]


def _slow_start(monkeypatch, fail_after=None):
    real, started = threading.Thread.start, []

    def start(self):
        if self.name.startswith("rank-"):
            if fail_after is not None and len(started) == fail_after:
                raise RuntimeError("can't start new thread")
            started.append(self)
        real(self)
        time.sleep(0.1)  # a slow OS: 40 threads take 4 s to start

    monkeypatch.setattr(threading.Thread, "start", start)


def test_deadlines_start_once_every_rank_runs(monkeypatch):
    _slow_start(monkeypatch)

    def fn(c):  # rank 0 waits on the last rank, whose thread starts 4 s after its own
        last = c.world_size - 1
        if c.rank == 0:
            return float(c.recv(last, shape=1, dtype=F8)[0])
        if c.rank == last:
            c.send(np.ones(1), 0)

    assert emulator.spawn(fn, 40, timeout=2)[0] == 1.0


def test_a_thread_the_os_refuses_is_a_named_error(monkeypatch):
    _slow_start(monkeypatch, fail_after=3)
    with pytest.raises(RuntimeError, match="could not start the thread of virtual rank 3 of 8"):
        emulator.spawn(lambda c: c.barrier(), 8, timeout=5)


def test_1024_ranks_timing_out_together_end_in_one_report():
    def fn(c):  # every rank waits on its right neighbour, which never sends
        c.recv((c.rank + 1) % c.world_size, shape=1, dtype=F8)

    t0 = time.monotonic()
    with pytest.raises(CommTimeout) as info:
        emulator.spawn(fn, 1024, timeout=1)
    assert time.monotonic() - t0 < 60  # deadlocked forever before (generous: a loaded machine)
    text = str(info.value)
    assert "waited 1 s to receive from rank" in text
    assert text.count("current none (in user code)") == 1024  # one full flight recorder
    assert not getattr(info.value, "__notes__", None)  # no rank was left behind (deadlocked)


def test_4096_ranks_pass_a_barrier():
    p, arrived = 4096, []

    def fn(c):
        arrived.append(c.rank)  # list.append is atomic: every rank records its arrival ...
        C.barrier(c)
        return len(arrived), c.ledger.sent(), c.ledger.received()  # ... before any leaves

    rounds = (p - 1).bit_length()  # dissemination: ceil(log2 p) 1-byte tokens each way
    # ~3.5 s on an idle 2-core machine; every hand-off waits for the OS to schedule the woken
    # thread, so a heavily loaded machine stretches it: the timeout is for a real hang only
    assert emulator.spawn(fn, p, timeout=600) == [(p, rounds, rounds)] * p
