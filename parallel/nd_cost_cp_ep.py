"""The closed forms of parallel/nd_cost.py for runs with context or expert parallelism: peak
activation bytes per rank (cp, ep and cp x ep), and an ep rank's bytes per axis and its peak
params / grads / optimizer state (DDP or ZeRO-1/2/3 on both parts: parallel/expert/nd.py).

Context parallelism (C = cp): a cp rank holds S/C tokens of every sequence, so every unit of the
schedule is parallel/nd_cost's unit at S/C tokens (the embedding's ids and the head's cache on
the rank's own positions), each block's cache replaced by the cp block's (cp_block_bytes: the
block at this rank's tp width on S/C tokens without its q, k, v, plus the method's attention
cache as parallel/context/cost.cache_nbytes counts it - ring: q, k, v, o, the log-sum-exp and
the kept score entries of this rank's steps; all-gather: q and the gathered K and V; ulysses:
the head-sharded q, k, v and their probabilities), and the embedding holding the (C, S/C)
positions table.
Expert parallelism (P = ep), padded dispatch only (the stated assumption: every routing group
sends each expert its capacity C, filled or not): each MoE block's cache is
the block without ep plus ep_swap (parallel/expert/cost.ep_moe_activation_bytes with rows_in =
E C rows received by the rank's E / P experts, instead of the single-rank groups); under tp the
experts are replicated over tp and run on all b S tokens. cp x ep: the cp block plus ep_swap on
the cp rank's b S / C tokens (its routing group). Exact dispatch's sizes follow the routing:
refused by name.
The peak over the schedule is parallel/pipeline/cost.peak_activation_bytes of these units, as
nd_cost.rank_peak_activations does without cp and ep.
"""

from __future__ import annotations

import dataclasses

from emulator.flops import activation_bytes_per_block, moe_group_bytes
from emulator.moe import capacity
from emulator.precision import compute_dtype
from parallel.context import cost as cp_cost
from parallel.data.axis import layer_of
from parallel.expert import cost as ep_cost
from parallel.nd_cost import rank_peak_activations, tp_unit_bytes
from parallel.pipeline.cost import UnitBytes, peak_activation_bytes, unit_bytes
from parallel.pipeline.executor import split_layers
from parallel.pipeline.schedules import make_schedule
from parallel.tensor import cost as tp_cost


def peak_activations(cfg, layout, B: int, S: int, coords: dict) -> int:
    """Peak activation bytes of the rank at ``coords`` (its "pp" and "cp" entries matter): cp
    runs by cp_peak_activations (with ep: each MoE block's cache swapped for the ep block's on
    the cp rank's b S/C tokens, ep_swap), ep runs by ep_peak_activations, else
    rank_peak_activations."""
    if layout.cp > 1:
        return cp_peak_activations(cfg, layout, B, S, coords["pp"], coords.get("cp", 0))
    if layout.ep > 1:
        return ep_peak_activations(cfg, layout, B, S, coords["pp"])
    return rank_peak_activations(cfg, layout, B, S, coords["pp"])


def cp_block_bytes(cfg, layout, b: int, S: int, c: int, recompute: str) -> int:
    """One block's cache on cp rank c: parallel/context/cost.py's block at S/C tokens (tp = 1:
    block_activation_bytes; tp > 1: tp_block_activation_bytes, the TP block of this rank's
    width with or without SP), each with the method's attention cache and the positions table.
    Full recompute keeps only the block input."""
    kw = {"recompute": recompute, "balance": layout.cp_balance, "rank": c}
    if layout.tp == 1:
        return cp_cost.block_activation_bytes(cfg, layout.cp_method, b, S, layout.cp, **kw)
    return cp_cost.tp_block_activation_bytes(cfg, layout.cp_method, b, S, layout.cp, layout.tp,
                                             sp=layout.sequence_parallel,
                                             regather=layout.regather, **kw)  # fmt: skip


def cp_peak_activations(cfg, layout, B: int, S: int, s: int, c: int) -> int:
    """rank_peak_activations of stage s on cp rank c: every unit as without cp at S/C tokens
    (the embedding's ids and the head's cache on the rank's own positions), each block's cache
    replaced by cp_block_bytes, and the embedding's cache holding the (C, S/C) positions table
    (8 S: its positions are a row view, and the ledger charges a view's owner); full
    recompute's one recomputed block (the backward's rise) is cp_block_bytes with recompute
    "none"."""
    b = B // (layout.dp * layout.microbatches)
    N = b * (S // layout.cp)  # cp x ep: this cp rank's tokens are one routing group
    block = cp_block_bytes(cfg, layout, b, S, c, layout.recompute)
    block += ep_swap(cfg, layout, N, layout.recompute)
    rise = 0
    if layout.recompute == "full":
        rise = cp_block_bytes(cfg, layout, b, S, c, "none") + ep_swap(cfg, layout, N, "none")
    flat = dataclasses.replace(layout, cp=1, ep=1)
    return _peak_with_blocks(cfg, flat, b, S // layout.cp, s, block, rise, first=8 * S)


def _peak_with_blocks(cfg, flat, b: int, S_l: int, s: int, block: int, rise: int, first=0):
    """Peak activation bytes of stage s of ``flat`` (the layout without the axis) on S_l tokens
    per sequence, as rank_peak_activations' units (tp = 1: pipeline/cost.unit_bytes; tp > 1:
    tp_unit_bytes) with every block's cache ``block`` instead of the plain block's, full
    recompute's rise ``rise``, and ``first`` more bytes on the embedding's unit (u = 0)."""
    sched = make_schedule(flat.schedule, flat.pp, flat.microbatches, flat.chunks)
    split = split_layers(cfg.n_layers, flat.pp * flat.chunks)
    if flat.tp > 1:
        base = tp_unit_bytes(cfg, flat, sched, split, b, S_l)
        plain = tp_cost.block_activation_bytes(cfg, b, S_l, flat.tp, sp=flat.sequence_parallel,
                                               regather=flat.regather,
                                               recompute=flat.recompute)  # fmt: skip
    else:
        base = unit_bytes(cfg, sched, split, b, S_l, flat.recompute)
        plain = activation_bytes_per_block(cfg, b, S_l, flat.recompute)

    def unit(st: int, ch: int) -> UnitBytes:
        u = sched.virtual(st, ch)
        x, k = base(st, ch), len(split[u])
        return UnitBytes(x.cache + k * (block - plain) + first * (u == 0), x.head, x.stash, rise)

    return peak_activation_bytes(sched, unit)[s]


def ep_swap(cfg, layout, N: int, recompute: str) -> int:
    """What an MoE block's cache gains on an ep rank over the same block without ep, one
    routing group of N tokens, padded dispatch (every routing group sends each expert its
    capacity C, so the rank's El experts take rows_in = P El C = E C rows): the ep block's MoE
    bytes (parallel/expert/cost.ep_moe_activation_bytes) instead of the single-rank groups'
    (flops.moe_group_bytes; under tp the tp-sharded experts' F/t - the ep experts are replicated
    over tp and run on all N tokens). 0 without ep, for a dense model, and under full
    recompute (only the block input is kept)."""
    if layout.ep == 1 or not cfg.is_moe or recompute == "full":
        return 0
    if layout.dispatch != "padded":
        raise ValueError(f"dispatch={layout.dispatch!r}: the experts' rows follow the routing "
                         f"(all-to-all-v of the kept copies); a closed form needs dispatch="
                         f"'padded' (every expert filled to capacity)")  # fmt: skip
    rows_in = cfg.n_experts * capacity(N, cfg.moe_top_k, cfg.n_experts, cfg.capacity_factor)
    tp_cfg = dataclasses.replace(cfg, d_ff=cfg.d_ff // layout.tp)
    return ep_cost.ep_moe_activation_bytes(cfg, [N], rows_in) - moe_group_bytes(tp_cfg, N)


def ep_block_bytes(cfg, layout, b: int, S: int, recompute: str) -> int:
    """One MoE block's cache on an ep rank (no cp): the block without ep (tp = 1: flops'
    single-rank block; tp > 1: the tensor-parallel block of tensor/cost.py) plus ep_swap."""
    ep_swap(cfg, layout, b * S, "none")  # exact dispatch: refused by name, whatever recompute
    if layout.tp == 1:
        whole = activation_bytes_per_block(cfg, b, S, recompute)
    else:
        whole = tp_cost.block_activation_bytes(cfg, b, S, layout.tp,
                                               sp=layout.sequence_parallel,
                                               regather=layout.regather,
                                               recompute=recompute)  # fmt: skip
    return whole + ep_swap(cfg, layout, b * S, recompute)


def ep_peak_activations(cfg, layout, B: int, S: int, s: int) -> int:
    """rank_peak_activations of stage s with ep > 1: every unit as without ep, each MoE block's
    cache replaced by ep_block_bytes (full recompute's rise likewise, recompute "none")."""
    b = B // (layout.dp * layout.microbatches)
    block = ep_block_bytes(cfg, layout, b, S, layout.recompute)
    rise = ep_block_bytes(cfg, layout, b, S, "none") if layout.recompute == "full" else 0
    return _peak_with_blocks(cfg, dataclasses.replace(layout, ep=1), b, S, s, block, rise)


def ep_local_shapes(cfg, layout, s: int) -> dict:
    """{name: shape} a rank of stage s holds with ep > 1: parallel/expert/nd.local_shapes (its
    TP shard with the experts replicated over tp and cut to E / ep on axis 0)."""
    from parallel.expert.nd import local_shapes

    return local_shapes(cfg, layout, s)


def ep_rank_bytes(cfg, layout, B: int, S: int, coords: dict) -> dict:
    """{"dp", "edp", "ep", "tp", "pp", "clip"} (+ "cp") bytes sent per step by the rank at
    ``coords`` with ep = P > 1 and padded dispatch: ep per MoE block and micro-batch
    parallel/expert/cost.padded_bytes' four all-to-alls of (P-1)/P E C H w (C the capacity of
    one routing group: the micro-batch's b S tokens, or under cp the cp rank's b S / C; full
    recompute sends the two forward ones again); every other axis parallel/expert/nd.rank_bytes
    (DDP or ZeRO on the replicated and on the expert tensors, tp, pp, cp, the clip norm)."""
    from parallel.expert.nd import rank_bytes  # it imports nd_cost

    P, m, s = layout.ep, layout.microbatches, coords["pp"]
    b, w = B // (layout.dp * m), compute_dtype(cfg.dtype).itemsize
    shapes = ep_local_shapes(cfg, layout, s)
    C = capacity(b * (S // layout.cp), cfg.moe_top_k, cfg.n_experts, cfg.capacity_factor)
    each = ep_cost.padded_bytes(cfg.n_experts, P, C, cfg.d_model, w)["fwd/dispatch"][0]
    blocks = {layer_of(n) for n in shapes if n.startswith("blocks.")}
    per = each * (2 * (1 + (layout.recompute == "full")) + 2)
    return rank_bytes(cfg, layout, B, S, coords, shapes) | {"ep": len(blocks) * m * per}


def ep_rank_memory(cfg, layout, s: int) -> dict:
    """Peak bytes of params, grads and optimizer of a stage-s rank with ep > 1:
    parallel/expert/nd.peak_memory (DDP / ZeRO-1 static; ZeRO-2 one unit's full gradient;
    ZeRO-3 a layer's gathered dense + expert units) and the optimizer's static bytes
    (nd.static_memory)."""
    from parallel.expert.nd import peak_memory, static_memory

    shapes = ep_local_shapes(cfg, layout, s)
    peak = peak_memory(cfg, layout, shapes, s)
    return peak | {"optimizer": static_memory(cfg, layout, shapes)["optimizer"]}
