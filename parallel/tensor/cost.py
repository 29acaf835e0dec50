"""Exact bytes and activation memory of tensor / sequence parallelism, per rank (the ledgers are
tested against these). Letters: B micro-batch, S sequence, H d_model, A heads, F d_ff, V vocab,
T max positions, L layers, K top-k, t the tp degree, w the compute itemsize (8 / 4 / 2 bf16),
s the itemsize of LayerNorm statistics and softmax/CE arithmetic (8 / 4 / 4).

Communication, per rank, sent = received (all ring collectives, so t | n makes them exact):
  layer (per micro-batch)   4 all-reduces of (B, S, H):  8 (t-1)/t B S H w           [Shoeybi §3]
      SP: 2 all-gathers + 2 reduce-scatters: the same 8 (t-1)/t B S H w     [Korthikanti §4.2.2]
      SP with regather: + 2 all-gathers in the backward, 2 (t-1)/t B S H w (1 in an MoE block)
      MoE: + 1 all-reduce of the gate gradients, B S K elements of s bytes
  embedding                 1 all-reduce (SP: RS forward + AG backward): 2 (t-1)/t B S H w
  head + CE                 f^T all-reduce (SP: AG + RS) 2 (t-1)/t B S H w, plus all-reduces
                            of B S (max) and 2 B S (sum-exp, target logit) elements of s bytes
  per step, SP only         one all-reduce of the partial replicated grads: L (6H) + 2H + T H
                            elements (5H per MoE layer: its expert bias is not partial)
  per step                  the clip norm: one all-reduce of a float64 scalar
The B S-element all-reduces need not divide evenly by t: they use collectives.cost exactly.

Activations held by one block between forward and backward (cf. emulator/flops.py):
  dense, no SP:      w B S (4H + (4H + 2F)/t) + s 2 B S + w (A/t) B S^2
  dense, SP:         w B S (8H + 2F)/t + s 2 B S/t + w (A/t) B S^2         (regather: all / t)
  dense, SP, kept:   w B S (2H + (6H + 2F)/t) + s 2 B S/t + w (A/t) B S^2  (gathered inputs kept)
  MoE: drop "m" (one H; the router keeps its own copy) and 2F; add moe_group_bytes per group
  with F -> F/t. "selective" recompute drops the w (A/t) B S^2 probabilities.
With w = 2, s = 4, F = 4H, this is s b h (8 + 24/t + 2 a s/(h t)) + 8 b s without SP and
s b h/t (32 + 2 a s/h) + 8 b s/t with it (``closed_form_16bit``): Megatron's s b h (10 + 24/t +
5 a s/(h t)) and s b h/t (34 + 5 a s/h) (Korthikanti et al. 2022, eqs. 2 and 4;
``megatron_activation_bytes``) without the dropout masks and outputs, and with one stored softmax
instead of the three tensors around attention dropout.
"""

from __future__ import annotations

import dataclasses
import math

from collectives import cost
from emulator.config import param_shapes
from emulator.flops import moe_group_bytes
from emulator.precision import arith_dtype, compute_dtype
from parallel.tensor.sequence import partial_grad_names


def _w_s(cfg):
    w = compute_dtype(cfg.dtype).itemsize
    return w, arith_dtype(compute_dtype(cfg.dtype)).itemsize


def hidden_all_reduce_bytes(cfg, B, S, t) -> int:
    """2 (t-1)/t B S H w: one ring all-reduce of the hidden state (t divides H)."""
    return 2 * (t - 1) * B * S * cfg.d_model * _w_s(cfg)[0] // t


def layer_rows(cfg, B, S, t, *, sp=False, regather=True, rank=0) -> dict:
    """One block, one micro-batch, forward + backward: the bytes one rank sends (= receives), by
    ledger tag. "boundary": f and g (4 all-reduces) or, under SP, g and g-bar (2 all-gathers + 2
    reduce-scatters, each half an all-reduce): the same 8 (t-1)/t B S H w either way.
    "regather": SP's backward all-gathers (2, or 1 in an MoE block). "gates": MoE only."""
    ar = hidden_all_reduce_bytes(cfg, B, S, t)
    gates = cost.ring_all_reduce(B * S * cfg.moe_top_k, t, _w_s(cfg)[1], rank)[0]
    return {
        "boundary": 4 * ar,
        "regather": (1 if cfg.is_moe else 2) * ar // 2 if sp and regather else 0,
        "gates": gates if cfg.is_moe else 0,
    }


def layer_bytes(cfg, B, S, t, *, sp=False, regather=True, rank=0) -> int:
    """Bytes one rank sends (= receives) for one block, forward + backward, one micro-batch."""
    return sum(layer_rows(cfg, B, S, t, sp=sp, regather=regather, rank=rank).values())


def embed_bytes(cfg, B, S, t) -> int:
    return hidden_all_reduce_bytes(cfg, B, S, t)


def head_bytes(cfg, B, S, t, rank=0) -> int:
    s = _w_s(cfg)[1]
    ce = cost.ring_all_reduce(B * S, t, s, rank)[0] + cost.ring_all_reduce(2 * B * S, t, s, rank)[0]
    return hidden_all_reduce_bytes(cfg, B, S, t) + ce


def sp_grad_elements(cfg) -> int:
    shapes = param_shapes(cfg)
    return sum(math.prod(shapes[n]) for n in partial_grad_names(shapes))


def step_bytes(cfg, B, S, t, *, sp=False, regather=True, microbatches=1, rank=0) -> dict:
    """Every row of one training step's traffic for one rank (sent bytes; received is equal
    up to the uneven chunks of the small all-reduces). B is the whole step's batch."""
    b = B // microbatches
    w, layer = _w_s(cfg)[0], layer_bytes(cfg, b, S, t, sp=sp, regather=regather, rank=rank)
    rows = {
        "layers": microbatches * cfg.n_layers * layer,
        "embed": microbatches * embed_bytes(cfg, b, S, t),
        "head": microbatches * head_bytes(cfg, b, S, t, rank),
        "sp/grads": cost.ring_all_reduce(sp_grad_elements(cfg), t, w, rank)[0] if sp else 0,
        "clip": cost.ring_all_reduce(1, t, 8, rank)[0],
    }
    rows["total"] = sum(rows.values())
    return rows


@dataclasses.dataclass(frozen=True)
class _Counts:  # how many (B, S, H) tensors a block keeps at full S, and at S/t or H/t
    full: int
    split: int


def block_activation_bytes(cfg, B, S, t, *, sp=False, regather=True, recompute="none",
                           group_sizes=None) -> int:  # fmt: skip
    """Bytes of one tensor-parallel block's cache on one rank (the table above)."""
    w, s = _w_s(cfg)
    H, F, A = cfg.d_model, cfg.d_ff, cfg.n_heads
    moe = int(cfg.is_moe)
    if not sp:
        n = _Counts(4 - moe, 4)
    elif regather:
        n = _Counts(0, 8 - moe)
    else:
        n = _Counts(2 - moe, 6)
    probs = w * (A // t) * B * S * S if recompute == "none" else 0
    stats = s * 2 * B * S // (t if sp else 1)
    acts = w * B * S * n.full * H + w * B * S * (n.split * H + (0 if moe else 2 * F)) // t
    if moe:
        tp_cfg = dataclasses.replace(cfg, d_ff=F // t)
        sizes = [B * S] if group_sizes is None else group_sizes
        acts += sum(moe_group_bytes(tp_cfg, N) for N in sizes)
    return acts + stats + probs


def closed_form_16bit(b, s, h, a, t, *, sp=False, regather=True) -> int:
    """This model's dense block (F = 4h) in 16 bit (w = 2, statistics s = 4 bytes): the table
    above in Megatron's letters, equal to block_activation_bytes of a "mixed" config.
      no SP            sbh (8 + 24/t + 2as/(ht)) + 8bs
      SP (regather)    sbh/t (32 + 2as/h) + 8bs/t
      SP, kept inputs  sbh (4 + 28/t + 2as/(ht)) + 8bs/t"""
    if not sp:
        return (s * b * h * (8 * t + 24) + 2 * a * s * s * b) // t + 8 * b * s
    kept = 4 * t - 4 if not regather else 0  # the two gathered linear inputs, 2 sbh each
    return (s * b * h * (32 + kept) + 2 * a * s * s * b + 8 * b * s) // t


def megatron_activation_bytes(b, s, h, a, t, *, sp=False, regather=True) -> int:
    """Korthikanti et al. 2022 (section 4), one transformer layer, 16 bit, with dropout:
      tensor parallel, eq. 2         sbh (10 + 24/t + 5as/(ht))
      + sequence parallel, eq. 4     sbh/t (34 + 5as/h)
      + SP keeping the all-gathered inputs of the QKV and first MLP linears (2 sbh each) whole
      instead of re-gathering them (not in the paper): sbh (4 + 30/t + 5as/(ht)).
    The difference to ``closed_form_16bit``: 2 sbh of dropout masks (attention output, MLP
    output) and 3 as^2b of softmax dropout (mask + output) that this model has no dropout for."""
    if not sp:
        return (s * b * h * (10 * t + 24) + 5 * a * s * s * b) // t
    kept = 4 * t - 4 if not regather else 0
    return (s * b * h * (34 + kept) + 5 * a * s * s * b) // t
