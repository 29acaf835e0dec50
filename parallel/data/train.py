"""Training with data parallelism - DDP or ZeRO-1/2/3 - on the ranks of `comm`, comparable with
`emulator.reference.reference_train` run on the same global batch.

Rank r of D takes rows [r B/D, (r+1) B/D) of the global batch (emulator.data.shard_batch) and
splits them into k micro-batches, so its micro-batch j is the reference's micro-batch r k + j
when the reference runs with microbatches = D k. Routing groups (MoE) follow the same numbering:
groups_fn(step, r k + j, B_mb, S), exactly what reference_train calls for that micro-batch.
"""

from __future__ import annotations

import dataclasses

from emulator import affinity
from emulator.data import shard_batch, split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import check_inputs, to_compute
from emulator.precision import compute_dtype
from emulator.shared_init import shared_init_params
from parallel.clip import global_grad_norm, scale_
from parallel.data.common import loss_scales
from parallel.data.ddp import DDP
from parallel.data.flat import fsdp_units, make_buckets
from parallel.data.fsdp import FSDPHooks, ReplicatedHooks
from parallel.data.replica import BucketAdamW
from parallel.data.zero import ZeroOptimizer, check_stage
from parallel.pipeline.executor import OneStage, run_schedule
from parallel.pipeline.schedules import make_schedule


@dataclasses.dataclass
class DPRun:
    stage: str
    losses: list  # global loss per step (the sum of every rank's share)
    grad_norms: list
    grads: dict  # the last step's summed gradient, before clipping, full shape
    params: dict  # final master parameters, full shape
    opt_state: dict  # {"step", "m", "v"}, full shape
    step_bytes: list  # per step: {"grads": (sent, recv), "params": (sent, recv)} on dp
    layouts: list  # the flat buffers (DDP buckets, ZeRO buckets or FSDP units)
    memory: dict  # this rank's MemoryLedger.snapshot() at the end (before the run frees it)
    comm_order: list  # step 0: distinct dp/grads and dp/params ledger tags in issue order
    routing: list  # MoE: [step][global micro-batch][layer] -> (B_mb S, K) experts chosen


def check_layout(stage, D: int, batch: int, microbatches: int) -> str:
    stage = "ddp" if str(stage) == "ddp" else str(check_stage(stage))
    if batch % D:
        raise ValueError(
            f"global batch B={batch} is not divisible by the data-parallel degree D={D}; "
            f"use a batch that is a multiple of {D} or another number of ranks"
        )
    if microbatches < 1 or (batch // D) % microbatches:
        raise ValueError(
            f"micro-batches={microbatches} must divide each rank's batch B/D={batch // D} "
            f"(B={batch}, D={D}); choose a divisor of {batch // D}"
        )
    return stage


def train_data_parallel(comm, cfg, seed, batches, steps, *, stage="ddp", microbatches=1,
                        lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_norm=None,
                        bucket_cap_mb=25.0, reshard_after_forward=True, prefetch=False,
                        groups_fn=None, recompute="none", poison_freed=False,
                        one_core=None) -> DPRun:  # fmt: skip
    """Train; every memory-ledger entry the run makes is freed before it returns (run.memory is
    the snapshot just before), and the ledger's peaks are reset at the start, so a program may
    call it again - any stage - and see the same figures (run.memory["peak"] is this run's).
    ``poison_freed`` (tests): ZeRO-3 fills every freed gathered unit with NaN (ZeroOptimizer).
    ``one_core``: run this rank's thread on one core (virtual ranks only: emulator/affinity.py);
    None = when the per-rank work is small (gemm_flops < affinity.ONE_CORE_FLOPS)."""
    stage = "ddp" if str(stage) == "ddp" else str(check_stage(stage))
    check_training("train_data_parallel", steps=steps, microbatches=microbatches, lr=lr,
                   betas=betas, eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    first = batches(0) if callable(batches) else batches[0]
    B, S = check_inputs(*first, cfg)[0].shape  # one_core: ranks with little work share a core
    small = one_core
    if small is None:  # the rule: emulator/affinity.py
        small = (
            affinity.gemm_flops(cfg, B // (comm.size * microbatches) * S) < affinity.ONE_CORE_FLOPS
        )
    with affinity.one_core(comm, small):
        mem = comm.memory
        mem.reset_peak()
        hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        # same seed on every rank: identical replicas; drawn once per virtual world, read-only
        params = shared_init_params(comm, cfg, seed)
        statics = []  # (category, name) allocated here (DDP: the replicated model and AdamW)
        if stage == "ddp":  # the replica is updated in place: this rank's own copy, laid out in
            # the buckets' flat buffers so AdamW runs per bucket (parallel/data/replica.py)
            shapes = {n: p.shape for n, p in params.items()}
            layouts = make_buckets(
                shapes, comm.size, bucket_cap_mb, compute_dtype(cfg.dtype).itemsize
            )
            # DDP's initial broadcast overwrites every rank's buffers but its root's: those
            # start unset instead of holding a copy of the same init first
            opt = BucketAdamW(layouts, params, **hyper, fill=comm.size == 1 or comm.rank == 0)
            params = opt.params
            engine = DDP(comm, params, bucket_cap_mb=bucket_cap_mb, dtype=cfg.dtype, mem=mem,
                         layouts=layouts, flats=opt.flats)  # fmt: skip
            statics.append(("params", "master", sum(p.nbytes for p in params.values())))
            if cfg.dtype == "mixed":  # the bf16 compute copy: Psi c
                c = compute_dtype(cfg.dtype).itemsize
                statics.append(("params", "compute_copy", sum(p.size for p in params.values()) * c))
            statics.append(("optimizer", "adamw", opt.nbytes()))
            for cat, name, nbytes in statics:
                mem.alloc(cat, name, nbytes)
        else:
            shapes = {n: p.shape for n, p in params.items()}
            units = [u.names for u in fsdp_units(shapes, comm.size)] if stage == "3" else None
            engine = ZeroOptimizer(comm, params, int(stage), dtype=cfg.dtype, max_norm=max_norm,
                                   bucket_cap_mb=bucket_cap_mb, units=units, mem=mem,
                                   poison_freed=poison_freed, **hyper)  # fmt: skip
            opt = None
        try:
            run = DPRun(stage, [], [], {}, {}, {}, [], engine.layouts, {}, [], [])
            for step in range(steps):  # step 0's batch is the one drawn above
                batch = (
                    first if step == 0 else batches(step) if callable(batches) else batches[step]
                )
                _step(comm, cfg, engine, opt, params, run, step, batch, microbatches, groups_fn,
                      max_norm, reshard_after_forward, prefetch, recompute)  # fmt: skip
            if stage == "ddp":
                run.params = dict(params)  # the replica's buffers: nothing writes them now
                run.opt_state = {"step": opt.step_count, "m": opt.m, "v": opt.v}
            else:
                run.params, run.grads, run.opt_state = engine.final_state()
            run.memory = mem.snapshot()
            return run
        finally:  # free what this run allocated, even on an error
            engine.close()
            for cat, name, _ in statics:
                mem.free(cat, name)


def _step(comm, cfg, engine, opt, params, run, step, batch, k, groups_fn, max_norm,
          reshard_after_forward, prefetch, recompute) -> None:  # fmt: skip
    """One optimizer step on ``batch`` (tokens, targets): k micro-batches, the gradient sync,
    clip and AdamW; run += figures."""
    stage, D, r, mem = run.stage, comm.size, comm.rank, comm.memory
    tokens, targets = check_inputs(*batch, cfg)
    check_layout(stage, D, tokens.shape[0], k)
    mbs = split_microbatches(*shard_batch(tokens, targets, r, D), k)
    b, S = tokens.shape[0] // (D * k), tokens.shape[1]
    groups = [groups_fn(step, g, b, S) if groups_fn else None for g in range(D * k)]
    n_groups = [1 if g is None else len(g) for g in groups]
    mark = comm.ledger.mark()
    if stage == "3":
        hooks = FSDPHooks(engine, cfg, reshard_after_forward=reshard_after_forward,
                          prefetch=prefetch)  # fmt: skip
    else:  # DDP computes with the compute-dtype copy of the (updated) master
        hooks = ReplicatedHooks(to_compute(params, cfg) if opt else engine.params, engine)
    if stage == "ddp":  # no_sync for the first k-1 micro-batches: one all-reduce per step
        hooks.sync_at = k - 1
    mb_losses, routes = {}, {}
    try:  # the one model driver: a single stage running F0 B0 F1 B1 ... (1F1B on p = 1)
        run_schedule(OneStage(), make_schedule("1f1b", 1, k), [list(range(cfg.n_layers))], None,
                     mbs, cfg, ce_denom=tokens.size,
                     aux_scales=[loss_scales(tokens.size, n_groups[r * k + j], sum(n_groups))[1]
                                 for j in range(k)],
                     groups=groups[r * k : (r + 1) * k], recompute=recompute, mem=mem,
                     hooks=hooks, dtype=compute_dtype(cfg.dtype), mb_losses=mb_losses,
                     routing=routes, io_activations=False)  # fmt: skip
    finally:
        if stage == "ddp":
            engine.sync = True
    shares = [mb_losses[j] for j in range(k)]
    routing = [routes.get(j, []) for j in range(k)]
    if cfg.is_moe:  # every micro-batch's routing, in the reference's order r k + j (uncounted)
        run.routing.append([mb for every in comm.allgather_object(routing) for mb in every])
    total, every = 0.0, comm.allgather_object(shares)
    for share in (s for mine in every for s in mine):
        total += share  # the reference's order: micro-batch r k + j
    run.losses.append(total)
    if stage == "ddp":
        grads, flats = engine.finish(), engine.flats()  # {name: view of a flat}, the flats
        # DDP grads are already summed (replicated) over dp: no group to reduce over
        norm, coef = global_grad_norm(grads, (), max_norm=max_norm, tag="dp/clip")
        # zero_grad drops this step's buffers, so run.grads keeps them - copied if clipped
        run.grads = grads if coef >= 1.0 else {n: g.copy() for n, g in grads.items()}
        scale_(flats, coef)  # elementwise: per tensor's bits; the padding stays zero
        run.grad_norms.append(norm)
        opt.step(flats)
        engine.zero_grad()
    else:
        run.grad_norms.append(engine.step())
    check_finite(step, rank=r, losses=[sum(m) for m in every], grad_norm=run.grad_norms[-1],
                 where=f"data parallel, stage {stage}")  # fmt: skip
    recs = comm.ledger.since(mark)
    run.step_bytes.append(dp_step_bytes(comm.ledger, recs))
    if step == 0:  # the order collectives were issued in (DDP bucket readiness, ZeRO-3 prefetch)
        tags = [rec.tag for rec in recs if rec.tag.startswith(("dp/grads", "dp/params"))]
        run.comm_order = list(dict.fromkeys(tags))


DP_WHATS = ("grads", "params", "clip")


def dp_step_bytes(ledger, records) -> dict:
    """{what: (sent, received)} of the records tagged "dp/<what>*", for what in DP_WHATS: the
    ledger's sent / received queries, from one pass over the records (ledger.totals by tag; a
    step's records carry a few dozen tags) instead of six."""
    by_tag = ledger.totals("tag", records)
    return {
        what: tuple(sum(t[side] for tag, t in by_tag.items() if tag.startswith(f"dp/{what}"))
                    for side in ("sent", "recv"))
        for what in DP_WHATS
    }  # fmt: skip
