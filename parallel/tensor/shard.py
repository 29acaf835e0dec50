"""Placement plans as data: parameter name -> how it is laid out over one group of R ranks.

A plan is an ordered ``dict[str, Placement]``. A placement names the literature's layout and the
axis it cuts; every cut is R equal contiguous blocks (block r lives on rank r), so a plan can be
validated, printed and tested before anything runs, and the same two helpers serve every layout:

    local = shard(params, plan, rank, R)       # this rank's arrays (copies)
    full  = unshard([local_0, ..., local_R-1], plan)

Kinds (the axis is part of the placement, so one kind can cut different tensors differently):
  replicate   every rank holds the whole tensor
  col         column-parallel linear: W (in, out) cut along out (axis -1), its bias along out
  row         row-parallel linear: W (in, out) cut along in (axis 0 of a dense W)
  vocab       the vocabulary axis: rows of embed.tok (V, H), columns of head.w (H, V)
  experts     whole experts: axis 0 of the (E, ...) expert tensors (expert parallelism)
  seq         the sequence axis (context / sequence parallel buffers)
Shape letters: R group size, n the length of the cut axis (R must divide it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator.affinity import shared_map
from emulator.ledger import format_table

KINDS = ("replicate", "col", "row", "vocab", "experts", "seq")


@dataclasses.dataclass(frozen=True)
class Placement:
    kind: str  # one of KINDS
    axis: int | None = None  # the cut axis (None for replicate); negative counts from the end
    # kind != "replicate", set once (a plain attribute: read per tensor in every shard, unshard
    # and replica check); not part of the placement's identity
    sharded: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Placement kind {self.kind!r} unknown; choose one of {KINDS}")
        if (self.kind == "replicate") != (self.axis is None):
            raise ValueError(
                f"Placement {self.kind!r}: replicate takes no axis, every other kind needs one"
            )
        object.__setattr__(self, "sharded", self.kind != "replicate")

    def __str__(self) -> str:
        return self.kind if not self.sharded else f"{self.kind}(axis={self.axis})"


REPLICATE = Placement("replicate")


def _axis(p: Placement, ndim: int, name: str) -> int:
    if not -ndim <= p.axis < ndim:
        raise ValueError(f"{name}: placement {p} cuts axis {p.axis} of a {ndim}-d tensor")
    return p.axis % ndim


def validate(plan: dict, shapes: dict, R: int) -> None:
    """ValueError naming every tensor whose cut axis R does not divide (no padding is done)."""
    if not isinstance(R, (int, np.integer)) or R < 1:
        raise ValueError(f"group size must be an int >= 1, got {R!r}")
    missing = [n for n in shapes if n not in plan]
    if missing:
        raise ValueError(f"plan has no placement for {missing[:5]}; give every parameter one")
    bad = []
    for name, shape in shapes.items():
        p = plan[name]
        if p.sharded:
            n = shape[_axis(p, len(shape), name)]
            if n % R:
                bad.append(f"{name} {tuple(shape)}: {p} has length {n}, not divisible by {R}")
    if bad:
        raise ValueError(
            f"cannot shard over {R} ranks: " + "; ".join(bad) + ". Choose a group size that "
            "divides every cut axis (heads, d_ff, vocabulary, experts, sequence)."
        )


def local_shape(shape, p: Placement, R: int, name: str = "tensor") -> tuple:
    """The shape of one rank's block."""
    shape = tuple(shape)
    if not p.sharded:
        return shape
    a = _axis(p, len(shape), name)
    return shape[:a] + (shape[a] // R,) + shape[a + 1 :]


def shard_one(x: np.ndarray, p: Placement, rank: int, R: int, name: str = "tensor"):
    """Rank ``rank``'s block of x: a contiguous copy (an owner can update it in place)."""
    if not p.sharded:
        return np.array(x, copy=True)
    a = _axis(p, x.ndim, name)
    n = x.shape[a] // R
    block = x[(slice(None),) * a + (slice(rank * n, (rank + 1) * n),)]  # a view: one copy below
    return np.array(block, copy=True, order="C")


def shard(params: dict, plan: dict, rank: int, R: int) -> dict:
    """Every tensor's block for ``rank`` of ``R`` (validated first), in params' order."""
    if not 0 <= rank < R:
        raise ValueError(f"shard: rank {rank} outside 0..{R - 1}")
    validate(plan, {n: a.shape for n, a in params.items()}, R)
    return {n: shard_one(a, plan[n], rank, R, n) for n, a in params.items()}


def unshard(shards: list, plan: dict, *, check_replicas: bool = False) -> dict:
    """Concatenate every rank's blocks back to full shape; a replicated tensor is rank 0's copy.

    ``check_replicas``: also require every rank's copy of a replicated tensor to be bitwise equal
    (true of tensor-parallel replicas that every rank computes identically).
    """
    if not shards:
        raise ValueError("unshard: need the list of every rank's shards, got an empty list")
    return {n: _join(n, plan[n], [s[n] for s in shards], check_replicas) for n in shards[0]}


def _join(name: str, p: Placement, parts: list, check_replicas: bool = False) -> np.ndarray:
    """One tensor's full array from every rank's block of it (``unshard`` of one name)."""
    if p.sharded:
        return np.concatenate(parts, axis=_axis(p, parts[0].ndim, name))
    if check_replicas and not all(np.array_equal(parts[0], q) for q in parts[1:]):
        raise ValueError(f"unshard: replicas of {name} differ across ranks")
    return np.array(parts[0], copy=True)


def unshard_once(group, shards: list, plan: dict) -> dict:
    """``unshard(shards, plan)`` on every rank of ``group``, given every group rank's shards in
    group order. Where the ranks share one address space (virtual ranks: ``shares_memory``)
    rank i joins only the tensors i, i + R, ... and the parts are exchanged as objects
    (uncounted), so the group does the work once instead of R times; the full arrays are then
    shared by the group's ranks (as any allgather_object's are). Elsewhere each rank unshards:
    an object sent to another process is copied anyway."""
    return unshard_each(group, [shards], plan)[0]


def unshard_each(group, lists: list, plan: dict) -> list:
    """``[unshard_once(group, shards, plan) for shards in lists]`` (e.g. the params' and the
    grads' shards) in one exchange of the joined tensors instead of one per list."""
    for shards in lists:
        if not shards:
            unshard(shards, plan)  # its error
    keys = [(i, n) for i, shards in enumerate(lists) for n in shards[0]]
    got = shared_map(group, keys, lambda k: _join(k[1], plan[k[1]], [s[k[1]] for s in lists[k[0]]]))
    out = [{} for _ in lists]
    for (i, n), x in got.items():
        out[i][n] = x
    return out


def describe(plan: dict, shapes: dict, R: int) -> str:
    """A printable table: name, full shape, placement, per-rank shape."""
    rows = [
        [n, str(tuple(s)), str(plan[n]), str(local_shape(s, plan[n], R, n))]
        for n, s in shapes.items()
    ]
    return format_table(["param", "full shape", "placement", f"per rank (R={R})"], rows)
