"""Every command line with bad values: one clean line on stderr naming the flag and the value,
exit code 2 (argparse's), nothing on stdout, no traceback; and `--help` never runs an example.

Every case stops while parsing its flags, before any rank starts. They run in this process
(`tools.cli.main(argv)`, or the example through runpy as `__main__`, stderr captured) to stay
fast; a few run as real subprocesses (and under mpiexec), where the exit code is the process's.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EX = {n[:2]: str(p) for n, p in ((p.name, p) for p in (ROOT / "examples").glob("0*.py"))}
PY = [sys.executable]
EMU = [*PY, "-m", "emulator"]


def run(cmd, timeout=120, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)  # fmt: skip


class Out:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def in_process(cmd, capsys):
    """cmd as a subprocess would run it, in this interpreter: -> Out(code, stdout, stderr)."""
    from tools import cli

    argv, saved = list(cmd[1:]), sys.argv
    try:
        if argv[:2] == ["-m", "emulator"]:
            code = cli.main(argv[2:])
        else:
            sys.argv = argv
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = saved
    got = capsys.readouterr()
    return Out(code, got.out, got.err)


# (command, words the one line must contain: the flag, the value, what would be valid)
CASES = [
    ([*EMU, "run", "-n", "0", EX["01"]], ["-n", "got 0", ">= 1"]),
    ([*EMU, "run", "-n", "100000", EX["01"]], ["-n", "100000", "at most", "virtual ranks"]),
    ([*EMU, "run", EX["01"], "-n", "4"], ["-n", "before the script"]),
    ([*EMU, "run", EX["01"]], ["-n", "required"]),
    ([*EMU, "run", "-n", "2", "no_such_script.py"], ["script", "no_such_script.py"]),
    ([*EMU, "tour", "--only", "nothing"], ["--only", "nothing", "01_collectives.py"]),
    ([*EMU, "tour", "--timeout", "0"], ["--timeout", "got 0", "> 0"]),
    ([*EMU, "bench", "nothing"], ["what", "nothing", "collectives"]),
    ([*EMU, "bench", "collectives", "--min", "0"], ["--min", "got 0", ">= 1"]),
    ([*EMU, "bench", "collectives", "--min", "100", "--max", "50"], ["--max", "50", "--min 100"]),
    ([*EMU, "bench", "collectives", "--ranks", "0"], ["--ranks", "got 0", ">= 1"]),
    ([*EMU, "bench", "collectives", "--ops", "all_sum"], ["--ops", "all_sum", "all_reduce"]),
    ([*EMU, "bench", "model", "--repeats", "0"], ["--repeats", "got 0", ">= 1"]),
    ([*EMU, "bench", "layouts", "--ranks", "0"], ["--ranks", "got 0", ">= 1"]),
    ([*EMU, "bench", "layouts", "--batch", "10"], ["--batch", "10", "--ranks 4"]),
    ([*PY, EX["01"], "--bogus"], ["unrecognized", "--bogus"]),
    ([*PY, EX["01"], "--sizes", "7,x"], ["--sizes", "7,x", "element counts"]),
    ([*PY, EX["02"], "--steps", "0"], ["--steps", "got 0", ">= 1"]),
    ([*PY, EX["02"], "--heads", "3"], ["--d-model", "32", "--heads 3"]),
    ([*PY, EX["02"], "--seed", "-1"], ["--seed", "got -1", ">= 0"]),
    ([*PY, EX["02"], "--json", "/no/such/dir/x.json"], ["--json", "/no/such/dir"]),
    ([*PY, EX["03"], "--steps", "-2"], ["--steps", "got -2", ">= 1"]),
    ([*PY, EX["03"], "--microbatches", "0"], ["--microbatches", "got 0", ">= 1"]),
    ([*PY, EX["03"], "--prefetch"], ["--prefetch", "no effect", "--stage 3"]),
    ([*PY, EX["03"], "--stage", "4"], ["--stage", "'4'", "ddp"]),
    ([*PY, EX["03"], "--batch", "10"], ["--batch", "10", "multiple of 8"]),
    ([*PY, EX["04"], "--top-k", "3"], ["--top-k", "3", "no effect without --moe"]),
    ([*PY, EX["04"], "--microbatches", "0"], ["--microbatches", "got 0", ">= 1"]),
    ([*PY, EX["04"], "--tp", "3"], ["--tp", "3", "--heads 8"]),
    ([*PY, EX["04"], "--dp-stage", "1"], ["--dp-stage", "no effect", "--dp 1"]),
    ([*PY, EX["05"], "--steps", "0"], ["--steps", "got 0", ">= 1"]),
    ([*PY, EX["05"], "--chunks", "3"], ["--chunks", "3", "interleaved"]),
    ([*PY, EX["05"], "--pp", "0"], ["--pp", "got 0", ">= 1"]),
    ([*PY, EX["05"], "--max-norm", "nan"], ["--max-norm", "nan", "finite"]),
    ([*EMU, "run", "-n", "4", EX["05"], "--pp", "2"], ["--pp 2", "needs 2 ranks", "has 4"]),
    ([*PY, EX["06"], "--zero", "4"], ["--zero", "4", "choose from"]),
    ([*PY, EX["06"], "--tp", "0"], ["--tp", "got 0", ">= 1"]),
    ([*PY, EX["06"], "--prefetch"], ["--prefetch", "no effect", "--zero 1"]),
    ([*PY, EX["06"], "--chunks", "2"], ["--chunks", "2", "interleaved"]),
    ([*PY, EX["06"], "--tp", "1", "--sequence-parallel"], ["--sequence-parallel", "--tp 1"]),
    ([*PY, EX["06"], "--batch", "10"], ["--batch", "10", "--microbatches 4 = 8"]),
    ([*PY, EX["06"], "--heads", "3"], ["--d-model", "16", "--heads 3"]),
    ([*PY, EX["06"], "--seed", "x"], ["--seed", "'x'", ">= 0"]),
    ([*EMU, "run", "-n", "4", EX["06"]], ["--tp 2", "needs 8 ranks", "has 4"]),
    ([*PY, EX["07"], "--ep", "3"], ["--ep", "ep=3", "divide the 4", "[1, 2, 4]"]),
    ([*PY, EX["07"], "--top-k", "9"], ["--top-k", "9", "1..E=8"]),
    ([*PY, EX["07"], "--experts", "6"], ["--experts 6", "ep=4", "[1, 2, 3, 6]"]),
    ([*PY, EX["07"], "--capacity-factor", "0"], ["--capacity-factor", "got 0", "> 0"]),
    ([*PY, EX["07"], "--batch", "10"], ["--batch 10", "D=4", "multiple of 8"]),
    ([*EMU, "run", "-n", "4", EX["07"], "--dp", "2"], ["--dp 2 x --ep 4", "needs 8", "has 4"]),
    ([*PY, EX["08"], "--cp", "3", "--seq", "20"], ["--seq 20", "--cp 3", "divisible by 6"]),
    (
        [*PY, EX["08"], "--cp", "3", "--seq", "24", "--method", "ulysses"],
        ["--heads 8", "--cp 3", "not divisible"],
    ),
    ([*PY, EX["08"], "--batch", "3", "--dp", "2", "--cp", "2"], ["--batch", "3", "= 2"]),
    ([*PY, EX["08"], "--microbatches", "0"], ["--microbatches", "got 0", ">= 1"]),
    ([*EMU, "run", "-n", "2", EX["08"], "--cp", "4"], ["--cp 4", "needs 4 ranks", "has 2"]),
]


def assert_one_clean_line(out, words):
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == "", (out.stdout, out.stderr)
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("cmd, words", CASES, ids=[" ".join(c[0][2:])[-60:] for c in CASES])
def test_bad_value_is_one_line_and_exit_2(cmd, words, capsys):
    assert_one_clean_line(in_process(cmd, capsys), words)


@pytest.mark.parametrize("case", [2, 15, 26], ids=lambda i: " ".join(CASES[i][0][2:])[-50:])
def test_as_a_process_too(case):
    cmd, words = CASES[case]
    assert_one_clean_line(run(cmd), words)


@pytest.mark.parametrize("ex", sorted(EX))
def test_help_does_not_run_the_example(ex, capsys):
    out = in_process([*PY, EX[ex], "--help"], capsys)
    assert out.returncode == 0 and "usage:" in out.stdout
    assert "VERDICT" not in out.stdout and "--seed" in out.stdout and "--json" in out.stdout


def test_an_error_inside_a_run_is_one_message_with_its_rank(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "import sys\nfrom tools import args as cli\nfrom tools.run import run_example\n"
        "def main(comm):\n    if comm.rank == 1:\n        raise ValueError('layout refused')\n"
        "    comm.barrier()\n"
        "p = cli.parser('boom')\ncli.add_common(p)\na = cli.parse(p)\n"
        "sys.exit(run_example(main, a, world_size=3))\n"
    )
    out = run([*EMU, "run", "-n", "3", str(script)])
    assert out.returncode == 1 and "Traceback" not in out.stderr
    first = out.stderr.strip().splitlines()[0]
    assert first == "error (raised on virtual rank 1 of 3): ValueError: layout refused", first
    assert out.stderr.count("layout refused") == 1
    out = run([*EMU, "run", "-n", "3", str(script), "--debug"])
    assert out.returncode == 1 and "Traceback" in out.stderr and "layout refused" in out.stderr


MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")


@needs_mpi
def test_under_mpiexec_a_bad_value_is_printed_once():
    assert_one_clean_line(run([MPIEXEC, "-n", "3", *PY, EX["02"], "--steps", "0"]), ["--steps"])


@needs_mpi
@pytest.mark.parametrize("ex, bad, flag", [("06", ["--zero", "1", "--prefetch"], "--prefetch"),
                                           ("07", ["--ep", "3"], "--ep"),
                                           ("08", ["--cp", "3", "--seq", "20"], "--seq 20")])  # fmt: skip
def test_under_mpiexec_a_bad_value_of_06_07_08_is_printed_once(ex, bad, flag):
    assert_one_clean_line(run([MPIEXEC, "-n", "4", *PY, EX[ex], *bad]), [flag])


@needs_mpi
def test_run_n_under_mpiexec_is_refused_once():
    out = run([MPIEXEC, "-n", "2", *EMU, "run", "-n", "4", EX["01"]])
    assert_one_clean_line(out, ["-n", "4", "mpiexec", "started 2"])


@needs_mpi
def test_example_02_under_mpiexec_prints_once():
    out = run([MPIEXEC, "-n", "3", *PY, EX["02"], "--steps", "5"])
    assert out.stdout.count("VERDICT:") == 1 and out.stdout.count("parameters; batch") == 1


@needs_mpi
@pytest.mark.parametrize("mode, rank", [("all", 0), ("one", 1)])
def test_an_error_under_mpiexec_is_printed_once_with_its_rank(tmp_path, mode, rank):
    script = tmp_path / "boom.py"
    script.write_text(
        "import sys\nfrom tools import args as cli\nfrom tools.run import run_example\n"
        "def main(comm):\n    if sys.argv[1] == 'all' or comm.rank == 1:\n"
        "        raise ValueError('layout refused')\n    comm.barrier()\n"
        "p = cli.parser('boom')\np.add_argument('mode')\ncli.add_common(p)\na = cli.parse(p)\n"
        "sys.exit(run_example(main, a))\n"
    )
    out = run([MPIEXEC, "-n", "3", *PY, str(script), mode])
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.count("layout refused") == 1, out.stderr
    assert f"error (rank {rank} of 3): ValueError: layout refused" in out.stderr
