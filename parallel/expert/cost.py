"""Bytes of the expert-parallel MoE block per rank, in closed form from the routing counts.

Shape letters: P the ep group size, E experts, El = E / P, H d_model, w the itemsize of the
block's activations, C_g the slots per expert of routing group g, C = sum_g C_g over a rank's
groups (one group per micro-batch by default, so C is the spec's capacity).

``kept[s, e]`` (P, E): the token copies rank s keeps for expert e, summed over its routing groups
(a choice is kept when its slot index is below C_g). Rank s sends to rank d the rows of d's
experts, R[s, d] = sum_{e in d's experts} kept[s, e], and keeps R[s, s] (no bytes). Per layer:

  exact (Megatron-core's alltoall dispatcher; all-to-all-v of the kept rows):
    counts             sent = received = (P-1) El 8 (one int64 per expert, El to every peer;
                       an all-to-all of the (E,) count vector - Megatron exchanges the same)
    fwd dispatch       sent = sum_{d != r} R[r, d] H w     received = sum_{s != r} R[s, r] H w
    fwd combine        the dispatch reversed (sent <-> received)
    bwd combine        = fwd dispatch (dL/dout travels to the experts)
    bwd dispatch       = fwd combine (dL/dx travels back); the backward reuses the counts
  padded (GShard / DeepSpeed; fixed-size all-to-all of (E, C, H) with empty slots as zeros):
    each of the four   sent = received = (P-1) El C H w = (P-1)/P E C H w;  no counts
The same formulas in the pairwise_all_to_allv form of collectives/cost.py are checked to agree.
Under recompute="full" the backward reruns the block's forward, all-to-alls included: the three
fwd phases then move twice these bytes per layer (tests/parallel/expert/test_train.py).
"""

from __future__ import annotations

import numpy as np

from collectives import cost as ccost

PHASES = ("fwd/counts", "fwd/dispatch", "fwd/combine", "bwd/combine", "bwd/dispatch")


def rows_to_ranks(kept, P: int) -> np.ndarray:
    """kept (P, E) -> R (P, P): R[s, d] rows rank s sends to rank d."""
    kept = np.asarray(kept, np.int64)
    return kept.reshape(kept.shape[0], P, kept.shape[1] // P).sum(axis=2)


def exact_bytes(kept, H: int, itemsize: int, rank: int) -> dict:
    """{phase: (sent, received)} of one MoE layer on ``rank`` in exact mode."""
    P, E = np.shape(kept)
    R = rows_to_ranks(kept, P)
    row = H * itemsize
    out_rows = int(R[rank].sum() - R[rank, rank])  # to the other ranks' experts
    in_rows = int(R[:, rank].sum() - R[rank, rank])  # from the other ranks' tokens
    go, back = (out_rows * row, in_rows * row), (in_rows * row, out_rows * row)
    counts = ((P - 1) * (E // P) * 8,) * 2
    return dict(zip(PHASES, (counts, go, back, go, back)))


def padded_bytes(E: int, P: int, C: int, H: int, itemsize: int) -> dict:
    """{phase: (sent, received)} in padded mode: (P-1)/P E C H w each way, every all-to-all."""
    each = (P - 1) * (E // P) * C * H * itemsize
    return dict(zip(PHASES, ((0, 0), *[(each, each)] * 4)))


def layer_bytes(mode: str, kept, C: int, H: int, itemsize: int, rank: int) -> dict:
    P, E = np.shape(kept)
    if mode == "exact":
        return exact_bytes(kept, H, itemsize, rank)
    return padded_bytes(E, P, C, H, itemsize)


def exact_bytes_pairwise(kept, H: int, itemsize: int, rank: int) -> dict:
    """exact_bytes written with collectives/cost.py's all-to-all(v) formulas (a cross-check)."""
    P, E = np.shape(kept)
    R = rows_to_ranks(kept, P)
    go = ccost.pairwise_all_to_allv(list(R[rank] * H), list(R[:, rank] * H), itemsize, rank)
    back = go[::-1]
    counts = ccost.pairwise_all_to_all(E, P, 8, rank)
    return dict(zip(PHASES, (counts, go, back, go, back)))


def kept_table(routes_per_rank, E: int) -> np.ndarray:
    """routes_per_rank[s]: the route dicts (emulator.moe.route) of rank s's groups -> kept (P, E)."""
    return np.array(
        [
            sum(np.bincount(r["expert"][r["keep"]], minlength=E) for r in rs)
            for rs in routes_per_rank
        ],
        np.int64,
    )
