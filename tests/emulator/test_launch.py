"""One script, two backends: `python -m emulator run -n P` and `mpiexec -n P`, and their failures."""

import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import emulator

    def main(comm):
        mode = sys.argv[1]
        p, r = comm.world_size, comm.rank
        got = comm.sendrecv(np.array([r]), (r + 1) % p, (r - 1) % p, shape=1, dtype=np.int64)
        if mode == "ok":
            print(f"rank {r} of {p} got {int(got[0])};", flush=True)
            return 0
        if mode == "fail-rank-1":
            return 1 if r == 1 else 0
        if mode == "raise":
            if r == 1:
                raise RuntimeError("rank one exploded")
            comm.recv((r + 1) % p, shape=1, dtype=np.int64)
        if mode == "mismatch":
            with comm.collective("all_reduce", "ring" if r else "tree", np.ones(2)):
                pass
        if mode == "hang":
            if r == 0:
                comm.recv(1, shape=1, dtype=np.int64)
        if mode == "stray":
            if r == 0:
                comm.send(np.ones(2), 1)  # never received
        return 0

    sys.exit(emulator.launch(main, world_size=3, timeout=2))
    """
)


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = Path(tmp_path_factory.mktemp("launch")) / "spmd.py"
    path.write_text(SCRIPT)
    return path


def lines(stdout: str) -> list[str]:
    return sorted(re.findall(r"rank \d+ of \d+ got \d+", stdout))


def expected(n: int) -> list[str]:
    return sorted(f"rank {r} of {n} got {(r - 1) % n}" for r in range(n))


def run(cmd, timeout=60):
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout)


def test_runner_sets_the_world_size(script):
    out = run([sys.executable, "-m", "emulator", "run", "-n", "5", str(script), "ok"])
    assert out.returncode == 0, out.stderr
    assert lines(out.stdout) == expected(5)


def test_plain_python_uses_the_scripts_default(script):
    out = run([sys.executable, str(script), "ok"])
    assert out.returncode == 0 and out.stdout.count("of 3 got") == 3


def test_one_failing_rank_fails_the_run(script):
    out = run([sys.executable, "-m", "emulator", "run", "-n", "3", str(script), "fail-rank-1"])
    assert out.returncode == 1


def test_runner_reports_the_original_exception(script):
    out = run([sys.executable, "-m", "emulator", "run", "-n", "3", str(script), "raise"])
    assert out.returncode != 0
    assert "RuntimeError: rank one exploded" in out.stderr
    assert "raised on virtual rank 1 of 3" in out.stderr


def test_runner_reports_an_unreceived_message(script):
    out = run([sys.executable, "-m", "emulator", "run", "-n", "3", str(script), "stray"])
    assert out.returncode != 0
    assert "UnreceivedMessage: the run ended with message(s) sent but never received" in out.stderr
    assert "rank 0 -> rank 1 in group 'world', point-to-point: 16 bytes (float64[2])" in out.stderr


def test_runner_rejects_zero_ranks(script):
    out = run([sys.executable, "-m", "emulator", "run", "-n", "0", str(script), "ok"])
    assert out.returncode == 2 and "argument -n: got 0; need an integer >= 1" in out.stderr


MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")


@needs_mpi
@pytest.mark.parametrize("n", [2, 4])
def test_same_script_under_mpiexec(script, n):
    out = run([MPIEXEC, "-n", str(n), sys.executable, str(script), "ok"])
    assert out.returncode == 0, out.stderr
    assert lines(out.stdout) == expected(n)


@needs_mpi
def test_mpi_failure_exits_nonzero(script):
    out = run([MPIEXEC, "-n", "2", sys.executable, str(script), "fail-rank-1"])
    assert out.returncode != 0


@needs_mpi
def test_mpi_exception_aborts_the_job_with_the_original_error(script):
    out = run([MPIEXEC, "-n", "3", sys.executable, str(script), "raise"])
    assert out.returncode != 0
    assert "[rank 1] failed" in out.stderr and "RuntimeError: rank one exploded" in out.stderr


@needs_mpi
def test_mpi_mismatch_is_reported_on_every_rank(script):
    out = run([MPIEXEC, "-n", "2", sys.executable, str(script), "mismatch"])
    assert out.returncode != 0
    assert "CollectiveMismatch: collective mismatch in group 'world': rank 0 called" in out.stderr
    assert "algorithm='tree'" in out.stderr


@needs_mpi
def test_mpi_hang_times_out_with_the_flight_recorder(script):
    out = run([MPIEXEC, "-n", "2", sys.executable, str(script), "hang"])
    assert out.returncode != 0
    assert "CommTimeout: rank 0 waited 2 s to receive from rank 1" in out.stderr
    assert "rank 0: last completed none; current none (in user code)" in out.stderr
