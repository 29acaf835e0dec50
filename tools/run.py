"""Running an example: errors once with their rank, the verdict and --json, a step counter.

    sys.exit(run_example(make_main(a), a, world_size=4))

`run_example` launches `main(comm)` on either backend (emulator.launch). An exception raised
inside the run (a layout refused, a mismatch, a timeout) prints its message once, naming the
failing rank, and exits 1; the traceback only with --debug (or DISTEMU_DEBUG=1). With --json PATH
every rank's byte ledger (totals by op, group, tag and peer, and sent bytes per group and peer:
the communication matrix) and memory figures, the verdict and the example's own figures are
written by rank 0 as one JSON file.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback

import emulator
from emulator import blas
from emulator.check import verdict
from emulator.launcher import under_mpi
from emulator.rank import current_state

from .args import process_rank

# What rank 0 of this process reported (virtual ranks are threads of one process; under MPI
# each process is one rank and only rank 0 writes the JSON).
_RESULT: dict = {}
_LOCK = threading.Lock()


def say_verdict(failures: list[str], checked: str, skipped: str | None = None, **figures) -> str:
    """Print the example's VERDICT line (emulator.check.verdict; `skipped`: why nothing could
    be compared, a SKIP, not a pass) and keep it, with any machine-readable `figures`, for
    --json. Call it on rank 0 only."""
    line = verdict(failures, checked, skipped=skipped)
    print(line, flush=True)
    with _LOCK:
        passed = not failures and not skipped
        _RESULT.update(verdict=line, passed=passed, failures=list(failures))
        _RESULT.setdefault("figures", {}).update(figures)
    return line


def record(**figures) -> None:
    """Add machine-readable figures for --json (rank 0)."""
    with _LOCK:
        _RESULT.setdefault("figures", {}).update(figures)


def rank_report(comm) -> dict:
    """This rank's bytes and memory: ledger totals and the sent bytes per (group, peer)."""
    led = comm.ledger
    matrix: dict = {}
    for r in led.records:
        if r.direction == "send":
            row = matrix.setdefault(r.group, {})
            row[r.peer] = row.get(r.peer, 0) + r.nbytes
    s = led.summary()
    s["by_peer"] = {str(k): v for k, v in led.totals("peer").items()}
    s["sent_to"] = {g: {str(p): b for p, b in sorted(row.items())} for g, row in matrix.items()}
    s["memory"] = comm.memory.snapshot()
    return s


def write_json(path: str, ranks: list[dict], args) -> None:
    flags = {k: v for k, v in vars(args).items() if k not in ("json", "debug")}
    with _LOCK:
        out = {"script": os.path.basename(sys.argv[0]), "world_size": len(ranks), "flags": flags,
               **_RESULT, "ranks": ranks}  # fmt: skip
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)


def _with_report(main, args):
    def wrapped(comm):
        code = main(comm)
        if getattr(args, "json", None):
            ranks = comm.allgather_object(rank_report(comm))  # uncounted control plane
            if comm.rank == 0:
                write_json(args.json, ranks, args)
        return code

    return wrapped


def _failing_rank(exc: BaseException) -> str:
    for note in getattr(exc, "__notes__", ()):
        if "virtual rank" in note:
            return note.strip("()")
    return ""


def error_line(exc: BaseException, where: str = "") -> str:
    msg = str(exc).strip().splitlines()
    head = f"{type(exc).__name__}: {msg[0] if msg else ''}"
    return f"error{' ' + where if where else ''}: {head}"


def report_error(exc: BaseException, debug: bool, what: str = "error") -> None:
    """stderr: the traceback with `debug`; else `what (the failing rank): Type: message`, the
    message's further lines indented (a flight recorder), and how to see the traceback."""
    if debug:
        traceback.print_exception(exc)
        return
    where = _failing_rank(exc)
    lines = str(exc).strip().splitlines()
    print(error_line(exc, f"({where})" if where else "").replace("error", what, 1), file=sys.stderr)
    for line in lines[1:]:
        print("  " + line, file=sys.stderr)
    print("  (--debug shows the traceback)", file=sys.stderr, flush=True)


def run_example(main, args, world_size: int = 4, timeout: float | None = None) -> int:
    """Launch `main(comm)`; return the exit code. Errors inside the run: one message naming
    the failing rank (more lines only when the message itself has them, e.g. a flight
    recorder), exit code 1; the traceback only with --debug."""
    debug = getattr(args, "debug", False) or bool(os.environ.get("DISTEMU_DEBUG"))
    kw = {} if timeout is None else {"timeout": timeout}
    main = _with_report(main, args)
    if under_mpi():
        main = _mpi_guard(main, debug)
    try:
        return emulator.launch(main, world_size=world_size, **kw)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - reported in one place, below
        report_error(exc, debug)
        return 1
    finally:
        progress_done()


def _local_ranks(world: int) -> int:
    """MPI processes on this machine (the launcher's variables; else the whole world)."""
    for v in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if os.environ.get(v, "").isdigit():
            return int(os.environ[v])
    return world


def _mpi_guard(main, debug: bool):
    """Under MPI: BLAS threads = this process's share of the cores; a failing rank prints one
    line naming itself, then aborts the job (ranks other than 0 wait 1.5 s first, so an error
    all ranks raise - a layout refused - is printed once, by rank 0)."""

    def guarded(comm):
        try:
            with blas.limit(blas.per_rank(_local_ranks(comm.world_size))):  # cores per process
                return main(comm)
        except Exception as exc:  # one line from the failing rank, then stop the job
            if debug:
                raise  # emulator.launch prints the traceback and aborts
            if comm.rank:  # an error every rank raises is printed once: rank 0's abort (after
                time.sleep(1.5)  # its 0.5 s) ends this process before it prints its copy
            print(error_line(exc, f"(rank {comm.rank} of {comm.world_size})"), file=sys.stderr)
            print("  (--debug shows the traceback)", file=sys.stderr, flush=True)
            time.sleep(0.5)  # let the launcher forward stderr before the job is torn down
            from emulator.mpi import _mpi

            _mpi().COMM_WORLD.Abort(1)
            os._exit(1)

    return guarded


# -- progress: a step counter on a terminal, nothing when piped ---------------------------------
_shown = {"on": False}


def progress(batches, steps: int, label: str = "step", stream=None):
    """Wrap `batches(step)` so that rank 0 shows `label k/steps` on a terminal (stderr)."""
    out = stream or sys.stderr
    if not (hasattr(out, "isatty") and out.isatty()) or process_rank() != 0:
        return batches
    name = os.path.basename(sys.argv[0])

    def wrapped(step, *a, **kw):
        st = current_state()
        if st is None or st.rank == 0:
            out.write(
                f"\r\x1b[K{name}: {label} {step + 1}/{steps}\r"
            )  # cursor back: output overwrites
            out.flush()
            _shown["on"], _shown["out"] = True, out
        return batches(step, *a, **kw)

    return wrapped


def progress_done() -> None:
    if _shown.pop("on", False):
        out = _shown.pop("out")
        out.write("\r\x1b[K")
        out.flush()
