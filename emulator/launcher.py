"""Run one SPMD program on either backend, unchanged.

An example script ends with `sys.exit(emulator.launch(main))`, where `main(comm)` returns 0 (or
None / True) on success. Then:

    mpiexec -n 4 python script.py               -> MPI, one process per rank
    python -m emulator run -n 16 script.py      -> 16 virtual ranks in one process
    python script.py                            -> virtual ranks, the script's default count

The backend is chosen from how the process was started (an MPI launcher sets PMI_* / OMPI_*
variables in the environment), never from a feature switch. Under MPI each rank ends with a
handshake (every verdict, no message left over) and runs in a forked child of the process mpiexec
started, so a rank that exits or is killed mid-run fails the job naming it (`_supervise`).
"""

from __future__ import annotations

import ctypes
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
    if not timeout > 0:  # before any fork: the same rule as spawn and world_comm
        raise ValueError(f"launch: timeout must be positive seconds, got {timeout!r}")
    if "mpi4py.MPI" in sys.modules or not hasattr(os, "fork"):
        return _run_rank(main, timeout, check)  # MPI is up already: no supervisor (see below)
    global _supervised
    if _supervised:  # the rank's MPI lived in a child that has exited; MPI starts once per rank
        raise RuntimeError("launch: under mpiexec a script calls launch() once per process")
    _supervised = True
    return _supervise(main, timeout, check)


_supervised = False


def _supervise(main, timeout: float, check: bool) -> int:
    """Run the rank in a child process and outlive it, so a rank that vanishes fails the job.

    MPICH's mpiexec treats a process that exits with code 0 without MPI_Finalize (os._exit(0),
    or a kill while the others wait) as done: it kills the other ranks and the job exits 0 with
    their work unfinished. So this process (the one mpiexec started; it never initializes MPI)
    forks the rank, which inherits the launcher's PMI connection, and waits. The rank reports
    its exit code through a pipe after the end-of-run handshake and MPI_Finalize; a rank that
    ends without that report makes this process exit 1 naming the rank, and mpiexec then fails
    the job. The child dies with its parent (PR_SET_PDEATHSIG), so killing a rank kills both.
    """
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the rank
        os.close(read)
        _die_with_parent(parent)
        code = _run_rank(main, timeout, check)
        from .mpi import _mpi

        _mpi().Finalize()
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(write, str(code).encode())
        # C's exit, not os._exit: MPICH tells mpiexec "finalized" from its exit handlers, and
        # without that mpiexec takes our parent's exit for a premature one and kills the job.
        # Not a Python exit either: the script's code after launch() runs in the parent only.
        ctypes.CDLL(None).exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as f:
        report = f.read().decode()
    if report:
        return int(report)
    how = (
        f"was killed by signal {os.WTERMSIG(status)}"
        if os.WIFSIGNALED(status)
        else f"exited with code {os.waitstatus_to_exitcode(status)}"
    )
    sys.stderr.write(
        f"[rank {rank}] failed: the rank {how} before the end-of-run handshake (os._exit, a "
        f"crash or a kill inside the program); the job fails\n"
    )
    sys.stderr.flush()
    return 1


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _run_rank(main, timeout: float, check: bool) -> int:
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
