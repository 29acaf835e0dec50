"""MPI faults end in a named error on every rank, within the timeout (issue: the fault catalogue).

Each case is a faulty program in tests/mpi/faults.py, run under `mpiexec -n 2` and `-n 4` in a
subprocess (a fault must be able to end the job). Every rank writes the error it ended in; the
expectations are the texts a user should see - both sides of a mismatch, the missing rank of a
hang, the sender, receiver and size of a stray message - never a numpy traceback or a hang.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FAULTS = Path(__file__).resolve().parents[1] / "mpi" / "faults.py"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")


def ranks_end_in(case: str, n: int, tmp_path: Path) -> list[str]:
    """Run the case on n MPI ranks; every rank's final line (its error, or OK)."""
    out = subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, str(FAULTS), case, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    files = [tmp_path / f"rank{r}.txt" for r in range(n)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"{case}: no verdict from {missing}\n{out.stdout}\n{out.stderr}"
    return [f.read_text() for f in files]


def launched(case: str, n: int):
    cmd = [MPIEXEC, "-n", str(n), sys.executable, str(FAULTS), case, "--launch"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("n", [2, 4])
def test_group_in_another_order_is_a_mismatch_on_every_rank(n, tmp_path):
    ends = ranks_end_in("group_order", n, tmp_path)
    rev = list(range(n))[::-1]
    assert all(e.startswith("CollectiveMismatch: group mismatch: rank ") for e in ends), ends
    assert all(f"over world ranks {rev}" in e and f"{list(range(n))}" in e for e in ends), ends


@pytest.mark.parametrize("n", [2, 4])
def test_group_of_other_members_ends_named_on_every_rank(n, tmp_path):
    ends = ranks_end_in("group_members", n, tmp_path)
    last = n - 1
    for r in (0, last):  # the two that exchanged their views name both
        assert ends[r].startswith("CollectiveMismatch: group mismatch"), ends[r]
        assert f"world ranks [{last}, 0]" in ends[r] and f"{list(range(n))}" in ends[r]
    for e in ends[1:last]:  # the others wait for the last rank, which never joins: named
        assert e.startswith("CommTimeout: ") and f"rank(s) [{last}] never arrived" in e, e


@pytest.mark.parametrize("n", [2, 4])
def test_rank_skipping_group_is_named_by_every_rank(n, tmp_path):
    ends = ranks_end_in("group_skip", n, tmp_path)
    last = n - 1
    for e in ends[:last]:
        assert e.startswith("CommTimeout: ") and "to create group 'world" in e, e
        assert f"rank(s) [{last}] never arrived" in e, e
    assert ends[last].startswith(f"CommTimeout: rank {last} waited 2 s to check collective all_")
    assert f"rank(s) {list(range(last))} never arrived" in ends[last]


def test_mesh_axes_in_another_order_is_a_mismatch(tmp_path):
    ends = ranks_end_in("mesh_swap", 4, tmp_path)
    assert all(e.startswith("CollectiveMismatch: group mismatch") for e in ends), ends
    assert all("group 'tp'" in e and "group 'dp'" in e for e in ends), ends


@pytest.mark.parametrize(
    "case,n,want,sent",
    [
        ("recv_dtype", 2, "int64[4] (32 bytes)", "float64[4] (32 bytes)"),
        ("recv_dtype", 4, "int64[4] (32 bytes)", "float64[4] (32 bytes)"),
        ("recv_shape", 2, "float64[8] (64 bytes)", "float64[2, 4] (64 bytes)"),
    ],
)
def test_receive_of_another_dtype_or_shape_names_both_sides(case, n, want, sent, tmp_path):
    ends = ranks_end_in(case, n, tmp_path)
    for r in range(1, n, 2):  # the receivers
        assert ends[r].startswith(
            f"CommError: rank {r} expected {want} from rank {r - 1} in group 'world' but rank "
            f"{r - 1} sent {sent}"
        ), ends[r]
    odd = list(range(1, n, 2))
    for r in range(0, n, 2):  # the senders: their receivers never reach the end of the run
        assert ends[r].startswith("CommTimeout: ") and f"rank(s) {odd} never arrived" in ends[r]


@pytest.mark.parametrize("n", [2, 4])
def test_stray_send_is_not_consumed_and_is_named_at_the_end(n, tmp_path):
    # faults.stray asserts the broadcast got the root's value, not the stray -7
    ends = ranks_end_in("stray", n, tmp_path)
    line = (
        "rank 0 sent 1 message(s) (8 bytes) to rank 1 in group 'world' that rank 1 never received"
    )
    assert all(e.startswith("CommError: messages left over") and line in e for e in ends), ends


def test_stray_send_inside_a_collective_is_named(tmp_path):
    ends = ranks_end_in("stray_in_collective", 2, tmp_path)
    assert ends[1].startswith(
        "CommError: rank 0 sent rank 1 a message of 16 bytes in custom#0(algorithm='buggy'"
    ), ends  # at the collective's end (faults.py waits until the message is there)
    assert ends[0].startswith("CommTimeout: ") and "rank(s) [1] never arrived" in ends[0], ends


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "case,counted",
    [("barrier_vs_barrier", "barrier#0("), ("objects_vs_all_reduce", "all_reduce#0(")],
)
def test_control_plane_call_against_a_collective_is_a_mismatch(case, counted, n, tmp_path):
    ends = ranks_end_in(case, n, tmp_path)
    for e in ends:
        assert e.startswith("CollectiveMismatch: collective mismatch in group 'world'"), e
        assert "a control-plane object gather" in e and counted in e, e
        assert not re.search(r"EiB|negative dimensions", e)


@pytest.mark.parametrize("n", [2, 4])
def test_mismatch_is_named_even_when_the_data_plane_fails_first(n, tmp_path):
    # the check's labels travel beside the data: rank 0's ring message reaches a tree rank (a
    # size error there), a tree message reaches rank 0 or never comes - every rank must still
    # end in the mismatch, naming both calls
    ends = ranks_end_in("ring_vs_tree", n, tmp_path)
    for e in ends:
        assert e.startswith("CollectiveMismatch: collective mismatch in group 'world'"), e
        assert "algorithm='ring'" in e and "algorithm='tree'" in e, e


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "case,calls",
    [
        ("small_tree_vs_double_tree", ("algorithm='tree'", "algorithm='double_tree'")),
        ("small_shape", ("float32[1024]", "float32[1025]")),
    ],
)
def test_small_message_mismatch_is_named_on_every_rank(case, calls, n, tmp_path):
    # the lean small-message path keeps the check: every rank names both calls
    for e in ranks_end_in(case, n, tmp_path):
        assert e.startswith("CollectiveMismatch: collective mismatch in group 'world'"), e
        assert all(c in e for c in calls), e


@pytest.mark.parametrize("n", [2, 4])
def test_hard_exit_of_a_rank_fails_the_job_naming_it(n):
    out = launched("hard_exit", n)
    assert out.returncode != 0, out.stderr
    assert "[rank 1] failed: the rank exited with code 0 before the end-of-run handshake" in (
        out.stderr
    ), out.stderr


def test_killed_rank_fails_the_job_naming_it():
    out = launched("killed", 2)
    assert out.returncode != 0, out.stderr
    assert "[rank 1] failed: the rank was killed by signal 9" in out.stderr, out.stderr


def test_stray_send_fails_a_launched_job(tmp_path):
    out = launched("stray", 2)
    assert out.returncode != 0
    assert "to rank 1 in group 'world' that rank 1 never received" in out.stderr, out.stderr


def test_5000_group_creations(tmp_path):
    ends = ranks_end_in("many_groups", 2, tmp_path)
    assert ends == ["OK", "OK"], ends


@pytest.mark.parametrize("bad", ["float('nan')", "0", "-1"])
def test_launch_refuses_a_bad_timeout_under_mpi(bad):
    code = f"import emulator; emulator.launch(lambda comm: 0, timeout={bad})"
    out = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert "ValueError: launch: timeout must be positive seconds" in out.stderr, out.stderr


def test_second_launch_in_one_process_is_refused():
    # one write per line (atomic on a pipe): two ranks' print() calls interleave their pieces
    code = ("import sys, emulator; sys.stdout.write(f'first {emulator.launch(lambda c: 0)}\\n'); "
            "sys.stdout.flush(); emulator.launch(None)")  # fmt: skip
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and out.stdout.count("first 0") == 2, out.stdout
    # each rank's traceback reaches the shared stderr pipe in pieces, so the two may interleave
    # ("...per processlaunch: under..."): the error's name and its text, each looked for alone
    assert "RuntimeError" in out.stderr, out.stderr
    assert "launch: under mpiexec a script calls launch() once per process" in out.stderr
