"""Collectives built only from send/recv: what each means (reference.py) and how it runs.

    from collectives import all_reduce
    y = all_reduce(comm, x, op="sum", algorithm="auto")

Algorithms: ring.py (reduce-scatter, all-gather, all-reduce), tree.py (binomial reduce,
broadcast, tree all-reduce), double_tree.py (NCCL's double binary tree all-reduce),
alltoall.py (pairwise all-to-all(v), gather, scatter, barrier).
cost.py holds every byte formula and the alpha-beta model behind algorithm="auto".
"""

from .api import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_allv,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from .ops import OPS

__all__ = [
    "OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_allv",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]
