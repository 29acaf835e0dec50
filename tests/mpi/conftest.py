"""MPI-only tests: run with `mpiexec -n 2 python -m pytest tests/mpi -q` (or -n 4).

Under plain pytest every test here is skipped. One world communicator per process (session
fixture). Each test does all of its communication first and asserts last, so a failing assert
on one rank never leaves another rank blocked in a native call; our own calls time out.
"""

from __future__ import annotations

import pytest

import emulator

REASON = "needs mpiexec: mpiexec -n 4 python -m pytest tests/mpi -q"


def pytest_collection_modifyitems(config, items):
    if not emulator.under_mpi():
        for item in items:
            if "tests/mpi" in str(item.fspath).replace("\\", "/"):
                item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(scope="session")
def comm():
    from emulator.mpi import world_comm

    return world_comm(timeout=30)


@pytest.fixture(scope="session")
def MPI():
    from mpi4py import MPI

    return MPI
