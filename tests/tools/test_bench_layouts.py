"""`bench layouts` runs its interleaved rounds and its cost profile (a smoke test: no timings
are asserted; the machine is shared)."""

import pytest

from benchmarks import layout_costs, layouts
from benchmarks.model import bench_model


def test_one_round_prints_the_row_with_its_ratio(capsys):
    assert layouts.main(["--size", "small", "--rounds", "1", "--only", "dp2 x tp2"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("dp2 x tp2"))
    ratio = row.split()[-3]  # min/med/max of one round: three equal numbers
    assert len(set(ratio.split("/"))) == 1, row


def test_costs_categories_cover_the_profile():
    case = next(c for c in layouts.cases() if c.label == "DDP")
    cats, records = layout_costs.profile(case, "small")
    assert records > 0 and cats["model NumPy (ops, block, model)"] > 0
    assert set(cats) <= {c for c, _ in layout_costs.CATEGORIES} | {"other Python"}
    ref = layout_costs.reference_profile(case, "small")  # same categories, no messages
    assert ref["model NumPy (ops, block, model)"] > 0
    assert ref.get("message path (emulator/, collectives/)", 0.0) == 0.0


def test_bench_model_against_a_missing_file_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_model(["--against", "no_such_ops.py"])
    got = capsys.readouterr()
    assert exc.value.code == 2 and got.out == ""
    assert "--against" in got.err and "no_such_ops.py" in got.err
