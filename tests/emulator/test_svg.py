"""The SVG pictures, parsed back with xml.etree: the timeline's boxes are the events (and its
idle share is the closed-form bubble); the comm matrix's cells are the ledger's bytes, which
equal collectives/cost.py's formulas."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from fractions import Fraction

import numpy as np
import pytest

import collectives
import emulator
from collectives import cost
from emulator import svg
from emulator.trace import Event
from parallel.pipeline.bubble import Cost, bubble_formula, replay
from parallel.pipeline.schedules import make_schedule
from tools.run import rank_report

NS = "{http://www.w3.org/2000/svg}"


def boxes(text: str, attr: str) -> list[dict]:
    root = ET.fromstring(text)  # also proves the file is well-formed XML
    assert root.tag == f"{NS}svg"
    return [r.attrib for r in root.iter(f"{NS}rect") if attr in r.attrib]


def texts(text: str) -> list[str]:
    return [t.text or "" for t in ET.fromstring(text).iter(f"{NS}text")]


def test_timeline_boxes_are_the_events_by_hand():
    # GPipe, 2 stages, 2 micro-batches, unit costs, written out by hand
    ev = [Event(0, "F", "F1", 0, 1), Event(0, "F", "F2", 1, 1), Event(1, "F", "F1", 1, 1),
          Event(1, "F", "F2", 2, 1), Event(1, "B", "B1", 3, 1), Event(1, "B", "B2", 4, 1),
          Event(0, "B", "B1", 4, 1), Event(0, "B", "B2", 5, 1),
          Event(0, "send", "act", 1, 0, nbytes=8, peer=1)]  # fmt: skip
    out = svg.timeline_svg(ev, 2, unit_px=10)
    got = boxes(out, "data-kind")
    assert len(got) == 8  # the message is not a box
    want = sorted((e.rank, e.kind, float(e.start), float(e.duration)) for e in ev[:8])
    assert sorted((int(b["data-rank"]), b["data-kind"], float(b["data-start"]),
                   float(b["data-duration"])) for b in got) == want  # fmt: skip
    x0 = min(float(b["x"]) for b in got)
    for b in got:  # positions and widths scale with logical time
        assert float(b["x"]) - x0 == pytest.approx(10 * float(b["data-start"]))
        assert float(b["width"]) == pytest.approx(10 * float(b["data-duration"]))
    assert {b["data-legend"] for b in boxes(out, "data-legend")} == {"F", "B"}
    assert any("logical time (unit costs" in t for t in texts(out))


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 8, 1), ("zb-h1", 4, 8, 1),
                                           ("interleaved", 4, 8, 2)])  # fmt: skip
def test_timeline_idle_share_is_the_closed_form_bubble(name, p, m, v):
    sched = make_schedule(name, p, m, v)
    out = svg.timeline_svg(replay(sched, Cost(1, 1, 1)), p, unit_px=10)
    got = boxes(out, "data-kind")
    span = Fraction(max(float(b["x"]) + float(b["width"]) for b in got)
                    - min(float(b["x"]) for b in got)).limit_denominator(1000)  # fmt: skip
    for s in range(p):
        busy = sum(Fraction(b["width"]).limit_denominator(1000) for b in got
                   if b["data-rank"] == str(s))  # fmt: skip
        assert (span - busy) / span == bubble_formula(sched, Cost(1, 1, 1))


def test_timeline_without_compute_events_is_an_error():
    with pytest.raises(ValueError, match="no compute events"):
        svg.timeline_svg([Event(0, "send", "act", 0, 0)])


def matrix(out: str) -> dict:
    cells = {}
    for b in boxes(out, "data-bytes"):
        cells[b["data-axis"], int(b["data-src"]), int(b["data-dst"])] = int(b["data-bytes"])
    return cells


def test_comm_matrix_cells_are_the_ring_formula():
    n, p = 10, 4  # 10 elements over 4 ranks: uneven chunks, so every rank's bytes differ

    def fn(comm):
        collectives.all_reduce(comm, np.arange(n, dtype=np.float64), algorithm="ring")
        return rank_report(comm)["sent_to"]

    cells = matrix(svg.comm_matrix_svg(emulator.spawn(fn, p)))
    assert len(cells) == p * p
    for (axis, src, dst), nbytes in cells.items():
        sent = cost.ring_all_reduce(n, p, 8, src)[0]
        assert axis == "world"
        assert nbytes == (sent if dst == (src + 1) % p else 0)  # a ring sends only to its right


def test_comm_matrix_one_grid_per_mesh_axis():
    n = 6

    def fn(comm):
        mesh = emulator.Mesh(comm, dp=2, tp=2)
        collectives.all_reduce(mesh["tp"], np.ones(n), algorithm="ring")
        collectives.all_reduce(mesh["dp"], np.ones(2 * n), algorithm="ring")
        return rank_report(comm)["sent_to"]

    sent_to = emulator.spawn(fn, 4)
    cells = matrix(svg.comm_matrix_svg(sent_to))
    assert {a for a, _, _ in cells} == {"dp", "tp"}
    for (axis, src, dst), nbytes in cells.items():
        size = n if axis == "tp" else 2 * n
        partner = src ^ 1 if axis == "tp" else src ^ 2  # last mesh axis fastest: tp pairs 0-1
        want = cost.ring_all_reduce(size, 2, 8, 0)[0] if dst == partner else 0
        assert nbytes == want, (axis, src, dst)
    assert svg.comm_matrices(sent_to)["tp"][0][1] == 2 * (2 - 1) * n * 8 // 2  # 2(p-1)/p S


def test_comm_matrix_with_no_messages_is_an_error():
    with pytest.raises(ValueError, match="no message"):
        svg.comm_matrix_svg([{}, {}])
