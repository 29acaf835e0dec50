"""`bench collectives` under mpiexec, with `--unchecked`: it runs, prints the three extra
columns, and its own check holds (the unchecked world moved the same messages and bytes as the
checked one, else it exits 1). A smoke test: no timings are asserted; the machine is shared."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
ROOT = Path(__file__).resolve().parents[2]
VARS = ("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", "MPIR_CVAR_REDUCE_SCATTER_BLOCK_INTRA_ALGORITHM")
HINT = ("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring (or tree, recursive_doubling, "
        "reduce_scatter_allgather) times MPICH's own version of one")  # fmt: skip


def _run(cmd, env):
    base = {k: v for k, v in os.environ.items() if k not in VARS}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False, env={**base, **env})  # fmt: skip


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")
def test_unchecked_columns_under_mpi():
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "benchmarks.collectives", "--max", "16384",
           "--ops", "all_reduce,reduce_scatter", "--rounds", "1", "--unchecked"]  # fmt: skip
    out = _run(cmd, {})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1] == "native: all_reduce MPICH's choice, reduce_scatter MPICH's choice; " + HINT
    head = next(ln for ln in lines if ln.strip().startswith("op"))
    assert head.split()[-3:] == ["us", "unchecked/native", "unchecked/ours"], head
    rows = [ln.split() for ln in lines if ln.split()[:1] in (["all_reduce"], ["reduce_scatter"])]
    assert len(rows) == 2 * 2, out.stdout  # 2 ops x (4 KiB, 16 KiB)
    for row in rows:  # ... ratio min / med / max, unchecked us, two more min / med / max
        assert len(row) == 3 + 6 + 5 + 1 + 5 + 5, row
        assert float(row[-11]) > 0, row


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")
def test_the_native_algorithm_mpich_was_told_is_named():
    """MPICH's own ring beside ours: the table names the algorithms MPICH was told to run."""
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "benchmarks.collectives", "--max", "4096",
           "--ops", "all_reduce,reduce_scatter", "--rounds", "1"]  # fmt: skip
    out = _run(cmd, {VARS[0]: "ring", VARS[1]: "recursive_halving"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[1] == (
        f"native: all_reduce ring ({VARS[0]}=ring), "
        f"reduce_scatter recursive_halving ({VARS[1]}=recursive_halving)"
    ), out.stdout


def test_the_native_note_outside_mpich():
    from benchmarks.collectives import native_note

    note = native_note("Open MPI v5.0.5, package: Open MPI\n...", {VARS[0]: "ring"}, ["all_reduce"])
    assert (
        note == f"native: Open MPI v5.0.5, package: Open MPI's own choice of algorithms; "
        f"{VARS[0]}=ring: MPICH's, no effect here"
    )


def test_unchecked_on_virtual_ranks_is_a_one_line_error(capsys):
    from benchmarks import collectives

    with pytest.raises(SystemExit) as exc:
        collectives.main(["--unchecked", "--max", "4096"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "mpiexec -n P" in err[0], err
