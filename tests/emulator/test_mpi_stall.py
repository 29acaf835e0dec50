"""A mismatch that stalls the data plane is still named on every rank under MPI.

The collective check's label is posted lazily (right after a call's first data send, or before
its first wait: emulator.mpi). A call whose every rank receives first sends nothing before it
blocks, so only the post before the wait lets the others see its label at once: without it
every rank would wait out its timeout (30 s here: the case is in faults.PROMPT) before the
failure path posts the label and the mismatch is named."""

from __future__ import annotations

import re
import time

import pytest

from .test_mpi_faults import MPIEXEC, ranks_end_in

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install '.[mpi]')")


@pytest.mark.parametrize("n", [2, 4])
def test_mismatch_where_every_rank_receives_first_is_named(n, tmp_path):
    start = time.monotonic()
    ends = ranks_end_in("every_rank_receives_first", n, tmp_path)
    took = time.monotonic() - start
    assert took < 20, f"the mismatch took {took:.1f} s to be named (the timeout is 30 s)"
    for r, e in enumerate(ends):
        assert e.startswith("CollectiveMismatch: collective mismatch in group 'world'"), e
        roots = re.findall(r"root=(\d+)\)", e)  # its own call, then another rank's
        assert len(roots) == 2 and roots[0] == str(r) and roots[1] != roots[0], e
