"""Exact cost formulas of the reference model: matmul FLOPs and saved-activation bytes.

Shape letters: B batch, S sequence, H d_model, A heads, F d_ff, V vocab, L layers, E experts,
K top-k, N tokens of a routing group, C its expert capacity. A matmul (m, k) @ (k, n) is 2 m k n
FLOPs; elementwise work (softmax, LayerNorm, GELU, Adam) is not counted.

Both formulas count what the code in ops.py / moe.py / block.py actually does (the tests check
them against a counting array subclass and the memory ledger):
- attention computes the full S x S square (no causal skipping);
- every linear needs dX and dW in the backward (2x its forward), and so does attention
  (dP, dV, dQ, dK), so backward = 2 x forward exactly;
- selective recompute reruns only Q K^T; full recompute reruns the whole block forward;
- an MoE expert computes all of its C slots, filled or not.
"""

from __future__ import annotations

from emulator.moe import capacity
from emulator.precision import arith_dtype, compute_dtype


def _groups(B, S, group_sizes):
    return [B * S] if group_sizes is None else list(group_sizes)


def block_forward_flops(cfg, B, S, group_sizes=None) -> int:
    """Matmul FLOPs of one block's forward."""
    H, F = cfg.d_model, cfg.d_ff
    attn = 4 * 2 * B * S * H * H + 2 * (2 * B * S * S * H)  # q, k, v, o; QK^T and PV
    if not cfg.is_moe:
        return attn + 2 * (2 * B * S * H * F)
    E, K = cfg.n_experts, cfg.moe_top_k
    slots = sum(E * capacity(n, K, E, cfg.capacity_factor) for n in _groups(B, S, group_sizes))
    return attn + 2 * B * S * H * E + 2 * (2 * slots * H * F)  # router; w1, w2 on every slot


def step_flops(cfg, B, S, *, recompute="none", group_sizes=None) -> dict:
    """Matmul FLOPs of one forward + backward over (B, S).

    "model" = forward + backward (what MFU counts); "hardware" adds the recomputation (HFU).
    """
    block = block_forward_flops(cfg, B, S, group_sizes)
    head = 2 * B * S * cfg.d_model * cfg.vocab_size
    fwd = cfg.n_layers * block + head
    extra = {"none": 0, "selective": 2 * B * S * S * cfg.d_model, "full": block}[recompute]
    out = {"forward": fwd, "backward": 2 * fwd, "recompute": cfg.n_layers * extra}
    out["model"] = out["forward"] + out["backward"]
    out["hardware"] = out["model"] + out["recompute"]
    return out


def matmul_params(cfg) -> int:
    """Parameters that take part in a matmul per token (dense): L (4 H^2 + 2 H F) + H V."""
    H = cfg.d_model
    return cfg.n_layers * (4 * H * H + 2 * H * cfg.d_ff) + H * cfg.vocab_size


def six_n_flops(cfg, B, S) -> int:
    """6 N per token plus the attention term 12 L S H per token (dense, no recompute):
    3 (fwd + 2 bwd) x 2 FLOPs per multiply-add x (params + 2 S H of QK^T and PV per layer)."""
    return B * S * (6 * matmul_params(cfg) + 12 * cfg.n_layers * S * cfg.d_model)


def activation_bytes_per_block(cfg, B, S, recompute="none", group_sizes=None) -> int:
    """Bytes a block's cache holds between its forward and its backward (block.py).

    a = itemsize of activations (8 / 4 / 2 bf16), s = itemsize of LayerNorm statistics (8 / 4 / 4).
      dense none:      a * B S (8 H + 2 F)  +  s * 2 B S  +  a * A B S^2
        8 H: LN1 xhat, LN1 out (shared input of q, k, v), q, k, v, attention out (wo input),
             LN2 xhat, LN2 out (w1 input);  2 F: w1 out (gelu input), gelu out (w2 input);
        2 B S: the rstd of the two LayerNorms;  A B S^2: the softmax probabilities.
      selective:       the same minus a * A B S^2
      full:            a * B S H (the block input only)
      MoE: replace the LN2-out term a * B S H by the per-group router state (moe_group_bytes).
    """
    a = compute_dtype(cfg.dtype).itemsize
    s = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    H, F, A = cfg.d_model, cfg.d_ff, cfg.n_heads
    if recompute == "full":
        return a * B * S * H
    probs = a * A * B * S * S if recompute == "none" else 0
    if not cfg.is_moe:
        return a * B * S * (8 * H + 2 * F) + s * 2 * B * S + probs
    groups = sum(moe_group_bytes(cfg, n) for n in _groups(B, S, group_sizes))
    return a * B * S * 7 * H + s * 2 * B * S + probs + groups


def moe_group_bytes(cfg, N, index_itemsize=8) -> int:
    """One routing group of N tokens: u (N, H) and buf, expert out, z, h (E, C, *) in the
    activation dtype; probs (N, E), gates (N, K), f (E,) in the router's arithmetic dtype;
    the group's indices (N), top-k (N, K), expert/token/slot per choice (3 K N) as ints;
    the keep mask (K N) as bools."""
    a = compute_dtype(cfg.dtype).itemsize
    r = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    H, F, E, K = cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.moe_top_k
    C = capacity(N, K, E, cfg.capacity_factor)
    acts = a * (N * H + E * C * (2 * H + 2 * F))
    return acts + r * (N * E + N * K + E) + index_itemsize * (N + N * K + 3 * K * N) + K * N


def megatron_activation_bytes(B, S, H, A) -> float:
    """Korthikanti et al. 2022, eq. 1: s b h (34 + 5 a s / h), 16-bit, with dropout."""
    return S * B * H * (34 + 5 * A * S / H)


def head_activation_bytes(cfg, B, S) -> int:
    """Embedding + head caches: token ids (8 B S); final LN xhat and output, logits, rstd,
    targets."""
    a = compute_dtype(cfg.dtype).itemsize
    s = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    return 8 * B * S + a * B * S * (2 * cfg.d_model + cfg.vocab_size) + s * B * S + 8 * B * S
