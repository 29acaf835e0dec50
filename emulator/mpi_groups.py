"""Subgroups on the MPI backend: one MPI communicator per group, created after a checked exchange.

Every member first exchanges the group's label (members in order, name, creation count) with the
other members on the parent's communicator, under the control plane's GROUP_TAG: a member that
names another group is a CollectiveMismatch before MPI's communicator creation, which has no
deadline. The communicator is freed when the group is collected (MPI_Comm_free is local).
"""

from __future__ import annotations

import hashlib
import weakref

from .comm import CollectiveMismatch, CommError
from .mpi_control import GROUP_TAG, MPIWorld, _mpi, exchange


def make_group(parent, glob: tuple, name: str, key):
    """The new group over world ranks `glob`, an MPIComm like `parent` (see Comm.group)."""
    label = f"group {name!r} over world ranks {list(glob)} from {parent.name!r} (#{key[-1]})"
    peers = {parent.ranks.index(g): g for g in glob if g != parent.state.rank}
    got = exchange(parent, parent.ctrl, peers, label, b"", GROUP_TAG, f"to create {label}")
    for j, (theirs, _) in sorted(got.items()):
        if theirs != label:
            raise CollectiveMismatch(
                f"group mismatch: rank {parent.state.rank} creates {label} but rank "
                f"{parent.ranks[j]} creates {theirs}. Every member must call group() with "
                f"the same ranks in the same order (a Mesh: the same axes in the same order "
                f"on every rank)."
            )
    MPI = _mpi()
    tag = int.from_bytes(hashlib.blake2b(label.encode(), digest_size=4).digest()) % 32768
    try:
        new = MPI.COMM_WORLD.Create_group(MPI.COMM_WORLD.Get_group().Incl(list(glob)), tag)
    except MPI.Exception as exc:
        raise CommError(
            f"rank {parent.state.rank}: MPI could not create {label} ({exc}); "
            f"{parent.world.live_groups} groups are alive on this rank, one communicator "
            f"each - drop the groups you no longer use (they are freed when collected)"
        ) from exc
    comm = type(parent)(parent.world, parent.state, glob, name, key, new)
    parent.world.live_groups += 1
    weakref.finalize(comm, _free, parent.world, new).atexit = False
    return comm


def _free(world: MPIWorld, mpicomm) -> None:
    """Release a collected group's communicator (MPI_Comm_free is local in MPICH and Open MPI;
    pending sends on it still complete)."""
    world.live_groups -= 1
    if not _mpi().Is_finalized():
        mpicomm.Free()
