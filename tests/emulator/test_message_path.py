"""The virtual message path's fast cases (VirtualComm.send / recv, the cached argument checks,
the mailbox keyed by group id) give exactly what the full checks give: the same arrays, the
same records, the same errors - also after a cache has been filled by an earlier message."""

import numpy as np
import pytest

import emulator
from emulator import CommError

F8 = np.float64


def test_a_cached_dtype_does_not_let_a_non_numeric_array_through():
    def fn(c):
        c.send(np.ones(2), 1 - c.rank)  # float64 is now on the fast path
        c.recv(1 - c.rank, shape=2, dtype=F8)
        c.send(np.array([None, 1.0], dtype=object), 1 - c.rank)

    with pytest.raises(ValueError, match="dtype object is not a numeric dtype"):
        emulator.spawn(fn, 2, timeout=5)


def test_an_ndarray_subclass_arrives_as_a_plain_c_ordered_copy():
    def fn(c):
        if c.rank == 0:
            x = np.ones((3, 2)).T.view(np.matrix)  # another type, not C-contiguous
            c.send(x, 1)
            return None
        got = c.recv(0, shape=(2, 3), dtype=F8)
        return type(got), got.flags.c_contiguous, got.sum()

    assert emulator.spawn(fn, 2)[1] == (np.ndarray, True, 6.0)


@pytest.mark.parametrize(
    "shape",
    [3, (3,), [3], (np.int64(3),), np.int64(3), (np.array(3),), (3.0,)],
    ids=["int", "tuple", "list", "np.int64 tuple", "np.int64", "0-d array", "float"],
)
def test_every_shape_spelling_receives_the_same_message_twice(shape):
    def fn(c):
        if c.rank == 0:
            c.send(np.arange(3.0), 1)
            c.send(np.arange(3.0) + 1, 1)
            return None
        first = c.recv(0, shape=shape, dtype=F8)  # fills the cache
        second = c.recv(0, shape=shape, dtype=F8)  # a hit
        return first.tolist(), second.tolist(), first.shape

    assert emulator.spawn(fn, 2)[1] == ([0.0, 1.0, 2.0], [1.0, 2.0, 3.0], (3,))


def test_a_cache_hit_still_checks_the_message_shape_and_dtype():
    def fn(c):
        if c.rank == 0:
            c.send(np.ones(3), 1)
            c.send(np.ones(3, np.int32), 1)
            c.send(np.ones(4), 1)
            return
        c.recv(0, shape=(3,), dtype=F8)
        c.recv(0, shape=(3,), dtype=np.int32)  # same shape, another dtype: its own entry
        c.recv(0, shape=(3,), dtype=F8)  # a hit, but 4 elements arrive

    with pytest.raises(CommError, match=r"rank 1 expected float64\[3\] from rank 0.*float64\[4\]"):
        emulator.spawn(fn, 2, timeout=5)


def test_peers_as_numpy_integers_and_bad_peers_after_the_fast_path():
    def fn(c):
        other = np.int64(1 - c.rank)
        c.send(np.ones(1), other)
        got = c.recv(other, shape=1, dtype=F8)
        assert c.ledger.sent() == 8 and got[0] == 1.0
        c.send(np.ones(1), 2)

    with pytest.raises(ValueError, match="cannot send to rank 2; peers are 0..1"):
        emulator.spawn(fn, 2, timeout=5)


def test_two_groups_of_one_name_and_members_keep_their_messages_apart():
    def fn(c):
        a = c.group([0, 1], name="g")
        b = c.group([0, 1], name="g")  # the same name and ranks: another group all the same
        if c.rank == 0:
            a.send(np.array([1.0]), 1)
            b.send(np.array([2.0]), 1)
            return None
        from_b = b.recv(0, shape=1, dtype=F8)[0]  # b's message, though a's was sent first
        from_a = a.recv(0, shape=1, dtype=F8)[0]
        return from_b, from_a, [r.group for r in c.ledger.records]

    assert emulator.spawn(fn, 2)[1] == (2.0, 1.0, ["g", "g"])
