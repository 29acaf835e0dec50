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


def _expected_records(ops, rank):
    """The ledger a rank must hold after `ops`, written from the Record definition alone."""
    from emulator.ledger import Record

    out, step = [], 0
    for op in ops:
        if op[0] == "step":
            step = op[1]
        elif op[0] == "p2p":
            _, a, b, n, tag = op
            if rank == a:
                out.append(Record("p2p", "", "world", b, "send", 8 * n, step, tag, -1))
            if rank == b:
                out.append(Record("p2p", "", "world", a, "recv", 8 * n, step, tag, -1))
    return out


def _run(ops):
    def fn(c):
        got = []
        for i, op in enumerate(ops):
            if op[0] == "step":
                c.ledger.step = op[1]
                continue
            if op[0] == "ar":  # a collective between the p2p messages: its own channel
                from collectives import all_reduce

                got.append(all_reduce(c, np.ones(op[1]))[0])
                continue
            _, a, b, n, tag = op
            with emulator.scope(tag) if tag else _nothing():
                if c.rank == a:  # np.int64 peers take Comm's full path, ints the fast one
                    c.send(np.arange(float(n)) + i, b if n % 2 else np.int64(b))
                if c.rank == b:
                    got.append(c.recv(a, shape=n, dtype=F8)[0])
        return got, [r for r in c.ledger.records if r.op == "p2p"]

    return emulator.spawn(fn, 3, timeout=30)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_random_message_sequences_record_exactly_what_the_definition_says():
    """Random p2p messages (fast and full path mixed, tags, steps, collectives between them)
    on 3 ranks: every rank's p2p records equal ones written from the Record definition, and
    every message arrives in order with its contents."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    pair = st.sampled_from([(0, 1), (1, 0), (0, 2), (2, 1), (1, 2), (2, 0)])
    msg = st.tuples(st.just("p2p"), pair, st.integers(1, 4), st.sampled_from(["", "a", "b/c"]))
    op = st.one_of(
        msg.map(lambda m: ("p2p", *m[1], m[2], m[3])),
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("ar"), st.integers(1, 3)),
    )

    @settings(max_examples=25, deadline=None)
    @given(st.lists(op, max_size=30))
    def check(ops):
        results = _run(ops)
        for rank, (got, records) in enumerate(results):
            assert records == _expected_records(ops, rank)
            want = [  # an all-reduce of ones gives 3; a message's first element is its index
                3.0 if o[0] == "ar" else float(i)
                for i, o in enumerate(ops)
                if o[0] == "ar" or (o[0] == "p2p" and o[2] == rank)
            ]
            assert got == want

    check()


class _Sub(np.ndarray):
    """An ndarray subclass: the fast paths leave it to Comm's full path."""


@pytest.mark.parametrize(
    "case", ["even", "uneven", "dtype", "shape", "npint", "noncontig", "subclass", "no_out"]
)
def test_a_collectives_sendrecv_gives_what_send_then_recv_gives(case):
    """VirtualComm.sendrecv's one-frame step (a collective's send and receive into its own
    buffer) against its definition, send then recv: the same arrays, records and errors."""

    def program(c, fused):
        r, p = c.rank, c.size
        dst, src = (r + 1) % p, (r - 1) % p
        n = (lambda j: 3 + j) if case == "uneven" else (lambda j: 3)
        x = np.arange(float(n(r))) + 10 * r
        if case == "dtype" and r == 0:
            x = x.astype(np.float32)
        if case == "shape" and r == 0:
            x = np.arange(4.0)
        if case == "subclass":
            x = x.view(_Sub)
        out = np.empty(2 * n(src))[::2] if case == "noncontig" else np.empty(n(src))
        kw = {"shape": n(src), "dtype": F8} if case == "no_out" else {"out": out}
        to = np.int64(dst) if case == "npint" else dst
        got = []
        with emulator.scope("t"), c.collective("custom", "ring", np.ones(1)):
            for _ in range(2):
                if fused:
                    y = c.sendrecv(x, to, src, **kw)
                else:
                    c.send(x, to)
                    y = c.recv(src, **kw)
                got.append((type(y), y.tolist(), y is out))
        return got, c.ledger.records

    def outcome(fused):
        try:
            return emulator.spawn(lambda c: program(c, fused), 4, timeout=10)
        except Exception as exc:  # noqa: BLE001 - the error is part of the outcome
            return type(exc).__name__, str(exc)

    assert outcome(True) == outcome(False)
