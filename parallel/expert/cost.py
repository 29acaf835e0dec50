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
from emulator.flops import activation_bytes_per_block, moe_group_bytes
from emulator.moe import capacity
from emulator.precision import arith_dtype, compute_dtype

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


# -- activation memory -------------------------------------------------------------------------
def ep_moe_activation_bytes(cfg, group_sizes, rows_in: int) -> int:
    """What the ep MoE block's cache holds on one rank (layer.py), beside the single-rank
    flops.moe_group_bytes: per routing group of N tokens the same router state, indices and the
    gathered tokens u (N H), and the expert outputs unpacked to (E, C_g, H) for the combine
    backward; but the experts' inputs, z and GELU outputs only for the rows_in rows this rank's
    experts received (exact: the counts; padded: E sum_g C_g), (rows_in, H + 2F), instead of
    (E, C, 2H + 2F) per group; plus the rows table n (G, E) and the counts (P, El) as int64."""
    a = compute_dtype(cfg.dtype).itemsize
    r = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    H, F, E, K = cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.moe_top_k
    total = 0
    for N in group_sizes:
        C = capacity(N, K, E, cfg.capacity_factor)
        total += a * (N * H + E * C * H) + r * (N * E + N * K + E) + 8 * (N + 4 * N * K) + K * N
    return total + a * rows_in * (H + 2 * F) + 8 * (len(group_sizes) * E + E)


def ep_block_activation_bytes(cfg, B, S, rows_in: int, recompute="none", group_sizes=None):
    """flops.activation_bytes_per_block with its MoE groups replaced by the ep block's bytes."""
    sizes = [B * S] if group_sizes is None else list(group_sizes)
    whole = activation_bytes_per_block(cfg, B, S, recompute, sizes)
    if recompute == "full":
        return whole
    return (
        whole
        - sum(moe_group_bytes(cfg, n) for n in sizes)
        + ep_moe_activation_bytes(cfg, sizes, rows_in)
    )
