"""The point-to-point primitive and virtual ranks: copies, order, accounting, failures."""

import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator import CollectiveMismatch, CommError, CommTimeout, PeerExited

F8 = np.float64


def test_spawn_returns_each_ranks_value_in_order():
    assert emulator.spawn(lambda c: (c.rank, c.world_size), 5) == [(r, 5) for r in range(5)]


def test_send_delivers_a_copy_not_a_view():
    def fn(c):
        if c.rank == 0:
            x = np.arange(4.0)
            c.send(x, 1)
            x[:] = -1  # a later write by the sender must not be seen
            return None
        return c.recv(0, shape=4, dtype=F8)

    assert np.array_equal(emulator.spawn(fn, 2)[1], np.arange(4.0))


def test_messages_between_a_pair_arrive_in_send_order():
    def fn(c):
        if c.rank == 0:
            for i in range(50):
                c.send(np.array([i]), 1)
            return None
        return [int(c.recv(0, shape=1, dtype=np.int64)[0]) for _ in range(50)]

    assert emulator.spawn(fn, 2)[1] == list(range(50))


@settings(max_examples=25, deadline=None)
@given(
    p=st.integers(2, 9),
    n=st.integers(0, 40),
    dtype=st.sampled_from(["float32", "float64", "int64", "int8", "complex128", "bool"]),
)
def test_every_byte_is_recorded_on_both_sides(p, n, dtype):
    def fn(c):
        x = (np.arange(n) + c.rank).astype(dtype)
        with emulator.scope("shift"):
            y = c.sendrecv(x, (c.rank + 1) % p, (c.rank - 1) % p, shape=n, dtype=dtype)
        return y, c.ledger

    out = emulator.spawn(fn, p)
    nbytes = n * np.dtype(dtype).itemsize
    for r, (y, ledger) in enumerate(out):
        assert np.array_equal(y, (np.arange(n) + (r - 1) % p).astype(dtype))
        assert ledger.sent() == ledger.received() == nbytes
        assert ledger.sent(peer=(r + 1) % p, tag="shift", op="p2p") == nbytes
        assert ledger.received(peer=(r - 1) % p) == nbytes


def test_bfloat16_crosses_unchanged():
    ml = pytest.importorskip("ml_dtypes")

    def fn(c):
        if c.rank == 0:
            c.send(np.array([1.5, -2.25], dtype=ml.bfloat16), 1)
            return None
        return c.recv(0, shape=2, dtype=ml.bfloat16)

    got = emulator.spawn(fn, 2)[1]
    assert got.dtype == ml.bfloat16 and got.astype(F8).tolist() == [1.5, -2.25]


def test_recv_into_out_buffer():
    def fn(c):
        if c.rank == 1:
            c.send(np.ones((2, 3)), 0)
            return None
        out = np.zeros((2, 3))
        got = c.recv(1, out=out)
        return got is out and out.sum() == 6

    assert emulator.spawn(fn, 2)[0]


def test_wrong_shape_or_dtype_is_an_error_naming_both_sides():
    def fn(c):
        if c.rank == 0:
            c.send(np.ones(3), 1)
        else:
            c.recv(0, shape=4, dtype=F8)

    with pytest.raises(CommError, match=r"rank 1 expected float64\[4\] from rank 0.*float64\[3\]"):
        emulator.spawn(fn, 2, timeout=5)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.send(np.ones(1), 5), "cannot send to rank 5; peers are 0..1"),
        (lambda c: c.send(np.ones(1), c.rank), "cannot send to itself"),
        (lambda c: c.send([1.0], 1 - c.rank), "expected a NumPy array"),
        (lambda c: c.send(np.array(["a"]), 1 - c.rank), "not a numeric dtype"),
        (lambda c: c.recv(1 - c.rank), "give out=<buffer> or both shape= and dtype="),
        (lambda c: c.recv(1 - c.rank, out=np.ones((3, 3)).T), "C-contiguous"),
        (lambda c: c.group([0, 0]), "duplicate ranks"),
        (lambda c: c.group([0, 7]), r"rank\(s\) \[7\] out of range"),
        (lambda c: c.group([]), "ranks is empty"),
    ],
)
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        emulator.spawn(call, 2, timeout=5)


def test_non_member_cannot_create_a_group():
    with pytest.raises(ValueError, match="rank 1 of 'world' is not in \\[0\\]"):
        emulator.spawn(lambda c: c.group([0]), 2, timeout=5)


def test_a_receive_from_a_rank_that_returned_fails_at_once_with_the_flight_recorder():
    def fn(c):
        with c.collective("all_reduce", "ring", np.ones(2)):
            if c.rank != 2:  # rank 2 skips its send and returns: nothing can come from it
                c.recv(2, shape=1, dtype=F8)

    t0 = time.perf_counter()
    with pytest.raises(PeerExited) as info:
        emulator.spawn(fn, 3, timeout=30)
    assert time.perf_counter() - t0 < 5  # not the 30 s timeout
    text = str(info.value)
    assert (
        ", in all_reduce#0(algorithm='ring', group='world', float64[2]), waits to receive "
        "from rank 2 in group 'world', but rank 2's program has returned" in text
    )
    assert "rank 0: last completed none; current all_reduce#0(algorithm='ring'" in text
    assert "rank 2: last completed all_reduce#0" in text


def test_a_point_to_point_receive_from_a_returned_rank_fails_at_once():
    def fn(c):
        if c.rank == 0:
            c.send(np.ones(1), 1)  # one message; rank 1 waits for a second
            time.sleep(0.3)  # rank 1 is asleep when rank 0 returns: rank_done must wake it
        else:
            c.recv(0, shape=1, dtype=F8)
            c.recv(0, shape=1, dtype=F8)

    t0 = time.perf_counter()
    with pytest.raises(PeerExited, match="rank 1 waits to receive from rank 0 in group 'world'"):
        emulator.spawn(fn, 2, timeout=30)
    assert time.perf_counter() - t0 < 5


def test_a_receive_the_peer_may_still_answer_waits_out_the_timeout():
    def fn(c):  # both ranks receive first: a cycle of live ranks, only the deadline ends it
        with c.collective("all_reduce", "ring", np.ones(2)):
            c.recv(1 - c.rank, shape=1, dtype=F8)

    t0 = time.perf_counter()
    with pytest.raises(CommTimeout) as info:
        emulator.spawn(fn, 2, timeout=0.5)
    assert time.perf_counter() - t0 < 5
    assert not isinstance(info.value, PeerExited)
    text = str(info.value)
    assert "waited 0.5 s to receive from rank " in text
    assert "current all_reduce#0(algorithm='ring'" in text


def test_the_first_exception_stops_the_world_and_is_reraised():
    def fn(c):
        if c.rank == 3:
            raise ZeroDivisionError("rank three broke")
        c.recv((c.rank + 1) % 4, shape=1, dtype=F8)  # would wait forever

    with pytest.raises(ZeroDivisionError, match="rank three broke") as info:
        emulator.spawn(fn, 4, timeout=30)
    assert "raised on virtual rank 3 of 4" in " ".join(info.value.__notes__)


@pytest.mark.parametrize(
    "differ, what",
    [
        ({"op": "all_gather"}, "all_gather#0"),
        ({"algorithm": "tree"}, "algorithm='tree'"),
        ({"array": np.ones(5)}, r"float64\[5\]"),
        ({"array": np.ones(4, np.float32)}, r"float32\[4\]"),
    ],
)
def test_mismatched_collectives_are_reported_with_both_calls(differ, what):
    def fn(c):
        kw = {"op": "all_reduce", "algorithm": "ring", "array": np.ones(4)}
        if c.rank == 1:
            kw.update(differ)
        with c.collective(**kw):
            pass

    with pytest.raises(CollectiveMismatch) as info:
        emulator.spawn(fn, 3, timeout=5)
    text = str(info.value)
    assert "collective mismatch in group 'world'" in text and "rank 1" in text
    assert "all_reduce#0(algorithm='ring', group='world', float64[4])" in text
    assert re.search(what, text), text


def test_allgather_object_is_uncounted():
    def fn(c):
        return c.allgather_object(c.rank * 10), c.ledger.sent()

    for objs, sent in emulator.spawn(fn, 4):
        assert objs == [0, 10, 20, 30] and sent == 0


def test_scope_nests_and_is_a_noop_outside_ranks():
    with emulator.scope("outside"):
        pass

    def fn(c):
        with emulator.scope("zero3"), emulator.scope("fwd/block.3"):
            c.sendrecv(np.ones(2), 1 - c.rank, 1 - c.rank, shape=2, dtype=F8)
        return c.ledger.records[0].tag

    assert emulator.spawn(fn, 2) == ["zero3/fwd/block.3"] * 2


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_spawn_rejects_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        emulator.spawn(lambda c: None, bad)


def test_256_virtual_ranks_exchange():
    def fn(c):
        p = c.world_size
        return c.sendrecv(
            np.array([c.rank]), (c.rank + 1) % p, (c.rank - 1) % p, shape=1, dtype=np.int64
        )[0]

    got = emulator.spawn(fn, 256)
    assert got == [(r - 1) % 256 for r in range(256)]
