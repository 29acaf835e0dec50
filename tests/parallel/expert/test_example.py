"""examples/07_expert_parallel.py passes on virtual ranks and under mpiexec -n 4 in both dispatch
modes and composed with tp or pp through the N-D program, fails loudly on a layout that cannot
split, and its verdict can fail (a planted bytes-formula error)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "07_expert_parallel.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"


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


@pytest.mark.parametrize("axis", ["--tp", "--pp"])
def test_composed_with_tp_or_pp_on_8_virtual_ranks(axis):
    """dp x ep x tp and dp x ep x pp are one command through the N-D program."""
    p = _run(8, "--dp", "2", "--ep", "2", axis, "2", "--steps", "2", "--dispatch", "padded")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "VERDICT: PASS" in p.stdout and "load tables = the reference's recount" in p.stdout


def test_planted_bytes_formula_error_fails_the_verdict(monkeypatch, capsys):
    """The example in-process with its bytes formula off by one byte: every rank reports the
    mismatch and rank 0's verdict fails (exit code 1)."""
    import runpy

    import emulator

    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), "--ep", "2", "--steps", "1"])
    main = runpy.run_path(str(EXAMPLE), run_name="example07")["main"]
    real = main.__globals__["layer_bytes"]

    def planted(*a):
        return {ph: (s + 1, r) for ph, (s, r) in real(*a).items()}

    monkeypatch.setitem(main.__globals__, "layer_bytes", planted)
    codes = emulator.spawn(main, 4, timeout=120)
    out = capsys.readouterr().out
    assert codes[0] == 1 and "VERDICT: FAIL" in out and "all-to-all bytes" in out, out[-1500:]


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_passes_under_mpiexec_4(mode):
    mpiexec = str(MPIEXEC) if MPIEXEC.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("no mpiexec")
    cmd = [mpiexec, "-n", "4", sys.executable, str(EXAMPLE), "--ep", "4", "--steps", "1",
           "--dispatch", mode]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env=env)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "VERDICT: PASS" in p.stdout and "imbalance max/mean" in p.stdout
