"""tools/run.py: the --json report (every rank's bytes = the ring formula, the verdict), the step
counter (on a terminal only), and one message for an error inside a run."""

from __future__ import annotations

import io
import json
from argparse import Namespace

import numpy as np

import collectives
from collectives import cost
from tools import run as R


def test_json_report_has_every_ranks_bytes_and_the_verdict(tmp_path):
    path, n, p = tmp_path / "out.json", 10, 3

    def main(comm):
        collectives.all_reduce(comm, np.ones(n), algorithm="ring")
        if comm.rank == 0:
            R.say_verdict([], "ring all-reduce", elements=n)
        return 0

    args = Namespace(json=str(path), debug=False, seed=0)
    assert R.run_example(main, args, world_size=p) == 0
    got = json.loads(path.read_text())
    assert got["world_size"] == p and got["passed"] and got["verdict"].startswith("VERDICT: PASS")
    assert got["figures"]["elements"] == n and got["flags"] == {"seed": 0}
    for r, rank in enumerate(got["ranks"]):
        sent, recv = cost.ring_all_reduce(n, p, 8, r)
        assert (rank["rank"], rank["sent"], rank["recv"]) == (r, sent, recv)
        assert rank["sent_to"] == {"world": {str((r + 1) % p): sent}}  # a ring's right neighbour
        assert set(rank["memory"]) == {"current", "peak", "peak_total"}


def test_an_error_inside_the_run_is_one_message_naming_the_rank(capsys):
    def main(comm):
        if comm.rank == 2:
            raise ValueError("layout refused: tp=3 does not divide 8 heads")
        comm.barrier()

    assert R.run_example(main, Namespace(debug=False), world_size=3) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0] == (
        "error (raised on virtual rank 2 of 3): ValueError: layout refused: tp=3 does not "
        "divide 8 heads"
    )
    assert "Traceback" not in err and err.count("layout refused") == 1
    assert R.run_example(main, Namespace(debug=True), world_size=3) == 1
    assert "Traceback" in capsys.readouterr().err


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_counts_steps_on_a_terminal_and_is_silent_when_piped():
    def batches(step):
        return step * 10

    tty, pipe = Tty(), io.StringIO()
    shown = R.progress(batches, 3, "step", stream=tty)
    assert [shown(s) for s in range(3)] == [0, 10, 20]  # the data is untouched
    assert [f"step {k}/3" in tty.getvalue() for k in (1, 2, 3)] == [True] * 3
    assert R.progress(batches, 3, stream=pipe) is batches and pipe.getvalue() == ""
    R.progress_done()
    assert tty.getvalue().endswith("\r\x1b[K")  # the counter clears its line at the end
