"""examples/06_nd_mesh.py --svg: the pictures parsed back with xml.etree and checked against
independent sources. The timeline's boxes, stage by stage in time order, are the schedule's
action list (parallel/pipeline/schedules.py, not the order the executor reported) and its idle
share is the closed-form bubble; the comm matrix's cells, summed per rank, are the byte ledger
the --json file holds (per group) and parallel/nd_cost.rank_bytes's formula times the steps,
and a rank only sends to ranks that differ from it in that axis's coordinate alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from fractions import Fraction
from pathlib import Path

import pytest

from emulator.model import ModelConfig
from parallel import Layout, nd_cost
from parallel.pipeline.bubble import Cost, bubble_formula
from parallel.pipeline.schedules import make_schedule

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "06_nd_mesh.py"
NS = "{http://www.w3.org/2000/svg}"
AXES = ("dp", "pp", "tp")  # the mesh's order: tp fastest (rank = (dp_c * pp + pp_c) * tp + tp_c)


def rects(path: Path, attr: str) -> list:
    root = ET.parse(path).getroot()  # also proves the file is well-formed XML
    return [r for r in root.iter(f"{NS}rect") if attr in r.attrib]


def coords(rank: int, dims: dict) -> dict:
    out = {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, dims[axis])
    return out


ZB = ["--schedule", "zb-h1", "--zero", "2", "--dp", "4", "--tp", "1"]  # zb-h1: tp = 1


@pytest.mark.parametrize("extra, schedule, v, zero, tp", [([], "1f1b", 1, 1, 2),
                                                          (["--schedule", "interleaved"],
                                                           "interleaved", 2, 1, 2),
                                                          (ZB, "zb-h1", 1, 2, 1)])  # fmt: skip
def test_the_pictures_are_the_schedule_and_the_ledger(tmp_path, extra, schedule, v, zero, tp):
    steps, dims, m = 2, {"dp": 8 // (2 * tp), "pp": 2, "tp": tp}, 4
    pic, js = tmp_path / "nd.svg", tmp_path / "nd.json"
    cmd = [sys.executable, "-m", "emulator", "run", "-n", "8", str(SCRIPT), "--steps", str(steps),
           "--svg", str(pic), "--json", str(js), *extra]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)  # fmt: skip
    out = proc.stdout[-1500:] + proc.stderr
    assert proc.returncode == 0 and "VERDICT: PASS" in proc.stdout, out
    assert f"SVG: {pic}" in proc.stdout and f"SVG: {tmp_path / 'nd-comm.svg'}" in proc.stdout

    # the timeline: per stage, the boxes in time order are the schedule's actions
    sched = make_schedule(schedule, 2, m, v)
    boxes = rects(pic, "data-kind")
    span = max(Fraction(b.get("data-start")) + Fraction(b.get("data-duration")) for b in boxes)
    for s in range(2):
        mine = sorted((b for b in boxes if b.get("data-rank") == str(s)),
                      key=lambda b: Fraction(b.get("data-start")))  # fmt: skip
        want = [f"{a.kind}{a.mb + 1}" + (f".{a.chunk}" if v > 1 else "") for a in sched.stages[s]]
        assert [b.find(f"{NS}title").text for b in mine] == want
        busy = sum(Fraction(b.get("data-duration")) for b in mine)
        assert (span - busy) / span == bubble_formula(sched, Cost(1, 1, 1))

    # the comm matrix: the ledger (--json) and the per-axis formula
    ledger = json.loads(js.read_text())["ranks"]
    cfg = ModelConfig(vocab_size=32, max_seq_len=16, d_model=16, n_heads=4, n_layers=2 * v)
    layout = Layout(**dims, zero=zero, schedule=schedule, chunks=v, microbatches=m)
    axes = [a for a in AXES if dims[a] > 1]  # a size-1 axis sends nothing: no grid
    cells = [(b.get("data-axis"), int(b.get("data-src")), int(b.get("data-dst")),
              int(b.get("data-bytes"))) for b in rects(tmp_path / "nd-comm.svg", "data-bytes")]  # fmt: skip
    assert {a for a, *_ in cells} == set(axes) and len(cells) == len(axes) * 8 * 8
    for r in range(8):
        row = [(a, dst, n) for a, src, dst, n in cells if src == r]
        want = nd_cost.rank_bytes(cfg, layout, 2 * dims["dp"] * m, 8, coords(r, dims))
        assert sum(n for *_, n in row) == steps * sum(want.values()) == ledger[r]["sent"]
        for axis in axes:
            got = sum(n for a, _, n in row if a == axis)
            assert got == ledger[r]["by_group"][axis]["sent"]
            # the clip norm's scalars ride on every axis's group: between 0 and all of them
            assert 0 <= got - steps * want[axis] <= steps * want["clip"]
            for a, dst, n in row:
                if a == axis and n:
                    diff = [x for x in AXES if coords(dst, dims)[x] != coords(r, dims)[x]]
                    assert diff == [axis], (r, dst, axis)
