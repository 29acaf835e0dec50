"""Schedules as data: their shape, their invariants, and validation's error messages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.pipeline.schedules import (
    Action,
    Schedule,
    gpipe,
    interleaved,
    make_schedule,
    one_f_one_b,
    validate,
    zb_h1,
)


def test_1f1b_reads_as_the_paper_draws_it():
    # Narayanan et al. 2021, figure 4 (top): warm-up p-1-s forwards, steady 1F1B, cool-down.
    assert str(one_f_one_b(4, 8)).splitlines() == [
        "stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_gpipe_and_zb_h1_shapes():
    assert str(gpipe(2, 3)).splitlines()[1] == "stage 1: F0 F1 F2 B0 B1 B2"
    zb = zb_h1(4, 8)
    assert zb.split and [str(a) for a in zb.stages[3][:9]] == (
        ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "W0"]
    )  # the last stage delays its W passes by s = 3 micro-batches
    assert [str(a) for a in zb.stages[0][4:6]] == ["B0", "W0"]  # stage 0 does not delay


def test_interleaved_assigns_chunks_in_rounds_of_p():
    s = interleaved(2, 4, 2)
    fwd = [str(a) for a in s.stages[0] if a.kind == "F"]
    assert fwd == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]
    assert s.virtual(1, 1) == 3


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]),
    p=st.integers(1, 6),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
)
def test_every_generated_schedule_validates(name, p, k, v):
    m = p * k if name == "interleaved" else k + p - 2 if k + p > 2 else 1
    sched = make_schedule(name, p, m, v if name == "interleaved" else 1)
    validate(sched)
    for acts in sched.stages:  # backward order is ascending per chunk: grads sum like the reference
        for c in range(sched.v):
            mbs = [a.mb for a in acts if a.kind == "B" and a.chunk == c]
            assert mbs == sorted(mbs)


def _sched(p, *rows, split=False):
    stages = [[Action(t[0], int(t[1:])) for t in row.split()] for row in rows]
    m = max(len(r) for r in stages) // (3 if split else 2)
    return Schedule("custom", p, m, 1, split, stages)


@pytest.mark.parametrize(
    ("rows", "split", "message"),
    [
        ((["B0 F0", "F0 B0"]), False, "stage 0 action #0 B0 runs before F0"),
        ((["F0 F0", "F0 B0"]), False, "stage 0 runs F0 twice"),
        ((["F0 F1 B0", "F0 B0 F1 B1"]), False, "stage 0 never runs ['B1']"),
        ((["F0 B0 W0", "F0 W0 B0"]), True, "stage 1 action #1 W0 runs before B0"),
        ((["F0 B0 F1 B1", "F1 F0 B0 B1"]), False, "deadlocks: stage 0 waits at B0 for B0 on"),
        ((["F0 B0 X0", "F0 B0 W0"]), True, "X0 is not one of ['F', 'B', 'W']"),
    ],
)
def test_validation_names_the_offending_action(rows, split, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(_sched(2, *rows, split=split))


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="multiple of the stage count p=4"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'"):
        make_schedule("pipedream", 2, 2)
    with pytest.raises(ValueError, match="v=2 is for 'interleaved'"):
        make_schedule("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="m \\(micro-batches\\) must be an int >= 1"):
        gpipe(2, 0)


def test_a_user_built_schedule_is_type_checked():
    with pytest.raises(TypeError, match="expected a Schedule, got list"):
        validate([[Action("F", 0)]])
    with pytest.raises(TypeError, match="stage 0 action #1 \\('B', 0\\) is not an Action"):
        validate(Schedule("mine", 1, 1, 1, False, [[Action("F", 0), ("B", 0)]]))
    with pytest.raises(ValueError, match="m \\(micro-batches\\) must be an int >= 1"):
        validate(Schedule("mine", 1, 0, 1, False, [[]]))


def test_a_validated_schedule_lets_no_other_through():
    """validate remembers the schedules that passed (every rank validates the same one); a
    schedule differing in one action, the split or the name is validated afresh, and an
    invalid one raises every time."""
    good = _sched(2, "F0 F1 B0 B1", "F0 B0 F1 B1")
    again = _sched(2, "F0 F1 B0 B1", "F0 B0 F1 B1")  # equal content, another object
    assert validate(good) is good and validate(again) is again
    swapped = _sched(2, "F0 B1 F1 B0", "F0 B0 F1 B1")  # the same header, B1 before F1
    for _ in range(2):
        with pytest.raises(ValueError, match="runs before"):
            validate(swapped)
    as_split = _sched(2, "F0 F1 B0 B1", "F0 B0 F1 B1")
    as_split.split = True  # the same actions, but a split backward needs W actions
    with pytest.raises(ValueError, match="never runs"):
        validate(as_split)
    tuples = Schedule("custom", 2, 2, 1, False, [list(good.stages[0]), [("F", 0), ("B", 0)]])
    with pytest.raises(TypeError, match="is not an Action"):
        validate(tuples)
