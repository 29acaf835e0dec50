"""What a pipeline stage holds and sends, in closed form: activation bytes, boundary bytes, dp bytes.

Letters: p stages, v chunks, U = p v virtual stages, m micro-batches of b sequences, S sequence,
H d_model, F d_ff, D data-parallel degree; a = activation itemsize (8 / 4 / 2 bf16), r = itemsize
of the LayerNorm statistics (8 / 4 / 4). A unit is one (micro-batch, chunk) on a stage.

Activations (every number is what the memory ledger charges, emulator/memory.py saved_nbytes):
  cache C(s, c)  from F to the end of its backward: the chunk's blocks x
                 flops.activation_bytes_per_block, + 8 b S token ids if u = 0 (embedding),
                 + the head's cache (final LN, logits, rstd, targets) if u = U - 1
  stash W(s, c)  ZB-H1 only, from B to W: B frees the head and swaps each block's cache for its
                 W stash (zero_bubble.py); the token ids stay until W runs embed_backward
  stash per dense block = a b S (12 H + 2 F) + 2 r b S: the (x, dy) of the six linears - x of
      q, k, v is one array -, (xhat, dy) and rstd of both LayerNorms: dy w2, h, dz, LN2 out, dm,
      xhat2, do-input, attention out, dq, dk, dv, LN1 out, da, xhat1 (12 H + 2 F) and 2 rstd.
      It exceeds the block's cache by a b S (4 H - A S): it keeps six gradients but not the
      A S^2 probabilities nor q, k, v, gelu's input (Qi et al. 2023, section 2: W "needs the
      input and output gradient" of every linear).
Peak per stage: live bytes rise only during F, fall only during an unsplit B or a W, and during a
split B every block adds the same stash - cache after the head is freed; so the peak is at an
action boundary: max over the action list of sum_c (n_c C + q_c W) with n_c / q_c the units of
chunk c cached / stashed (the per-chunk in-flight counts). With full recompute an unsplit B also
holds one block's recomputed cache R for a moment: start - head + R. Closed forms:
  GPipe m C_s;  1F1B min(p - s, m) C_s;  ZB-H1, m >= p: (p-1-s) C_s + s W_s + max(C_s, W_s)
  (1F1B's after each F, but s units stashed and, after B, one more: its excess over 1F1B on
  stage 0 is max(0, W_0 - C_0)).
"""

from __future__ import annotations

from dataclasses import dataclass

from emulator.flops import activation_bytes_per_block, head_activation_bytes
from emulator.model import param_shapes
from emulator.precision import arith_dtype, compute_dtype
from parallel.data.cost import step_bytes
from parallel.data.flat import make_buckets
from parallel.pipeline.schedules import Schedule


@dataclass(frozen=True)
class UnitBytes:
    cache: int  # F .. end of backward (B, or W for the ids when split)
    head: int = 0  # the part of cache the backward frees first (the head's)
    stash: int = 0  # B .. W when the backward is split
    rise: int = 0  # full recompute: one block's recomputed cache during B


def stash_bytes_per_block(cfg, b: int, S: int) -> int:
    """Bytes of one dense block's W stash (module docstring)."""
    if cfg.is_moe:
        raise ValueError("stash_bytes_per_block: no closed form for an MoE block's stash (its B "
                         "computes the expert gradients too); use a dense model")  # fmt: skip
    a = compute_dtype(cfg.dtype).itemsize
    r = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    return a * b * S * (12 * cfg.d_model + 2 * cfg.d_ff) + 2 * r * b * S


def unit_bytes(cfg, sched: Schedule, split: list, b: int, S: int, recompute="none"):
    """-> unit(s, c) -> UnitBytes of one micro-batch of chunk c on stage s."""
    U, ids = sched.p * sched.v, 8 * b * S
    block = activation_bytes_per_block(cfg, b, S, recompute)
    head = head_activation_bytes(cfg, b, S) - ids  # the ids are charged to the embedding
    stash = stash_bytes_per_block(cfg, b, S) if sched.split else 0
    rise = activation_bytes_per_block(cfg, b, S, "none") if recompute == "full" else 0

    def unit(s: int, c: int) -> UnitBytes:
        u = sched.virtual(s, c)
        k, first, last = len(split[u]), ids * (u == 0), head * (u == U - 1)
        return UnitBytes(k * block + first + last, last, k * stash + first if stash else 0, rise)

    return unit


def peak_activation_bytes(sched: Schedule, unit) -> list[int]:
    """Per stage: the largest sum of live units' bytes at any action boundary (see above)."""
    peaks = []
    for s, acts in enumerate(sched.stages):
        cur = peak = 0
        for a in acts:
            x = unit(s, a.chunk)
            if a.kind == "F":
                cur += x.cache
            elif a.kind == "B":
                peak = max(peak, cur - x.head + x.rise)
                cur += x.stash - x.cache if sched.split else -x.cache
            else:  # W
                cur -= x.stash
            peak = max(peak, cur)
        peaks.append(peak)
    return peaks


def peak_closed_form(sched: Schedule, unit) -> list[int]:
    """GPipe m C_s, 1F1B min(p-s, m) C_s (+ max(0, R - head) with full recompute), ZB-H1 with
    m >= p (p-1-s) C_s + s W_s + max(C_s, W_s); ValueError for any other schedule or domain
    (peak_activation_bytes covers them all)."""
    p, m = sched.p, sched.m
    x = [unit(s, 0) for s in range(p)]
    if sched.name in ("gpipe", "1f1b") and sched.v == 1 and not sched.split:
        n = [m if sched.name == "gpipe" else min(p - s, m) for s in range(p)]
        return [n[s] * x[s].cache + max(0, x[s].rise - x[s].head) for s in range(p)]
    if sched.name == "zb-h1" and sched.split and m >= p:
        return [(p - 1 - s) * x[s].cache + s * x[s].stash + max(x[s].cache, x[s].stash)
                for s in range(p)]  # fmt: skip
    raise ValueError(
        f"no closed-form peak for {sched.name!r} with p={p}, m={m}, v={sched.v} (ZB-H1's needs "
        f"m >= p); peak_activation_bytes gives it from the per-chunk in-flight counts"
    )


def boundary_bytes(sched: Schedule, msg: int) -> list[int]:
    """Bytes stage s sends (= receives) per step over its stage boundaries: every unit sends its
    output on except on u = U-1 and its input gradient back except on u = 0, so v times 1F1B's
    crossings - but only between different ranks: with p = 1 every chunk is on one rank and
    the messages stay local (0 bytes). msg = b S H a, one activation or its gradient."""
    p, m, v = sched.p, sched.m, sched.v
    if p == 1:
        return [0]
    return [(2 * m * v - m * (s == 0) - m * (s == p - 1)) * msg for s in range(p)]


def dp_bytes(cfg, names: list, D: int, mode: str, bucket_cap_mb: float = 25.0) -> int:
    """Bytes one dp rank of a stage sends (= receives) per step over its dp group: DDP's
    all-reduce or ZeRO-1's reduce-scatter + all-gather of the stage's own parameters, laid out
    in DDP's / ZeRO's padded buckets (parallel/dp_check.step_bytes; once per step: the
    pipeline hands the m micro-batches' summed gradient over once)."""
    if mode == "none" or D == 1:
        return 0
    shapes = {n: param_shapes(cfg)[n] for n in names}
    layouts = make_buckets(shapes, D, bucket_cap_mb, compute_dtype(cfg.dtype).itemsize)
    return sum(step_bytes("ddp" if mode == "ddp" else 1, layouts, cfg.dtype).values())
