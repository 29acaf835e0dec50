"""Examples 03-05 refuse counts < 1 with an argparse one-line error (exit 2) instead of an
IndexError / ZeroDivisionError inside the ranks, and a run that compared nothing is a SKIP that
neither the example nor the tour counts as a pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import tour

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [("03_data_parallel.py", ["--steps", "0"], "argument --steps: got 0; need an integer >= 1 (see --help)"),
     ("04_tensor_parallel.py", ["--microbatches", "0"], "argument --microbatches: got 0; need an integer >= 1 (see --help)"),
     ("05_pipeline.py", ["--steps", "-1"], "argument --steps: got -1; need an integer >= 1 (see --help)"),
     ("05_pipeline.py", ["--microbatches", "0"], "argument --microbatches: got 0; need an integer >= 1 (see --help)")],
)  # fmt: skip
def test_bad_counts_are_a_one_line_usage_error(script, args, message):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True,
                          text=True, timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"{script}: error: {message}"
    assert "Traceback" not in proc.stderr


def test_a_verdict_that_compared_nothing_is_a_skip_and_not_passed(monkeypatch, capsys):
    """04 --tp 2 --dp 2 --moe --dtype mixed (K = 2) flips a near tie at step 0: it used to
    print PASS with "no loss, gradient or parameter is comparable" and exit 0."""
    args = ["--tp", "2", "--dp", "2", "--moe", "--dtype", "mixed", "--steps", "1"]
    monkeypatch.setattr(tour, "RUNS", [("04_tensor_parallel.py", 4, args)])
    assert tour.tour() == 1
    out = capsys.readouterr().out
    assert out.startswith("SKIP  04_tensor_parallel.py -n 4") and "flipped at step 0" in out
    assert "tour: 0 of 1 runs passed" in out
