"""Run one SPMD program on either backend, unchanged.

An example script ends with `sys.exit(emulator.launch(main))`, where `main(comm)` returns 0 (or
None / True) on success. Then:

    mpiexec -n 4 python script.py               -> MPI, one process per rank
    python -m emulator run -n 16 script.py      -> 16 virtual ranks in one process
    python script.py                            -> virtual ranks, the script's default count

The backend is chosen from how the process was started (an MPI launcher sets PMI_* / OMPI_*
variables in the environment), never from a feature switch.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from .local import DEFAULT_TIMEOUT, spawn

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")

# Set by `python -m emulator run -n P` for the script it runs (the runner's argument, not an
# environment variable, so nested programs are not affected).
requested_world_size: int | None = None


def under_mpi() -> bool:
    """True when this process was started by an MPI launcher (mpiexec / mpirun / srun)."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def launch(main, world_size: int = 4, timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> int:
    """Run `main(comm)` on every rank; return a process exit code (0 only if all ranks passed)."""
    if under_mpi():
        return _launch_mpi(main, timeout, check)
    n = requested_world_size or world_size
    results = spawn(main, n, timeout=timeout, check=check)
    return 0 if all(_ok(r) for r in results) else 1


def _ok(result) -> bool:
    return result is None or result is True or result == 0


def _launch_mpi(main, timeout: float, check: bool) -> int:
    from .mpi import _mpi, world_comm

    MPI = _mpi()
    comm = world_comm(timeout, check)
    try:
        # The end-of-run handshake (uncounted): every rank's verdict, and no message left over.
        every = comm.world.finish(comm, _ok(main(comm)))
    except BaseException:  # noqa: BLE001 - one failing rank must stop the whole job
        sys.stderr.write(f"[rank {comm.rank}] failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        time.sleep(0.5)  # let the launcher forward our stderr before Abort tears the job down
        MPI.COMM_WORLD.Abort(1)
        os._exit(1)  # Abort may return before the launcher kills us; never continue
    return 0 if all(every) else 1
