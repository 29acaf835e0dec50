"""`bench collectives` under mpiexec, with `--unchecked`: it runs, prints the three extra
columns, and its own check holds (the unchecked world moved the same messages and bytes as the
checked one, else it exits 1). A smoke test: no timings are asserted; the machine is shared."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")
def test_unchecked_columns_under_mpi():
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "benchmarks.collectives", "--max", "16384",
           "--ops", "all_reduce,reduce_scatter", "--rounds", "1", "--unchecked"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    head = next(ln for ln in lines if ln.strip().startswith("op"))
    assert head.split()[-3:] == ["us", "unchecked/native", "unchecked/ours"], head
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["all_reduce"], ["reduce_scatter"])]
    assert len(rows) == 2 * 2, out.stdout  # 2 ops x (4 KiB, 16 KiB)
    for row in rows:  # ... ratio min / med / max, unchecked us, two more min / med / max
        assert len(row) == 3 + 6 + 5 + 1 + 5 + 5, row
        assert float(row[-11]) > 0, row


def test_unchecked_on_virtual_ranks_is_a_one_line_error(capsys):
    from benchmarks import collectives

    with pytest.raises(SystemExit) as exc:
        collectives.main(["--unchecked", "--max", "4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "mpiexec -n P" in err[0], err
