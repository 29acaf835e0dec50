"""An N-D device mesh with named axes, as torch's DeviceMesh: one grid owns the geometry.

    mesh = Mesh(comm, dp=2, pp=2, tp=2)    # axes in the order given; the last varies fastest
    mesh["tp"]         -> this rank's tp group (a Comm; its ranks are 0..tp-1)
    mesh.coord("pp")   -> this rank's index along pp
    mesh.group("dp", "tp") -> one group spanning several axes (e.g. ZeRO over dp x cp)

Global rank r sits at the coordinates of r in `arange(world).reshape(shape)` (row-major, so the
last axis holds neighbouring ranks - put tp last to keep it on one node). Every group is built
from that one grid, so the groups of every axis partition the world.
"""

from __future__ import annotations

import numpy as np

from .comm import Comm


class Mesh:
    def __init__(self, comm: Comm, **dims: int):
        if not dims:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh(comm, dp=comm.world_size)")
        for name, d in dims.items():
            if not isinstance(d, (int, np.integer)) or d < 1:
                raise ValueError(f"Mesh: axis {name}={d!r} must be a positive integer")
        shape = tuple(int(d) for d in dims.values())
        size = int(np.prod(shape))
        if size != comm.world_size:
            degrees = " x ".join(f"{k}={v}" for k, v in dims.items())
            raise ValueError(
                f"Mesh {degrees} = {size} ranks, but the world has {comm.world_size}; make the "
                f"product of the degrees equal the number of ranks (e.g. run with -n {size})"
            )
        self.comm = comm
        self.names = tuple(dims)
        self.shape = shape
        self.grid = np.arange(size).reshape(shape)
        self.coords = dict(zip(self.names, (int(c) for c in np.unravel_index(comm.rank, shape))))
        self._groups: dict = {}

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in zip(self.names, self.shape))
        return f"Mesh({dims}) rank {self.comm.rank} at {self.coords}"

    def groups_of(self, axis: str) -> list[list[int]]:
        """Every group along `axis`, as lists of global ranks (a partition of the world)."""
        i = self._axis(axis)
        return [
            [int(r) for r in row]
            for row in np.moveaxis(self.grid, i, -1).reshape(-1, self.shape[i])
        ]

    def describe(self) -> str:
        """Printable: the mesh, then one line per axis with the global ranks of each group."""
        dims = " x ".join(f"{k}{v}" for k, v in zip(self.names, self.shape))
        lines = [f"mesh {dims} (outermost first; the last axis holds neighbouring ranks)"]
        for a in self.names:
            groups = " ".join(str(g).replace(" ", "") for g in self.groups_of(a))
            lines.append(f"  {a:>3} groups: {groups}")
        return "\n".join(lines)

    def size(self, axis: str) -> int:
        return self.shape[self._axis(axis)]

    def coord(self, axis: str) -> int:
        self._axis(axis)
        return self.coords[axis]

    def ranks(self, *axes: str) -> list[int]:
        """The world ranks of this rank's group along `axes`, in group-rank order."""
        idx = [self._axis(a) for a in axes]
        if len(set(idx)) != len(idx):
            raise ValueError(f"Mesh.ranks: axis named twice in {axes}")
        sel = tuple(slice(None) if i in idx else self.coords[n] for i, n in enumerate(self.names))
        sub = self.grid[sel]  # the remaining axes, in mesh order
        order = sorted(range(len(idx)), key=lambda j: idx[j])  # sub's axes are in mesh order
        perm = [order.index(j) for j in range(len(idx))]
        return [int(r) for r in np.transpose(sub, perm).reshape(-1)]

    def group(self, *axes: str) -> Comm:
        """This rank's communicator along one or more axes (created once, then cached)."""
        if not axes:
            raise ValueError("Mesh.group needs at least one axis name")
        if axes not in self._groups:
            self._groups[axes] = self.comm.group(self.ranks(*axes), name="x".join(axes))
        return self._groups[axes]

    def __getitem__(self, axis: str) -> Comm:
        return self.group(axis)

    def _axis(self, axis: str) -> int:
        if axis not in self.names:
            raise ValueError(f"Mesh has no axis {axis!r}; its axes are {self.names}")
        return self.names.index(axis)
