"""Trace events -> busy/idle, the ASCII timeline and Chrome trace-event JSON."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

from emulator.trace import Event, ascii_timeline, busy_idle, chrome_trace, write_chrome_trace

EVENTS = [  # 2 stages, 1 micro-batch of GPipe: F1 on 0, F1 on 1, B1 on 1, B1 on 0
    Event(0, "F", "F1", 0, 1, mb=0),
    Event(0, "send", "act F1", 1, 0, mb=0, nbytes=64, peer=1),
    Event(1, "F", "F1", 1, 1, mb=0),
    Event(1, "B", "B1", 2, 2, mb=0),
    Event(0, "B", "B1", 4, 2, mb=0),
]


def test_busy_idle_counts_compute_only():
    rows = busy_idle(EVENTS)
    assert [(r["busy"], r["idle"], r["total"]) for r in rows] == [(3, 3, 6), (3, 3, 6)]
    assert rows[0]["bubble"] == Fraction(1, 2)


def test_ascii_timeline_is_the_seed_picture():
    assert ascii_timeline(EVENTS).splitlines() == [
        "stage 0: F1 .  .  .  B1 =",
        "stage 1: .  F1 B1 =  .  .",
    ]


def test_chrome_trace_has_one_named_track_per_rank(tmp_path):
    path = write_chrome_trace(tmp_path / "t.json", EVENTS, us_per_unit=10.0)
    doc = json.loads(Path(path).read_text())
    assert doc == chrome_trace(EVENTS, us_per_unit=10.0)
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    assert [(m["tid"], m["args"]["name"]) for m in meta] == [(0, "stage 0"), (1, "stage 1")]
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 5 and xs[-1]["ts"] == 40.0 and xs[-1]["dur"] == 20.0
    assert xs[1]["args"] == {"mb": 0, "bytes": 64, "start_units": 1.0, "peer": 1}
