"""Expert parallelism inside the N-D program (parallel/train.py): the ep groups, the MoE drop-in
pair bound to them, the data-parallel hooks that sum expert and replicated gradients over
different groups, and the per-axis bytes of such a run.

Letters: D dp, P = ep, Q = D / P the expert-data-parallel degree (edp), t tp, E experts,
El = E / P. The ep group is drawn from the data-parallel ranks (Megatron-core, DeepSpeed-MoE):
dp rank d = q P + e sits at ep coordinate e = d mod P and edp coordinate q = d // P, so an ep
group is P neighbouring dp ranks (same pp, cp, tp coordinates) and every rank routes its own
tokens: the routing groups stay the spec's default, one per micro-batch per dp rank.
A rank holds experts e El .. (e+1) El - 1 of every MoE block of its stage; router and everything
else replicated over ep (or sharded by the other axes as before).

Context parallelism (cp = C > 1): the ep group is drawn from the dp ranks at the SAME cp
coordinate (ep | dp; Megatron-core's expert group inside its dp-cp group), and each cp rank's
tokens of a micro-batch are one routing group (what parallel.train does for MoE under cp; the
reference gets them from parallel.context.train.routing_groups): an ep rank sends its own S/C
positions' token copies to the experts' owners and the cp ranks never exchange tokens.

Gradients and optimizer (ep_axis: parallel/data/axis.py's DataAxis with two parts): replicated
ones summed over dp (x cp) (tags dp/grads*, dp/params*), expert ones over edp (x cp) (tags
edp/dp/grads*, edp/dp/params*; memory names "edp.<name>"): the all-to-alls already brought every
ep rank's token copies to the expert; the cp ranks hold other tokens, so their gradients are
summed as over dp. zero 0: two DDPs; zero 1/2/3: two ZeroOptimizers of the same stage, the
dense tensors sharded D C ways, the experts Q C ways; ZeRO-2/3 one unit per layer and engine (a
block's dense and expert tensors), ZeRO-3 gathering both before the layer's forward / backward.
Clipping: ONE norm. DDP: squares over ep (the replicated gradients, identical over ep after the
sum, weigh 1/P), then tp (1/t for tp-replicated tensors, the experts among them), pp. ZeRO: dp
rank (q, e) at cp rank c owns a distinct shard of the dense tensors and a distinct shard of
expert group e's experts, so the owned squares summed over dp x cp count every element once;
then tp (1/t), pp. Bytes: data_bytes / dp_bytes (both parts, every stage), clip_bytes, tp_bytes,
rank_bytes (every axis but ep), ep_step_bytes (the ep axis from the group's routing counts);
static_memory and peak_memory (every stage), all = the ledgers on every rank.
Ledger: every all-to-all of layer L, micro-batch j under "ep/<L>/mb<j>/<fwd|bwd>/<phase>",
phases as parallel/expert/cost.py (counts, dispatch, combine), whatever scope is open around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from collectives import cost as ccost
from emulator import affinity
from emulator.mesh import Mesh
from emulator.precision import compute_dtype
from emulator.rank import current_state
from parallel import nd_cost
from parallel.data.axis import DataAxis, Part, layer_of, layer_units
from parallel.data.cost import static_memory as dp_static
from parallel.data.cost import step_bytes as dp_step_bytes
from parallel.data.flat import make_buckets, make_layout
from parallel.expert import cost as ep_cost
from parallel.expert.layer import ep_moe_backward, ep_moe_forward
from parallel.expert.load import layer_route
from parallel.expert.sync import is_expert
from parallel.tensor import cost as tp_cost
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import REPLICATE, local_shape


def ep_mesh(comm, layout) -> Mesh:
    """The mesh edp x ep x pp x cp x tp over the same ranks as layout.mesh (dp = edp x ep,
    ep inner): every group created here, in one order on every rank."""
    mesh = Mesh(comm, edp=layout.dp // layout.ep, ep=layout.ep, pp=layout.pp, cp=layout.cp,
                tp=layout.tp)  # fmt: skip
    mesh.group("ep")
    mesh.group("edp")
    return mesh


def expert_plan(plan: dict) -> dict:
    """megatron_plan with the expert tensors replicated over tp (they are cut over ep instead:
    Megatron-core's expert-tensor-parallel size 1); everything else as before."""
    return {n: (REPLICATE if is_expert(n) else p) for n, p in plan.items()}


def shard_experts(params: dict, e: int, El: int) -> dict:
    """{name: array} -> the expert tensors cut to experts e El .. (e+1) El - 1 (axis 0)."""
    sl = slice(e * El, (e + 1) * El)
    return {n: (a[sl].copy() if is_expert(n) else a) for n, a in params.items()}


def local_shapes(cfg, layout, s: int) -> dict:
    """{name: shape} a rank of stage s holds in an ep run, from the config alone: the stage's
    whole shapes (nd_cost.local_shapes at tp = 1), the experts cut to E / ep along axis 0 and
    replicated over tp (expert_plan), everything else cut by tp as megatron_plan says."""
    plan, P = expert_plan(megatron_plan(cfg)), layout.ep
    whole = nd_cost.local_shapes(cfg, dataclasses.replace(layout, tp=1), s)
    return {n: (x[0] // P, *x[1:]) if is_expert(n) else local_shape(x, plan[n], layout.tp, n)
            for n, x in whole.items()}  # fmt: skip


def unshard_experts(ep, params: dict, grads: dict) -> tuple[dict, dict]:
    """The stage's params / grads with the experts concatenated back to E over the ep group, in
    ep-coordinate order (uncounted: the check, not the training)."""
    every = ep.allgather_object((params, grads))
    # each expert tensor joined once per ep group on virtual ranks (affinity.shared_map)
    items = [(k, n) for k, d in enumerate((params, grads)) for n in d if is_expert(n)]
    joined = affinity.shared_map(
        ep, items, lambda kn: np.concatenate([e[kn[0]][kn[1]] for e in every])
    )

    def whole(k, d):
        return {n: joined.get((k, n), a) for n, a in d.items()}

    return whole(0, params), whole(1, grads)


@contextlib.contextmanager
def _rooted(tag: str):
    """Record the traffic inside under exactly ``tag`` (not under the tp scope around the
    block): ep bytes are the ep axis's, whatever layer scope is open."""
    state = current_state()
    if state is None:
        yield
        return
    saved, state.tags = state.tags, [tag]
    try:
        yield
    finally:
        state.tags = saved


def moe_pair(ep, dispatch: str, record: dict, log: dict | None = None):
    """(forward, backward) with emulator's moe_fn signatures plus ``where`` (the block's cache
    name "mb<j>.blocks.<i>", bound by LayerContext). record[(layer, mb)] = (kept (E,), C): the
    kept token copies per expert and the slot total of this rank's groups (the formula's input);
    log[(layer, mb)]: the LayerRoute (load table, counts, decisions; parallel/expert/load.py)."""

    def forward(mp, m, groups, *, top_k, capacity_factor, where):
        mb, layer = where.split(".", 1)
        tag = f"ep/{layer}/{mb}"
        with _rooted(tag):
            y, aux, cache = ep_moe_forward(ep, mp, m, groups, top_k=top_k,
                                           capacity_factor=capacity_factor, dispatch=dispatch,
                                           prefix="")  # fmt: skip
        E = mp["router"].shape[1]
        kept = ep_cost.kept_table([cache["routes"]], E)[0]
        record[(layer, int(mb[2:]))] = (kept, sum(int(r["C"]) for r in cache["routes"]))
        if log is not None:
            log[(layer, int(mb[2:]))] = layer_route(cache, E, m.shape[1])
        cache["where"] = tag
        return y, aux, cache

    def backward(dy, cache, daux):
        with _rooted(cache["where"]):
            return ep_moe_backward(dy, cache, daux)

    return forward, backward


def ep_axis(
    data,
    emesh,
    master: dict,
    cfg,
    layout,
    *,
    tp,
    pp,
    tp_replicated,
    hyper: dict,
    max_norm=None,
    partial=None,
    mem=None,
) -> DataAxis:
    """The dp-axis hooks of an ep run: parallel/data/axis.py's DataAxis with two parts - the
    dense tensors over ``data`` (dp, or dp x cp), the experts over edp (x cp) under the label
    "edp" - both DDP (zero 0) or ZeRO stage ``layout.zero``, and one global norm:
      zero 0  after DDP the dense gradients are replicated over dp, the experts' over edp, and
              the ep ranks hold different experts: squares reduced over ep (dense weight 1/P),
              then tp (1/t for tp-replicated tensors; the experts are) and pp;
      zero>0  dp rank (q, e) owns a distinct shard of the dense tensors AND a distinct shard of
              expert group e's experts, so the owned squares summed over ``data`` (dp x cp)
              are every element once; then tp (1/t), pp."""
    P, t, zero = layout.ep, tp.size, layout.zero
    edp = emesh.group("edp", "cp") if layout.cp > 1 else emesh["edp"]
    dense = tuple(n for n in master if not is_expert(n))
    experts = tuple(n for n in master if is_expert(n))
    parts = [Part(data, dense)] + ([Part(edp, experts, "edp")] if experts else [])
    w = {n: (1.0 / t if n in tp_replicated else 1.0) for n in master}
    if zero == 0:
        w = {n: x if is_expert(n) else x / P for n, x in w.items()}
    return DataAxis(data, master, zero, cfg, hyper=hyper, max_norm=max_norm,
                    norm_groups=(emesh["ep"], tp, pp) if zero == 0 else (tp, pp),
                    norm_weights=w if zero == 0 or t > 1 else None,
                    bucket_cap_mb=layout.bucket_cap_mb, partial=partial, mem=mem, parts=parts,
                    reshard_after_forward=layout.reshard_after_forward,
                    prefetch=layout.prefetch)  # fmt: skip


# ---- bytes -----------------------------------------------------------------------------------
def ep_layer_bytes(dispatch: str, kept, C: int, H: int, itemsize: int, rank: int) -> dict:
    """{phase: (sent, received)} of one MoE layer and micro-batch: parallel/expert/cost.py's
    formula, kept (P, E) the ep group's kept copies, C the slot total of one rank's groups."""
    return ep_cost.layer_bytes(dispatch, np.asarray(kept), C, H, itemsize, rank)


def ep_step_bytes(
    dispatch: str, group_counts: list, e: int, H: int, itemsize: int, rerun: bool = False
) -> int:
    """Bytes ep rank ``e`` sends on the ep axis in one step: ep_layer_bytes of every MoE layer
    and micro-batch, from ``group_counts`` - its ep group's NDRun.ep_counts[step] in ep order
    ({(layer, mb): (kept (E,), C)}) - summed over the phases; ``rerun`` (recompute="full") runs
    the forward's all-to-alls twice."""
    total = 0
    for key, (_, C) in group_counts[e].items():
        kept = np.stack([g[key][0] for g in group_counts])  # (P, E)
        for ph, (sent, _) in ep_layer_bytes(dispatch, kept, C, H, itemsize, e).items():
            total += sent * (2 if rerun and ph.startswith("fwd") else 1)
    return total


def _parts(cfg, layout, shapes: dict) -> list:
    """[(layouts, numel)] of ep_axis's two parts for local ``shapes``: the dense tensors over
    D C ranks, the experts over (D / P) C (C = cp); DDP / ZeRO-1 buckets (make_buckets) or,
    ZeRO-2/3, one unit per layer (parallel/data/axis.layer_units), as DataAxis builds them."""
    c, out = compute_dtype(cfg.dtype).itemsize, []
    for expert, D in ((False, layout.dp), (True, layout.dp // layout.ep)):
        mine = {n: s for n, s in shapes.items() if is_expert(n) == expert}
        if not mine:
            continue
        D *= layout.cp
        if layout.zero >= 2:
            lays = [make_layout(i, {n: mine[n] for n in u}, D)
                    for i, u in enumerate(layer_units(mine))]  # fmt: skip
        else:
            lays = make_buckets(mine, D, layout.bucket_cap_mb, c)
        out.append((lays, sum(math.prod(x) for x in mine.values())))
    return out


def data_bytes(cfg, layout, shapes: dict) -> dict:
    """{"dp": dense, "edp": experts} bytes this rank sends per step: parallel/data/cost.
    step_bytes of each part - DDP (2 unit), ZeRO-1 (2 unit), ZeRO-2 ((m + 1) unit), ZeRO-3
    (3 m unit, 2 m without resharding), unit = Psi_pad (D-1)/D c - with D = dp C for the dense
    tensors and (dp / ep) C for the experts; a part over one rank moves nothing."""
    stage = "ddp" if layout.zero == 0 else layout.zero
    out = {"dp": 0, "edp": 0}
    for (lays, _), axis in zip(_parts(cfg, layout, shapes), ("dp", "edp")):
        if lays[0].D > 1:
            out[axis] = sum(dp_step_bytes(stage, lays, cfg.dtype, layout.microbatches,
                                          layout.reshard_after_forward).values())  # fmt: skip
    return out


def dp_bytes(cfg, layout, shapes: dict) -> int:
    """Bytes this rank sends per step on dp and edp together (data_bytes summed)."""
    return sum(data_bytes(cfg, layout, shapes).values())


def rank_bytes(cfg, layout, B: int, S: int, coords: dict, shapes: dict) -> dict:
    """Every axis's bytes per step of the rank at ``coords`` (local ``shapes``) but "ep" (whose
    all-to-alls follow the routing: ep_layer_bytes per layer): dp / edp (data_bytes), tp
    (tp_bytes), pp and cp (parallel/nd_cost.rank_bytes: ep changes neither the boundary
    messages nor the attention), clip (clip_bytes)."""
    generic = nd_cost.rank_bytes(cfg, dataclasses.replace(layout, ep=1), B, S, coords)
    return (
        data_bytes(cfg, layout, shapes)
        | {
            "tp": tp_bytes(cfg, layout, B, S, coords),
            "pp": generic["pp"],
            "clip": clip_bytes(layout, coords),
        }
        | ({"cp": generic["cp"]} if layout.cp > 1 else {})
    )


def clip_bytes(layout, coords: dict) -> int:
    """Bytes this rank sends per step for the norm: one float64 ring all-reduce per group of
    size > 1 - zero 0 over ep, ZeRO over dp x cp (its rank d C + c) - then tp, pp."""
    if layout.zero == 0:
        first = (layout.ep, coords["ep"])
    else:
        first = (layout.dp * layout.cp, coords["dp"] * layout.cp + coords.get("cp", 0))
    return sum(ccost.ring_all_reduce(1, n, 8, r)[0] for n, r in
               (first, (layout.tp, coords["tp"]), (layout.pp, coords["pp"])) if n > 1)  # fmt: skip


def tp_bytes(cfg, layout, B: int, S: int, coords: dict) -> int:
    """Bytes this rank sends per step on tp: parallel/nd_cost.rank_bytes's tp formula, with each
    MoE block's share replaced. Its experts are replicated over tp and run on the full m, so the
    block keeps the attention's f / g (2 all-reduces of (b, S, H); SP: AG + RS both ways) and
    only the entry of m: none without SP, an all-gather forward and of dy backward with it. So
    per block and micro-batch, against nd_cost's 4 ar + gates: (2 - sp) ar + gates fewer
    (cp: on the rank's S / C positions)."""
    t, m, sp = layout.tp, layout.microbatches, layout.sequence_parallel
    if t == 1:
        return 0
    b, S_l = B // (layout.dp * m), S // layout.cp  # cp: this rank's S / C positions
    generic = nd_cost.rank_bytes(cfg, dataclasses.replace(layout, ep=1), B, S, coords)["tp"]
    rows = tp_cost.layer_rows(cfg, b, S_l, t, sp=sp, regather=layout.regather, rank=coords["tp"])
    ar = tp_cost.hidden_all_reduce_bytes(cfg, b, S_l, t)
    n_blocks = len({n.split(".")[1] for n in nd_cost.local_shapes(cfg, layout, coords["pp"])
                    if n.startswith("blocks.")})  # fmt: skip
    return generic - m * n_blocks * ((2 - sp) * ar + rows["gates"])


def static_memory(cfg, layout, shapes: dict) -> dict:
    """Bytes per category of ep_axis's state for local ``shapes``: parallel/data/cost.
    static_memory of each part (its layouts, D = dp C dense, (dp / ep) C experts), summed; under
    DDP the master params (+ the compute copy in mixed) and AdamW's moments are one set for both
    parts, and a part over one rank keeps its local gradient unpadded (numel c)."""
    stage = "ddp" if layout.zero == 0 else layout.zero
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for lays, n in _parts(cfg, layout, shapes):
        for k, v in dp_static(stage, lays, n, cfg.dtype).items():
            out[k] += v
    return out


def peak_memory(cfg, layout, shapes: dict, s: int) -> dict:
    """Peak params / grads of ep_axis's state, stage s: parallel/nd_cost.zero_peaks on
    static_memory with both parts' units - ZeRO-2/3 one unit's full gradient at a time (a
    layer's dense unit is reduce-scattered before its expert unit fills), ZeRO-3 a layer's
    gathered dense + expert units (prefetch: with the next layer's; without resharding: the
    schedule's replay)."""
    size, unit = {}, 0
    for lays, _ in _parts(cfg, layout, shapes) if layout.zero >= 2 else ():
        for lay in lays:
            k = layer_of(lay.names[0])
            size[k], unit = size.get(k, 0) + lay.padded, max(unit, lay.padded)
    return nd_cost.zero_peaks(cfg, layout, s, static_memory(cfg, layout, shapes), size, unit)
