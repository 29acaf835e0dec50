"""One training program for every layout: dp x pp x tp (+ SP), ZeRO 0-3 on dp, any schedule.

    run = parallel.train(comm, Layout(dp=2, pp=2, tp=2, zero=3), cfg, batches, steps=3, seed=0)

on every rank; `run` is comparable with emulator.reference.reference_train(cfg, seed, batches,
steps, microbatches=dp * layout.microbatches) (emulator.check.compare_run). One model driver:
  - the layer functions are the single-rank pieces or their TP versions, chosen by the rank's
    LayerContext (parallel/layer.py: tp group + SP flag; cp / ep slots);
  - the pipeline executor (parallel/pipeline/executor.py) runs the rank's stage's layers through
    that context, in the schedule's order; no pipeline is one stage (1F1B on p = 1 is simply
    F0 B0 F1 B1 ..., gradient accumulation);
  - DP / ZeRO 0-3 act through the executor's per-layer hooks on the rank's local (TP-sharded,
    stage-local) parameters (parallel/data/axis.py), so ZeRO-2/3 work over TP shards and stages.
Batch: dp rank d takes rows [d B/D, (d+1) B/D) and cuts them into m micro-batches, so its
micro-batch j is the reference's micro-batch d m + j; CE is divided by the global token count and
the MoE aux weighted by the micro-batch's share of the step's routing groups (docs/CONTRACTS.md):
gradients are summed over micro-batches, dp, and (SP-partial ones) tp.
Clipping: the global norm's squares are reduced over dp (ZeRO shards), tp (weights 1/t for the
tensors replicated over tp) and pp, in that order (parallel/clip.py).
Context parallelism (cp > 1): every micro-batch cut to the cp rank's columns (parallel/context/
layout.py), the layer context given the positions table each step (embed rows, cp attention),
DP / ZeRO on the dp x cp group, C routing groups per micro-batch (each cp rank's tokens).
Ledger tags, one prefix per axis: dp/grads*, dp/params*, dp/clip; tp/<layer>/mb<j>/<fwd|bwd>,
tp/sp-grads/<layer>/mb<j>; pp/act/mb<j>, pp/grad/mb<j>; cp: any tag containing cp-attn/.
parallel/nd_cost.py has the formulas.
ep > 1 (parallel/expert/nd.py): experts E/ep per rank over the ep group drawn from dp (at the
same cp coordinate), hooks nd.ep_axis (a DataAxis of two parts: dense tensors over dp (x cp),
experts over edp (x cp): edp/dp/*, DDP or ZeRO-1/2/3, one norm), all-to-alls under
ep/<layer>/mb<j>/<fwd|bwd>/<phase>; formulas nd.ep_layer_bytes, rank_bytes, static_memory. Route
records per step, MoE layer and micro-batch: NDRun.ep_counts (kept, C) and NDRun.ep_routes (load
table, counts received, decisions; parallel/expert/load.py LayerRoute); parallel/expert/train.py
moe_records adds each one's all-to-all bytes by phase from the ledger.
"""

from __future__ import annotations

import dataclasses

from emulator import affinity, scope
from emulator.data import shard_batch, split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import check_inputs
from emulator.precision import compute_dtype
from emulator.shared_init import shared_init_params
from parallel.context.layout import table
from parallel.data.axis import DataAxis
from parallel.expert import nd as nd_ep
from parallel.expert.nd import ep_mesh
from parallel.layer import LayerContext
from parallel.layout import mesh_text
from parallel.pipeline.executor import run_schedule, split_layers, stage_param_names
from parallel.pipeline.schedules import make_schedule
from parallel.tensor.block import megatron_plan
from parallel.tensor.sequence import reduce_partial_grads
from parallel.tensor.shard import shard, unshard_each
from parallel.tensor.train import replica_mismatch

AXIS_TAGS = {"dp": ("dp/grads", "dp/params"), "tp": ("tp/",), "pp": ("pp/",), "clip": ("dp/clip",)}
CP_TAG = "cp-attn/"  # cp attention traffic, tagged inside the layer's scope (tp/... under tp)
# ep > 1 (parallel/expert/nd.py): + the all-to-alls (ep/...) and the experts' DDP (edp/...)
EP_AXIS_TAGS = {**AXIS_TAGS, "ep": ("ep/",), "edp": ("edp/",)}


@dataclasses.dataclass
class NDRun:
    layout: object
    coords: dict  # this rank's {axis: index}
    losses: list  # global loss per step (every rank)
    grad_norms: list  # global gradient norm per step, before clipping
    grads: dict  # last step's summed gradient before clipping, full shape (gathered, uncounted)
    params: dict  # final master parameters, full shape
    local_params: dict  # this rank's own final master arrays (TP shards of its stage)
    local_grads: dict  # this rank's own last summed gradient (TP shards of its stage)
    step_bytes: list  # per step: {"dp", "tp", "pp", "clip": bytes this rank sent}
    memory: dict  # this rank's MemoryLedger.snapshot() at the end (before the run frees it)
    split: list  # blocks per virtual stage
    executed: list  # this stage's actions in the order it ran them (last step)
    in_flight: int  # peak micro-batch units alive on this stage
    layouts: list  # the dp flat buffers (DDP buckets, ZeRO buckets or per-layer units)
    mesh: str  # Mesh.describe() (parallel.layout.mesh_text)
    replica_mismatch: list  # "param/grad <name>..." of tp- or dp/ep/edp-replicated tensors whose
    # copies differ bitwise (tp: replica_mismatch; dp parts: DataAxis.replica_mismatch)
    act_bytes: dict = dataclasses.field(default_factory=dict)  # per block: bytes after forward
    positions: object = None  # cp: the last step's (C, S_local) positions table
    # ep > 1: per step {(layer, mb): (kept (E,), C)}: this rank's kept copies per expert and slot
    # total of each MoE block's groups (parallel/expert/nd.py moe_pair; the bytes formula's input)
    ep_counts: list = dataclasses.field(default_factory=list)
    # ep > 1: per step {(layer, mb): LayerRoute}: load table, counts received, routing decisions
    ep_routes: list = dataclasses.field(default_factory=list)
    local_opt: dict = dataclasses.field(default_factory=dict)  # AdamW {"m", "v"}: local (zero 0)


def axis_bytes(ledger, records, tags=AXIS_TAGS) -> dict:
    """Bytes this rank sent in ``records``, by axis (the tag prefixes of AXIS_TAGS); traffic
    under no axis's tag - none in a correct run - is added as "untagged"."""
    out, other = dict.fromkeys(tags, 0), 0
    # a step has hundreds of records but a few dozen tags: each tag's axis is decided once
    sent: dict = {}  # tag -> bytes sent under it
    for r in records:
        tag = r.tag
        if r.direction == "send":
            sent[tag] = sent.get(tag, 0) + r.nbytes
        elif tag not in sent:
            sent[tag] = 0  # a tag seen only in receives still marks a cp run (below)
    cp = any(CP_TAG in tag for tag in sent)
    out |= {"cp": 0} if cp else {}
    for tag, nbytes in sent.items():
        axis = "cp" if cp and CP_TAG in tag else None
        axis = axis or next((a for a, pre in tags.items() if tag.startswith(pre)), None)
        if axis is None:
            other += nbytes
        else:
            out[axis] += nbytes
    return out | ({"untagged": other} if other else {})


def block_flops(cfg, layout, shape) -> float:
    """GEMM FLOPs of one block's forward for one micro-batch on one rank
    (emulator/affinity.gemm_flops) for the rank's tokens of a micro-batch of the global batch
    ``shape`` (B, S)."""
    B, S = shape
    return affinity.gemm_flops(cfg, B // (layout.dp * layout.microbatches) * (S // layout.cp),
                               layout.tp)  # fmt: skip


def train(comm, layout, cfg, batches, steps, seed=0, *, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
          weight_decay=0.0, max_norm=None, groups_fn=None, params=None, sizes=None,
          one_core=None) -> NDRun:  # fmt: skip
    """Train ``layout`` on comm's ranks (call on every rank). ``layout.dtype`` is the run's
    dtype (it replaces cfg.dtype). groups_fn(step, microbatch, b, S): MoE routing groups of a
    global micro-batch, as reference_train's; params: full-shape initial parameters (default
    init_params(cfg, seed)); sizes: explicit blocks per virtual stage. one_core: run this
    rank's thread on one core (virtual ranks only: emulator/affinity.py); None = when the
    per-rank work is small (block_flops < affinity.ONE_CORE_FLOPS)."""
    check_training("parallel.train", steps=steps, microbatches=layout.microbatches, lr=lr,
                   betas=betas, eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    cfg = dataclasses.replace(cfg, dtype=layout.dtype)
    get = batches if callable(batches) else batches.__getitem__
    checked = check_inputs(*get(0), cfg)[0].shape  # the batch shape validated for
    layout.validate(comm.world_size, cfg, checked)
    small = one_core
    if small is None:  # the rule: emulator/affinity.py
        small = block_flops(cfg, layout, checked) < affinity.ONE_CORE_FLOPS
    with affinity.one_core(comm, small):
        return _train(comm, layout, cfg, get, checked, steps, seed, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay, max_norm=max_norm, groups_fn=groups_fn,
                      params=params, sizes=sizes)  # fmt: skip


def _train(comm, layout, cfg, get, checked, steps, seed, *, lr, betas, eps, weight_decay,
           max_norm, groups_fn, params, sizes) -> NDRun:  # fmt: skip
    mesh = layout.mesh(comm)
    dp, pp, tp, m = mesh["dp"], mesh["pp"], mesh["tp"], layout.microbatches
    C = layout.cp
    if C > 1 and groups_fn is not None:
        raise ValueError("parallel.train: under cp > 1 each cp rank's tokens of a micro-batch "
                         "are one MoE routing group; pass groups_fn only to the reference "
                         "(parallel.context.train.routing_groups)")  # fmt: skip
    # cp: each cp rank holds other tokens of the same sequences, so for the weights cp is more
    # data parallelism: DDP / ZeRO act on the dp x cp group (Megatron-LM's dp-cp group)
    data = mesh.group("dp", "cp") if C > 1 else dp
    D, r, t = dp.size, dp.rank, tp.size
    sched = make_schedule(layout.schedule, pp.size, m, layout.chunks)
    split = split_layers(cfg.n_layers, pp.size * sched.v, sizes)
    names = stage_param_names(cfg, split, pp.rank, pp.size)
    plan = megatron_plan(cfg)
    if layout.ep > 1:  # experts over ep, replicated over tp (parallel/expert/nd.py)
        plan = nd_ep.expert_plan(plan)
    # read-only, drawn once per virtual world; shard() copies this rank's blocks
    full = shared_init_params(comm, cfg, seed) if params is None else params
    master = shard({n: full[n] for n in names}, plan, tp.rank, t)  # this rank's copies
    ctx = LayerContext(tp=tp, sp=layout.sequence_parallel, regather=layout.regather,
                       cp=mesh["cp"], cp_method=layout.cp_method, act_bytes={})  # fmt: skip
    mem = comm.memory
    mem.reset_peak()
    record: dict = {}  # ep > 1: (layer, mb) -> (kept, C) of the current step
    routes: dict = {}  # ep > 1: (layer, mb) -> LayerRoute of the current step
    if layout.ep > 1:  # parallel/expert/nd.py: experts E/ep per rank, two parts, one norm
        emesh = ep_mesh(comm, layout)
        ep = emesh["ep"]
        master = nd_ep.shard_experts(master, ep.rank, cfg.n_experts // ep.size)
        ctx = LayerContext(tp=tp, sp=layout.sequence_parallel, regather=layout.regather,
                           cp=mesh["cp"], cp_method=layout.cp_method, ep=ep, act_bytes={},
                           moe=nd_ep.moe_pair(ep, layout.dispatch, record, routes))  # fmt: skip
        axis = nd_ep.ep_axis(data, emesh, master, cfg, layout, tp=tp, pp=pp, hyper={"lr": lr,
                             "betas": betas, "eps": eps, "weight_decay": weight_decay},
                             max_norm=max_norm, mem=mem,
                             tp_replicated=[n for n in names if not plan[n].sharded],
                             partial=_sp_partial(tp) if ctx.sp else None)  # fmt: skip
    else:
        ep = None
        axis = DataAxis(
            data, master, layout.zero, cfg, hyper={"lr": lr, "betas": betas, "eps": eps,
            "weight_decay": weight_decay}, max_norm=max_norm, norm_groups=(tp, pp),
            norm_weights={n: 1.0 / t for n in names if not plan[n].sharded} if t > 1 else None,
            bucket_cap_mb=layout.bucket_cap_mb, reshard_after_forward=layout.reshard_after_forward,
            prefetch=layout.prefetch, partial=_sp_partial(tp) if ctx.sp else None, mem=mem,
        )  # fmt: skip
    try:
        run = NDRun(layout, dict(mesh.coords), [], [], {}, {}, {}, {}, [], {}, split, [], 0,
                    axis.layouts, mesh_text(mesh), [], ctx.act_bytes)  # fmt: skip
        if ep is not None:
            run.coords.update(ep=emesh.coord("ep"), edp=emesh.coord("edp"))
        for step in range(steps):
            comm.ledger.step = step
            tokens, targets = check_inputs(*get(step), cfg)
            if tokens.shape != checked:  # validate depends on the shape only: once per shape
                layout.validate(comm.world_size, cfg, tokens.shape)
                checked = tokens.shape
            mine = shard_batch(tokens, targets, r, D)
            # each micro-batch its own arrays, so a cache is charged for its b S ids only
            mbs = [(a.copy(), b.copy()) for a, b in split_microbatches(*mine, m)]
            b, S = mbs[0][0].shape
            groups = [groups_fn(step, g, b, S) if groups_fn else None for g in range(D * m)]
            n_groups = [1 if g is None else len(g) for g in groups]
            if C > 1:  # this cp rank's columns: C routing groups per micro-batch, one of them here
                mbs = _cp_columns(ctx, run, mbs, S, C, layout.cp_balance)
            axis.begin_step()
            record.clear()
            routes.clear()
            mark = comm.ledger.mark()
            _, loss, done, peak = run_schedule(
                pp, sched, split, None, mbs, cfg, ce_denom=tokens.size,
                aux_scales=[n_groups[r * m + j] / (sum(n_groups) * C) for j in range(m)],
                groups=groups[r * m : (r + 1) * m], recompute=layout.recompute, mem=mem,
                ctx=ctx, hooks=axis, dtype=compute_dtype(cfg.dtype),
            )  # fmt: skip
            run.grad_norms.append(axis.finish_step())
            tags = EP_AXIS_TAGS if ep is not None else AXIS_TAGS
            run.step_bytes.append(axis_bytes(comm.ledger, comm.ledger.since(mark), tags))
            if ep is not None:
                run.ep_counts.append(dict(record))
                run.ep_routes.append(dict(routes))
            # the global loss: stage shares summed over pp, then dp (uncounted control plane)
            share = sum(pp.allgather_object(loss), 0.0)
            run.losses.append(sum(data.allgather_object(share), 0.0))  # dp (x cp)
            # every rank holds the same global loss and norm: all raise at the same step
            check_finite(step, rank=comm.rank, loss=run.losses[-1], grad_norm=run.grad_norms[-1],
                         where="parallel.train")  # fmt: skip
            run.executed, run.in_flight = done, max(run.in_flight, peak)
        lp, lg = axis.local_state()
        run.local_params, run.local_grads = lp, lg
        opt = getattr(axis, "opt", None)  # one AdamW over the local tensors (None under ZeRO)
        run.local_opt = {"m": opt.m, "v": opt.v} if opt is not None else {}
        every = tp.allgather_object((lp, lg))  # uncounted: the check, not the training
        # every tp rank computes the replicated tensors identically: their copies agree bitwise
        run.replica_mismatch = replica_mismatch(every, plan, tp) if lg else []
        # and over each data-parallel part's group (dp (x cp); ep runs: the experts over edp)
        run.replica_mismatch += axis.replica_mismatch()
        # once per tp group (no grads: rank 0's dict is empty, so is stage_g)
        stage_p, stage_g = unshard_each(tp, [[e[0] for e in every], [e[1] for e in every]], plan)
        if ep is not None:  # the experts back to E along axis 0, ep coordinates in order
            stage_p, stage_g = nd_ep.unshard_experts(ep, stage_p, stage_g)
        for part_p, part_g in pp.allgather_object((stage_p, stage_g)):
            run.params.update(part_p)
            run.grads.update(part_g)
        run.memory = mem.snapshot()
        return run
    finally:  # free what this run allocated, even on an error: another run may follow
        axis.close()


def _cp_columns(ctx, run, mbs, S: int, C: int, balance: str) -> list:
    """Context parallelism: this step's positions table (parallel/context/layout.py) into the
    layer context, and each micro-batch cut to this cp rank's columns (B, S/C), copied."""
    run.positions = table(S, C, balance)
    ctx.set_positions(run.positions)
    mine = run.positions[ctx.cp.rank]
    return [(t[:, mine].copy(), y[:, mine].copy()) for t, y in mbs]


def _sp_partial(tp):
    """Under SP, the replicated LayerNorm / row-bias / position gradients of a layer are partial
    (each rank saw S/t positions): sum them over tp, one flat all-reduce per layer and
    micro-batch, before the dp axis takes them (ZeRO-2/3 reduce-scatter them at once)."""

    def partial(layer: str, mb: int, grads: dict) -> dict:
        with scope(f"tp/sp-grads/{layer}/mb{mb}"):
            return reduce_partial_grads(tp, grads)

    return partial
