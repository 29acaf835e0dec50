"""The replayed timeline's bubble and in-flight counts equal the closed forms, exactly."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.pipeline.bubble import (
    Cost,
    bubble_formula,
    in_flight,
    in_flight_formula,
    measured_bubble,
    replay,
)
from parallel.pipeline.schedules import gpipe, interleaved, make_schedule, one_f_one_b, zb_h1

costs = st.builds(Cost, f=st.integers(1, 4), b=st.integers(1, 4), w=st.integers(0, 4))


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b"]), p=st.integers(1, 7), m=st.integers(1, 16),
       cost=costs)  # fmt: skip
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m, cost):
    sched = make_schedule(name, p, m)
    assert measured_bubble(sched, cost) == [Fraction(p - 1, m + p - 1)] * p


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), k=st.integers(1, 4), v=st.integers(1, 4), cost=costs)
def test_interleaved_bubble(p, k, v, cost):
    sched = interleaved(p, p * k, v)
    want = Fraction(p - 1, v) / (p * k + Fraction(p - 1, v))
    assert measured_bubble(sched, cost) == [want] * p == [bubble_formula(sched, cost)] * p


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 7), extra=st.integers(0, 10), f=st.integers(1, 4), b=st.integers(1, 4),
       data=st.data())  # fmt: skip
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, extra, f, b, data):
    w = data.draw(st.integers(0, min(f, b)))
    m, cost = p + extra, Cost(f, b, w)
    idle = (p - 1) * (f + b - w)  # 1F1B's is (p-1)(F+B+W): 2W per stage less
    want = Fraction(idle, idle + m * (f + b + w))
    sched = zb_h1(p, m)
    assert measured_bubble(sched, cost) == [want] * p == [bubble_formula(sched, cost)] * p
    one = measured_bubble(one_f_one_b(p, m), cost)[0]  # never worse than unsplit 1F1B
    assert want <= one


@settings(max_examples=40, deadline=None)
@given(p=st.integers(2, 8), f=st.integers(1, 4), b=st.integers(1, 4), data=st.data())
def test_zb_h1_bubble_with_fewer_micro_batches_than_stages(p, f, b, data):
    # m < p: no steady state; span = 1F1B's (m+p-1)(F+B+W) with B for B+W, plus stage 0's W
    m, w = data.draw(st.integers(1, p - 1)), data.draw(st.integers(0, min(f, b)))
    cost, busy = Cost(f, b, w), m * (f + b + w)
    want = 1 - Fraction(busy, (m + p - 1) * (f + b) + w)
    sched = zb_h1(p, m)
    assert measured_bubble(sched, cost) == [want] * p == [bubble_formula(sched, cost)] * p


def test_zb_h1_is_a_third_of_1f1b_when_f_b_w_are_equal():
    # Qi et al. 2023, section 2.1: bubble time (p-1)F against 1F1B's 3(p-1)F.
    ev = {n: replay(make_schedule(n, 4, 8)) for n in ("1f1b", "zb-h1")}
    span = {n: max(e.end for e in x) for n, x in ev.items()}
    assert span["1f1b"] - 24 == 9 and span["zb-h1"] - 24 == 3


def test_zb_h1_formula_refuses_outside_its_domain():
    # p = 4, m = 2, F = B = W = 1: span 11, busy 6 (examples/05 --pp 4 --microbatches 2)
    assert bubble_formula(zb_h1(4, 2)) == measured_bubble(zb_h1(4, 2))[0] == Fraction(5, 11)
    with pytest.raises(ValueError, match="needs W <= min\\(F, B\\)"):
        bubble_formula(zb_h1(4, 8), Cost(1, 1, 2))


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]), p=st.integers(1, 6),
       k=st.integers(1, 3), v=st.integers(1, 3), off=st.integers(0, 5))  # fmt: skip
def test_peak_in_flight(name, p, k, v, off):
    v = v if name == "interleaved" else 1
    m = p * k if name == "interleaved" else max(1, p * k - off)  # m < p too, but interleaved
    sched = make_schedule(name, p, m, v)
    assert in_flight(sched) == in_flight_formula(sched)
    if name == "1f1b":
        assert in_flight(sched) == [min(p - s, m) for s in range(p)]
    if name == "gpipe":
        assert in_flight(sched) == [m] * p


def test_messages_carry_bytes_and_peers():
    ev = replay(gpipe(3, 2), msg_bytes=96)
    sends = [e for e in ev if e.kind == "send"]
    assert len(sends) == 2 * 2 * 2  # 2 boundaries x 2 micro-batches x (activation + gradient)
    assert {(e.rank, e.peer) for e in sends} == {(0, 1), (1, 2), (2, 1), (1, 0)}
    assert all(e.nbytes == 96 for e in sends)
