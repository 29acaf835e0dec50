"""Bytes per cp rank per attention layer, forward and backward, and the bytes the attention
cache keeps for the backward - in closed form, checked against the byte and memory ledgers.

Shape letters: B batch, S global sequence, C cp ranks, S_local = S / C, H the attention width
on this rank (H_local under tensor parallelism), A its heads. x = itemsize of the stored dtype,
y = itemsize of the arithmetic dtype (accumulated gradients; y = x except bf16, where y = 4).
One block is what a rank holds of one of q, k, v: blk = B S_local H x (blk_y with y).
Every method is symmetric: each rank sends exactly what it receives.

  ring        forward  2 (C-1) blk                K and V, C - 1 hops
              backward 2 (C-1) blk + 2 (C-1) blk_y K and V again, and the dK/dV accumulators
  all-gather  forward  2 (C-1) blk                ring all-gather of K and of V
              backward 2 (C-1) blk_y              ring reduce-scatter of dK and of dV
  ulysses     forward  4 (C-1)/C blk              all-to-all of q, k, v in and o out
              backward 4 (C-1)/C blk              all-to-all of dO in and dq, dk, dv out

Ulysses is the only one whose bytes per rank fall as C grows (each all-to-all keeps 1/C of its
buffer); ring's sends overlap with compute step by step, all-gather's happen before it.

Under tensor (+ sequence) parallelism the cp attention runs on the rank's H/t width and A/t heads
of the cp rank's S_local tokens (SP gathers its S_local/t slices back first), so the formulas
above hold with H -> H/t, A -> A/t, unchanged by SP; the tp axis's bytes are parallel/tensor/
cost.py's at sequence length S_local (parallel/nd_cost.py).
"""

from __future__ import annotations

from emulator.flops import activation_bytes_per_block
from emulator.precision import arith_dtype, compute_dtype
from parallel.context import work
from parallel.context.ulysses import check_heads
from parallel.tensor.cost import block_activation_bytes as tp_block

FORMULAS = {
    "ring": ("2 (C-1) B S/C H x", "2 (C-1) B S/C H (x + y)"),
    "all-gather": ("2 (C-1) B S/C H x", "2 (C-1) B S/C H y"),
    "ulysses": ("4 (C-1)/C B S/C H x", "4 (C-1)/C B S/C H x"),
}


def _blk(B, S, H, C, itemsize) -> int:
    return B * (S // C) * H * itemsize


def attention_bytes(method, B, S, H, A, C, itemsize, acc_itemsize=None) -> dict:
    """{"forward": n, "backward": n}: bytes each cp rank sends (and receives) per layer."""
    y = itemsize if acc_itemsize is None else acc_itemsize
    blk, blk_y = _blk(B, S, H, C, itemsize), _blk(B, S, H, C, y)
    if method == "ring":
        return {"forward": 2 * (C - 1) * blk, "backward": 2 * (C - 1) * (blk + blk_y)}
    if method == "all-gather":
        return {"forward": 2 * (C - 1) * blk, "backward": 2 * (C - 1) * blk_y}
    if method == "ulysses":
        check_heads(A, C)
        n = 4 * (C - 1) * blk // C  # exact: H / C is whole (A / C whole heads)
        return {"forward": n, "backward": n}
    raise ValueError(f"cost: unknown method {method!r}")


def cache_nbytes(method, B, S, H, A, C, itemsize, *, keep_probs, balance, rank,
                 acc_itemsize=None) -> int:  # fmt: skip
    """Bytes the forward keeps for the backward on cp rank `rank` (positions table excluded).

    ring        q, k, v, o (4 blk) + log-sum-exp B A S_local y [+ kept probabilities
                B A (computed score entries, work.py) x]
    all-gather  q (blk) + gathered K and V (2 C blk) [+ probabilities B A S_local S x]
    ulysses     head-sharded q, k, v (3 blk: B S H/C x each) [+ probabilities B A/C S S x]
    """
    y = itemsize if acc_itemsize is None else acc_itemsize
    blk, S_l = _blk(B, S, H, C, itemsize), S // C
    if method == "ring":
        entries = sum(w[0] * w[1] for w in work.steps(S, C, balance)[rank])
        return 4 * blk + B * A * S_l * y + (B * A * entries * itemsize if keep_probs else 0)
    if method == "all-gather":
        return blk + 2 * C * blk + (B * A * S_l * S * itemsize if keep_probs else 0)
    if method == "ulysses":
        check_heads(A, C)
        return 3 * blk + (B * (A // C) * S * S * itemsize if keep_probs else 0)
    raise ValueError(f"cost: unknown method {method!r}")


def block_activation_bytes(cfg, method, B, S, C, *, recompute, balance, rank) -> int:
    """A block's activation bytes on cp rank `rank` (emulator.block's cache, B the micro-batch):
    the single-rank block at S_local tokens without probabilities (emulator.flops), minus its
    q, k, v (3 blk: held only through the attention cache), plus this method's attention cache
    (cache_nbytes; the ring's o is the wo input already counted: - blk), plus the positions
    table (8 S). Full recompute keeps only the block input. MoE: one routing group per rank."""
    S_l = S // C
    if recompute == "full":
        return activation_bytes_per_block(cfg, B, S_l, "full")
    x = compute_dtype(cfg.dtype)
    y, x = arith_dtype(x).itemsize, x.itemsize
    H, A, blk = cfg.d_model, cfg.n_heads, _blk(B, S, cfg.d_model, C, x)
    attn = cache_nbytes(method, B, S, H, A, C, x, keep_probs=recompute == "none",
                        balance=balance, rank=rank, acc_itemsize=y)  # fmt: skip
    shared = blk if method == "ring" else 0
    return activation_bytes_per_block(cfg, B, S_l, "selective") - 3 * blk + attn - shared + 8 * S


def tp_block_activation_bytes(cfg, method, B, S, C, t, *, sp, regather=True, recompute, balance,
                              rank) -> int:  # fmt: skip
    """A tensor-parallel block's activation bytes on cp rank `rank` (parallel/tensor/block.py's
    cache, cp x tp, with or without SP): the TP block at S_local = S/C tokens without
    probabilities (parallel/tensor/cost.block_activation_bytes; under SP its S_local/t slices),
    minus its q, k, v (3 blk of B S_local H/t: held only through the attention cache), plus this
    method's cache on the rank's H/t width and A/t heads (the ring's o is the wo input already
    counted: - blk), plus the positions table (8 S). MoE: one routing group of B S_local tokens
    (the cp rank's, gathered back by SP before the router)."""
    x = compute_dtype(cfg.dtype)
    y, x = arith_dtype(x).itemsize, x.itemsize
    H, A = cfg.d_model // t, cfg.n_heads // t
    blk = _blk(B, S, H, C, x)
    base = tp_block(cfg, B, S // C, t, sp=sp, regather=regather, recompute="selective")
    attn = cache_nbytes(method, B, S, H, A, C, x, keep_probs=recompute == "none",
                        balance=balance, rank=rank, acc_itemsize=y)  # fmt: skip
    return base - 3 * blk + attn - (blk if method == "ring" else 0) + 8 * S
