"""The closed forms one rank of an N-D run (parallel/train.py) is checked against: the bytes it
sends per step, split by axis, each the sum of that axis's own formula for this rank's share of
the model, and its static / peak memory by category.

Letters: D, P, t the dp, pp, tp degrees; m micro-batches per dp rank, b = B / (D m) sequences
each, S the sequence; c the compute itemsize. A rank's share: its stage's parameter names
(parallel/pipeline/executor.stage_param_names), cut to its TP shard (megatron_plan, local_shape).
  dp    parallel/data/cost.step_bytes on this rank's flat buffers: DDP / ZeRO-1 buckets of the
        local shard (make_buckets), ZeRO-2/3 one unit per layer (parallel/data/axis.layer_units)
  tp    per micro-batch: parallel/tensor/cost.layer_bytes for every block of the stage, plus
        embed_bytes on the embedding's stage and head_bytes on the head's; under SP one ring
        all-reduce per layer of its partial gradients (parallel/tensor/sequence.partial_grad_names)
  pp    parallel/pipeline/cost.boundary_bytes for this stage, message b S_l H c (S_l = S/t with SP)
  clip  one float64 ring all-reduce per group of the norm (dp under ZeRO, tp, pp; size > 1)
  cp    (context parallelism, C = cp) per micro-batch and block of the stage: parallel/context/
        cost.attention_bytes of the method on b sequences of S, the rank's H/t width and A/t
        heads (twice the forward under full recompute). Every other axis sees a cp rank as C
        times the dp ranks with S/C tokens: its formulas run with D C dp ranks (grads summed
        over dp x cp), B C sequences of S/C positions (b per micro-batch): the same bytes.
        With SP too: tp's formulas at the local sequence S/C (SP's all-gathers restore the cp
        rank's S/C tokens, its reduce-scatters cut them to S/(C t)), pp's message b S/(C t) H c.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from collectives import cost
from emulator.config import param_shapes
from emulator.precision import arith_dtype, compute_dtype, master_dtype
from parallel.context import cost as cp_cost
from parallel.data.axis import layer_of, layer_units
from parallel.data.cost import static_memory
from parallel.data.cost import step_bytes as dp_step_bytes
from parallel.data.flat import make_buckets, make_layout
from parallel.pipeline.cost import UnitBytes, boundary_bytes, peak_activation_bytes, unit_bytes
from parallel.pipeline.executor import split_layers, stage_param_names
from parallel.pipeline.schedules import make_schedule
from parallel.tensor import cost as tp_cost
from parallel.tensor.block import megatron_plan
from parallel.tensor.sequence import partial_grad_names
from parallel.tensor.shard import local_shape


def local_shapes(cfg, layout, s: int) -> dict:
    """{name: shape} of the parameters a rank of stage s holds (its TP shard)."""
    split = split_layers(cfg.n_layers, layout.pp * layout.chunks)
    shapes, plan = param_shapes(cfg), megatron_plan(cfg)
    names = stage_param_names(cfg, split, s, layout.pp)
    return {n: local_shape(shapes[n], plan[n], layout.tp, n) for n in names}


def dp_layouts(cfg, layout, s: int) -> list:
    """The flat buffers of stage s's local shard on the dp axis (parallel/data/axis.py)."""
    shapes, D = local_shapes(cfg, layout, s), layout.dp
    if layout.zero >= 2:
        return [make_layout(i, {n: shapes[n] for n in u}, D)
                for i, u in enumerate(layer_units(shapes))]  # fmt: skip
    c = compute_dtype(cfg.dtype).itemsize
    return make_buckets(shapes, D, layout.bucket_cap_mb, c)


def rank_bytes(cfg, layout, B: int, S: int, coords: dict) -> dict:
    """{"dp", "tp", "pp", "clip": bytes sent per step} for the rank at ``coords`` (+ "cp")."""
    if layout.cp > 1:
        return _cp_rank_bytes(cfg, layout, B, S, coords)
    s, tr, t, D, m = coords["pp"], coords["tp"], layout.tp, layout.dp, layout.microbatches
    c, b = compute_dtype(cfg.dtype).itemsize, B // (D * m)
    names = list(local_shapes(cfg, layout, s))
    stage = "ddp" if layout.zero == 0 else layout.zero
    dp = 0
    if D > 1:
        lays = dp_layouts(cfg, layout, s)
        dp = sum(dp_step_bytes(stage, lays, cfg.dtype, m, layout.reshard_after_forward).values())
    tp = 0
    if t > 1:
        sp, kw = layout.sequence_parallel, {"sp": layout.sequence_parallel, "rank": tr}
        blocks = {layer_of(n) for n in names if n.startswith("blocks.")}
        tp = len(blocks) * tp_cost.layer_bytes(cfg, b, S, t, regather=layout.regather, **kw)
        tp += tp_cost.embed_bytes(cfg, b, S, t) if "embed.tok" in names else 0
        tp += tp_cost.head_bytes(cfg, b, S, t, tr) if "head.w" in names else 0
        for layer in dict.fromkeys(layer_of(n) for n in names) if sp else ():
            shapes = local_shapes(cfg, layout, s)
            part = [n for n in partial_grad_names(names) if layer_of(n) == layer]
            n_el = sum(math.prod(shapes[n]) for n in part)
            tp += cost.ring_all_reduce(n_el, t, c, tr)[0] if n_el else 0
        tp *= m
    sched = make_schedule(layout.schedule, layout.pp, m, layout.chunks)
    S_l = S // t if layout.sequence_parallel else S
    pp = boundary_bytes(sched, b * S_l * cfg.d_model * c)[s]
    clip = 0
    for size, rank in ((D, coords["dp"]) if layout.zero else (1, 0), (t, tr), (layout.pp, s)):
        clip += cost.ring_all_reduce(1, size, 8, rank)[0] if size > 1 else 0
    return {"dp": dp, "tp": tp, "pp": pp, "clip": clip}


def _as_dp(layout):
    """Under cp, the layout the data axis sees: DDP / ZeRO run on the dp x cp group."""
    return dataclasses.replace(layout, dp=layout.dp * layout.cp, cp=1) if layout.cp > 1 else layout


def _cp_rank_bytes(cfg, layout, B: int, S: int, coords: dict) -> dict:
    """rank_bytes under cp = C: the other axes as a dp x cp = D C data axis on S/C tokens (its
    group rank d C + c, Mesh.group("dp", "cp")), plus the attention bytes on the cp axis."""
    C, t, m = layout.cp, layout.tp, layout.microbatches
    flat = _as_dp(layout)
    out = rank_bytes(cfg, flat, B * C, S // C, dict(coords, dp=coords["dp"] * C + coords["cp"]))
    x = compute_dtype(cfg.dtype)
    b, H, A = B // (layout.dp * m), cfg.d_model // t, cfg.n_heads // t  # the rank's heads
    per = cp_cost.attention_bytes(layout.cp_method, b, S, H, A, C, x.itemsize,
                                  arith_dtype(x).itemsize)  # fmt: skip
    blocks = {layer_of(n) for n in local_shapes(cfg, layout, coords["pp"]) if n[:7] == "blocks."}
    fwd = per["forward"] * (2 if layout.recompute == "full" else 1)  # full: forward again
    return out | {"cp": len(blocks) * m * (fwd + per["backward"])}


def rank_static_memory(cfg, layout, s: int) -> dict:
    """Bytes per category of the state that lives for the whole run, rank of stage s:
    parallel/data/cost.static_memory on its local shard (dp = 1 and zero 0: plain AdamW, the
    gradients unpadded: Psi c). cp > 1: the dp axis is dp x cp (_as_dp)."""
    layout = _as_dp(layout)
    shapes = local_shapes(cfg, layout, s)
    n = sum(math.prod(x) for x in shapes.values())
    if layout.zero == 0 and layout.dp == 1:
        c, mi = compute_dtype(cfg.dtype).itemsize, master_dtype(cfg.dtype).itemsize
        mixed = cfg.dtype == "mixed"
        return {"params": n * (mi + c * mixed), "grads": n * c, "optimizer": 2 * n * mi}
    stage = "ddp" if layout.zero == 0 else layout.zero
    return static_memory(stage, dp_layouts(cfg, layout, s), n, cfg.dtype)


def rank_peak_memory(cfg, layout, s: int) -> dict:
    """Peak params / grads (ZeRO-2/3): the static state plus, for grads (2, 3), one unit's
    transient full gradient (max padded c: one layer's backward at a time), and for params (3)
    the gathered units - with reshard_after_forward one at a time, or with prefetch a layer and
    the next one of the same action (a chunk's layers, forward or backward order); without it
    a unit stays gathered from a forward until the next backward of its layer frees it, so the
    peak follows the schedule (_replay_no_reshard). cp > 1: the dp axis is dp x cp."""
    layout = _as_dp(layout)
    static = rank_static_memory(cfg, layout, s)
    peak = {"params": static["params"], "grads": static["grads"]}
    if layout.zero < 2:
        return peak
    c = compute_dtype(cfg.dtype).itemsize
    lays = dp_layouts(cfg, layout, s)
    peak["grads"] += max(lay.padded for lay in lays) * c
    if layout.zero == 3:
        size = {layer_of(lay.names[0]): lay.padded for lay in lays}
        if not layout.reshard_after_forward:
            live = _replay_no_reshard(cfg, layout, s, size)
        else:
            live = max(lay.padded for lay in lays)
        if layout.prefetch and layout.reshard_after_forward:  # consecutive layers of a chunk
            split = split_layers(cfg.n_layers, layout.pp * layout.chunks)
            U = layout.pp * layout.chunks
            for u in range(s, U, layout.pp):
                order = ["embed"] * (u == 0) + [f"blocks.{i}" for i in split[u]]
                order += ["head"] * (u == U - 1)
                for a, z in itertools.pairwise(order):
                    live = max(live, size[a] + size[z])
        peak["params"] += live * c
    return peak


def _replay_no_reshard(cfg, layout, s: int, size: dict) -> int:
    """Largest sum of gathered units on stage s over its action list without resharding: F
    gathers each of its layers' units (if not already gathered; with prefetch also the next
    layer's), B gathers likewise and frees each layer's unit after its backward."""
    sched = make_schedule(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    split = split_layers(cfg.n_layers, layout.pp * layout.chunks)
    U, live, peak = sched.p * sched.v, set(), 0
    for a in sched.stages[s]:
        u = sched.virtual(s, a.chunk)
        order = ["embed"] * (u == 0) + [f"blocks.{i}" for i in split[u]] + ["head"] * (u == U - 1)
        order = order if a.kind == "F" else order[::-1]
        for k, layer in enumerate(order):
            live |= {layer} | ({order[k + 1]} if layout.prefetch and k + 1 < len(order) else set())
            peak = max(peak, sum(size[x] for x in live))
            if a.kind == "B":
                live.discard(layer)
    return peak


def tp_unit_bytes(cfg, layout, sched, split, b: int, S: int):
    """unit(s, c) -> UnitBytes of one micro-batch of chunk c on a TP rank of stage s: the
    chunk's blocks x tensor/cost.block_activation_bytes, + the vocab-parallel embedding's cache
    (owned-id indices int64 and mask: 9 b S) on u = 0, + the vocab-parallel head's on u = U-1:
    LN xhat and rstd on S_l positions, the head's (gathered) input b S H, the local logits
    b S V/t, the target indices and mask (9 b S), the max M (b S) and the summed exponentials,
    kept as a row of the (2, b S) all-reduced buffer (2 b S), in the arithmetic dtype."""
    t, sp = layout.tp, layout.sequence_parallel
    a = compute_dtype(cfg.dtype).itemsize
    r = arith_dtype(compute_dtype(cfg.dtype)).itemsize
    N, S_l, H, U = b * S, (S // t if sp else S), cfg.d_model, sched.p * sched.v
    block = tp_cost.block_activation_bytes(cfg, b, S, t, sp=sp, regather=layout.regather,
                                           recompute=layout.recompute)  # fmt: skip
    embed = 9 * N
    head = a * b * S_l * H + r * b * S_l + a * N * H + a * N * cfg.vocab_size // t + 9 * N
    head += 3 * r * N

    def unit(s: int, c: int) -> UnitBytes:
        u = sched.virtual(s, c)
        last = head * (u == U - 1)
        return UnitBytes(len(split[u]) * block + embed * (u == 0) + last, last)

    return unit


def rank_peak_activations(cfg, layout, B: int, S: int, s: int) -> int:
    """Peak activation bytes of stage s in a step: parallel/pipeline/cost.peak_activation_bytes
    of the layout's schedule with each unit's bytes - tp = 1: pipeline/cost.unit_bytes (blocks
    x flops.activation_bytes_per_block + token ids + the head's cache); tp > 1: tp_unit_bytes -
    with b = B / (D m) sequences per micro-batch."""
    sched = make_schedule(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    split = split_layers(cfg.n_layers, layout.pp * layout.chunks)
    b = B // (layout.dp * layout.microbatches)
    if layout.tp > 1:
        unit = tp_unit_bytes(cfg, layout, sched, split, b, S)
    else:
        unit = unit_bytes(cfg, sched, split, b, S, layout.recompute)
    return peak_activation_bytes(sched, unit)[s]
