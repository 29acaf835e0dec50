"""Faulty SPMD programs for the MPI backend; tests/emulator/test_mpi_faults.py runs them.

    mpiexec -n 2 python tests/mpi/faults.py CASE OUTDIR     # every rank writes OUTDIR/rank<r>.txt
    mpiexec -n 2 python tests/mpi/faults.py CASE --launch   # through emulator.launch, as users do

With OUTDIR, each rank runs the case on its own world communicator, then writes one line - the
error it ended in ("CommTimeout: ..."), or "OK" - waits until every rank has written its line
(so the first rank to finish does not end the job under the others), and exits 3. The test then
sees each rank's own error, not only the one an Abort would print.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import collectives as C
import emulator

TIMEOUT = 2.0  # seconds: for the cases that end in a timeout (its text names who is missing)
# Cases that end in a mismatch or a count at once get a generous timeout: a loaded machine must
# not turn their named error into a timeout.
GENEROUS = 30.0
PROMPT = {"group_order", "mesh_swap", "stray", "barrier_vs_barrier", "objects_vs_all_reduce",
          "ring_vs_tree", "small_tree_vs_double_tree", "small_shape",
          "every_rank_receives_first"}  # fmt: skip


def group_order(comm):  # rank 0 lists the members in reverse
    ranks = list(range(comm.size))
    C.all_reduce(comm.group(ranks[::-1] if comm.rank == 0 else ranks), np.ones(3))


def group_members(comm):  # the last rank builds a group of itself and rank 0 only
    p = comm.size
    C.all_reduce(comm.group([p - 1, 0] if comm.rank == p - 1 else range(p)), np.ones(3))


def group_skip(comm):  # the last rank skips group() and goes on to a world all-reduce
    if comm.rank != comm.size - 1:
        comm.group(range(comm.size))
    C.all_reduce(comm, np.ones(3))


def mesh_swap(comm):  # ranks 0, 1 build Mesh(dp, tp); the others Mesh(tp, dp)
    mesh = emulator.Mesh(comm, dp=2, tp=2) if comm.rank < 2 else emulator.Mesh(comm, tp=2, dp=2)
    C.all_reduce(mesh["tp"], np.ones(3))
    C.all_reduce(mesh["dp"], np.ones(3))


def _pairs(comm, sent, shape, dtype):  # even ranks send `sent`, odd ranks expect (shape, dtype)
    if comm.rank % 2 == 0:
        comm.send(sent, comm.rank + 1)
    else:
        comm.recv(comm.rank - 1, shape=shape, dtype=dtype)


def recv_dtype(comm):
    _pairs(comm, np.arange(4, dtype=np.float64), (4,), np.int64)


def recv_shape(comm):
    _pairs(comm, np.zeros((2, 4)), (8,), np.float64)


def stray(comm):  # rank 0 sends rank 1 a message nobody receives, then a tree broadcast
    if comm.rank == 0:
        comm.send(np.array([-7.0]), 1)
    got = C.broadcast(comm, np.array([float(comm.rank + 1)]), root=0, algorithm="tree")
    if got[0] != 1.0:
        raise AssertionError(f"the broadcast returned {got} (the stray message?)")


def stray_in_collective(comm):  # a collective whose algorithm sends one message too many
    with comm.collective("custom", "buggy", np.ones(2)):
        if comm.rank == 0:
            comm.send(np.ones(2), 1)
            comm.send(np.ones(2), 1)
        elif comm.rank == 1:
            comm.recv(0, shape=2, dtype=np.float64)
            # wait (raw MPI, test-side) until the extra message is here, so the check at the
            # collective's end must find it (a later one would be the end-of-run count's)
            comm.mpi.Probe(source=0, tag=comm._tag(comm.state.current.seq))


def barrier_vs_barrier(comm):  # rank 0's control-plane barrier against a counted barrier
    comm.barrier() if comm.rank == 0 else C.barrier(comm)


def objects_vs_all_reduce(comm):
    comm.allgather_object(comm.rank) if comm.rank == 0 else C.all_reduce(comm, np.ones(3))


def ring_vs_tree(comm):  # the same all-reduce, rank 0 by ring: its data is the first to differ
    C.all_reduce(comm, np.ones(1000), algorithm="ring" if comm.rank == 0 else "tree")


def small_tree_vs_double_tree(comm):  # the benchmark's 4 KiB float32, rank 0 by binomial tree
    algo = "tree" if comm.rank == 0 else "double_tree"
    C.all_reduce(comm, np.ones(1024, np.float32), algorithm=algo)


def small_shape(comm):  # a 4 KiB tree all-reduce, the last rank's array one element longer
    C.all_reduce(comm, np.ones(1024 + (comm.rank == comm.size - 1), np.float32), algorithm="tree")


def every_rank_receives_first(comm):  # each rank reduces to itself: every root waits first
    C.reduce(comm, np.ones(1024, np.float32), root=comm.rank)


def hard_exit(comm):  # rank 1 leaves without a word, after a collective; the others go on
    C.all_reduce(comm, np.ones(3))
    if comm.rank == 1:
        os._exit(0)
    time.sleep(0.5)
    return 0


def killed(comm):  # rank 1 is killed (SIGKILL) while the others wait for it
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    C.all_reduce(comm, np.ones(3))


def many_groups(comm):  # 5,000 group creations (each freed when the next replaces it)
    for i in range(5000):
        g = comm.group(range(comm.size), name=f"g{i % 7}")
        if i % 1000 == 0:
            C.all_reduce(g, np.ones(2))
    print(f"rank {comm.rank}: 5000 groups created", flush=True)


CASES = {f.__name__: f for f in (
    group_order, group_members, group_skip, mesh_swap, recv_dtype, recv_shape, stray,
    stray_in_collective, barrier_vs_barrier, objects_vs_all_reduce, hard_exit, killed, many_groups,
    ring_vs_tree, small_tree_vs_double_tree, small_shape, every_rank_receives_first,
)}  # fmt: skip


def each_rank(case, outdir: Path) -> None:
    from emulator.mpi import world_comm

    comm = world_comm(GENEROUS if case in PROMPT or case == "many_groups" else TIMEOUT)
    try:
        CASES[case](comm)
        comm.world.finish(comm)
        line = "OK"
    except Exception as exc:  # noqa: BLE001 - the line is the verdict
        line = f"{type(exc).__name__}: {exc}"
    (outdir / f"rank{comm.rank}.tmp").write_text(line)
    os.replace(outdir / f"rank{comm.rank}.tmp", outdir / f"rank{comm.rank}.txt")
    deadline = time.monotonic() + 2 * GENEROUS
    while len(list(outdir.glob("rank*.txt"))) < comm.size and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    os._exit(3)


if __name__ == "__main__":
    name, where = sys.argv[1], sys.argv[2]
    if where == "--launch":
        sys.exit(emulator.launch(CASES[name], timeout=GENEROUS))  # a vanished rank ends it
    each_rank(name, Path(where))
