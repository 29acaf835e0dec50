"""The data-parallel replica check (uncounted): every rank's copy of a tensor replicated over a
part's group is bitwise equal to group rank 0's (parallel/data/axis.py DataAxis.replica_mismatch).

Every copy comes from the same summed gradient (a ring all-reduce or all-gather hands every rank
the same bits) and the same AdamW, so any difference is a rank that skipped, repeated or
corrupted an update. On virtual ranks (``affinity.share``) group rank i compares the tensors
i, i + R, ... and the findings are gathered (uncounted): the group compares each tensor once.

When the tensors are views of flat buffers (DDP's buckets and BucketAdamW's replica), the
buffers are compared first, group rank i taking the i-th of R equal element ranges of each:
one comparison per buffer and rank instead of one per tensor. Only when some range differs -
an element unequal, or a NaN, which np.array_equal never calls equal - do the per-tensor
comparisons run, so the findings are theirs exactly: equal buffers hold equal tensors (and a
zero padding), and any unequal tensor makes its buffer's range unequal.
"""

from __future__ import annotations

import numpy as np

from emulator import affinity


def replica_mismatch(parts, params: dict, grads: dict, flats=None) -> list[str]:
    """ "param|grad <name> over <group>" for every tensor of ``params`` / ``grads`` whose copies
    on the ranks of its part's group are not bitwise equal (collective over each part's group).
    ``flats``: per part, the buffers the part's params and grads are views of, as
    (param buffers, grad buffers), or None where they are not (the per-tensor check only)."""
    bad = []
    for k, part in enumerate(parts):
        mine = [{n: d[n] for n in part.names if n in d} for d in (params, grads)]
        group = part.group
        at, R = affinity.share(group)
        if flats is not None and flats[k] is not None and _equal_buffers(group, flats[k], at, R):
            continue
        every = group.allgather_object(mine)
        where, found = part.label or "dp", []
        for i, what in enumerate(("param", "grad")):
            for j, (n, x) in enumerate(every[0][i].items()):
                if j % R != at:
                    continue
                diff = [r for r, e in enumerate(every)
                        if e[i][n] is not x and not np.array_equal(x, e[i][n])]  # fmt: skip
                if diff:
                    label = f"{what} {n} over {where} (group ranks {diff} differ from 0)"
                    found.append((i, j, label))
        bad += affinity.merge_found(group, found, R)
    return bad


def _equal_buffers(group, buffers, at: int, R: int) -> bool:
    """Every rank's buffers equal group rank 0's (the same answer on every rank: gathered)."""
    every = group.allgather_object([b for kind in buffers for b in kind])
    same = True
    for b, x in enumerate(every[0]):
        lo, hi = at * x.size // R, (at + 1) * x.size // R
        same = same and all(np.array_equal(x[lo:hi], e[b][lo:hi]) for e in every[1:])
    return all(group.allgather_object(same)) if R > 1 else same
