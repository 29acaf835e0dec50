"""ep x dp training: every block's MoE over an expert-parallel group, the rest data-parallel,
comparable with emulator.reference.reference_train on the same global batch and routing groups.

Shape letters: D world ranks (all data-parallel), P = ep, E experts, El = E / P.

The ranks form Mesh(edp = D / P, ep = P) (ep last: an ep group is P neighbouring ranks, as in
Megatron-core). Every rank takes its data-parallel slice of the batch (emulator.data.shard_batch)
and routes its own tokens, so rank r's micro-batch j is the reference's micro-batch r k + j and
its routing groups are the reference's for that micro-batch (one per micro-batch by default).
Rank r holds every replicated parameter and the experts c El .. (c+1) El - 1 of every block,
c = its ep coordinate. Gradients (parallel/expert/sync.py: per-tensor all-reduce, or DDP buckets):
  replicated gradients   summed over all D ranks (the data-parallel group; tags dp/...)
  expert gradients       already complete over the ep group's tokens (the all-to-alls carried
                         them); summed over the D / P ranks holding the same experts (tags
                         edp/..., the "expert-data-parallel" group of Megatron / DeepSpeed)
Clipping: one global norm over the ep group, replicated gradients weighted 1/P (parallel/clip.py).
Then AdamW on the local parameters - elementwise, so it commutes with the expert split.
"""

from __future__ import annotations

import contextlib
import dataclasses
from functools import partial

import numpy as np

from emulator import Mesh, scope
from emulator.block import block_backward, block_forward
from emulator.data import shard_batch, split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import (
    block_params,
    check_inputs,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
    init_params,
    to_compute,
)
from emulator.optim import AdamW
from emulator.reference import account_state
from parallel.check.routing import decisions
from parallel.clip import clip_
from parallel.data.common import loss_scales
from parallel.expert.layer import check_ep, ep_moe_backward, ep_moe_forward
from parallel.expert.sync import MODES, is_expert, make_sync


@dataclasses.dataclass
class EPRun:
    losses: list  # global loss per step (every rank's share, summed in the reference's order)
    grad_norms: list  # global norm before clipping
    grads: dict  # last step's synced gradient, before clipping: this rank's (local) shapes
    params: dict  # final local parameters (experts: this rank's slice)
    moe: list  # [step][micro-batch][layer] -> {"routes", "counts", "decisions", "bytes"}
    # (routes / counts are None under recompute="full": the block keeps only its input)
    memory: dict  # the MemoryLedger snapshot at the end
    ep_rank: int
    n_local: int  # El
    opt_state: dict = dataclasses.field(default_factory=dict)  # {"m", "v"}: local shapes
    layouts: dict = dataclasses.field(default_factory=dict)  # ddp: {"dense", "experts"} buckets
    step_bytes: list = dataclasses.field(default_factory=list)  # [step] {"dp", "edp"}: (s, r)


def shard_experts(params, c: int, El: int) -> dict:
    """Full parameters -> rank's: expert tensors sliced to experts c El .. (c+1) El - 1 (copies)."""
    sl = slice(c * El, (c + 1) * El)
    return {n: (a[sl] if is_expert(n) else a).copy() for n, a in params.items()}


def check_axes(D: int, ep: int, cfg) -> int:
    """-> El; named errors for a dense model, ep not dividing D, E % ep, top_k > E."""
    if not cfg.is_moe:
        raise ValueError("expert parallelism needs an MoE model (n_experts > 0)")
    if ep < 1 or D % ep:
        raise ValueError(
            f"ep={ep} must divide the {D} data-parallel ranks (the ep group is drawn from them); "
            f"choose ep in {[d for d in range(1, D + 1) if D % d == 0]}"
        )
    return check_ep(cfg.n_experts, ep, cfg.moe_top_k)


def check_batch(D: int, batch: int, k: int) -> None:
    if k < 1 or batch % D or (batch // D) % k:
        raise ValueError(
            f"batch B={batch} must split over D={D} ranks into {k} equal micro-batches each"
        )


def ep_train(comm, cfg, seed, batches, steps, *, ep, microbatches=1, dispatch="exact", lr=1e-3,
             betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_norm=None, groups_fn=None,
             recompute="none", grad_sync="allreduce", bucket_cap_mb=25.0) -> EPRun:  # fmt: skip
    """Train ``steps`` steps; ``grad_sync``: "allreduce" or "ddp" (parallel/expert/sync.py)."""
    check_training("ep_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    D, k = comm.size, microbatches
    El = check_axes(D, ep, cfg)
    if grad_sync not in MODES:
        raise ValueError(f"grad_sync={grad_sync!r} must be one of {MODES}")
    mesh = Mesh(comm, edp=D // ep, ep=ep)
    c = mesh.coord("ep")
    params = shard_experts(init_params(cfg, seed), c, El)
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    moe_fn = (partial(ep_moe_forward, mesh["ep"], dispatch=dispatch), ep_moe_backward)
    mem = comm.memory
    mem.reset_peak()
    account_state(mem, cfg, params, opt)  # the reference's static categories, local sizes
    statics = [("params", "master"), ("grads", "grads"), ("optimizer", "adamw")]
    statics += [("params", "compute_copy")] if cfg.dtype == "mixed" else []
    if grad_sync == "ddp":  # the DDP bucket buffers hold the gradients instead
        mem.free("grads", "grads")
        statics.remove(("grads", "grads"))
    sync = make_sync(grad_sync, comm, mesh["edp"], params, bucket_cap_mb=bucket_cap_mb,
                     dtype=cfg.dtype, mem=mem)  # fmt: skip
    run = EPRun([], [], {}, {}, [], {}, c, El)
    if grad_sync == "ddp":
        run.layouts = {"dense": sync.dense.layouts, "experts": sync.experts.layouts}
    try:
        for step in range(steps):
            tokens, targets = batches(step) if callable(batches) else batches[step]
            tokens, targets = check_inputs(tokens, targets, cfg)
            check_batch(D, tokens.shape[0], k)
            mbs = split_microbatches(*shard_batch(tokens, targets, comm.rank, D), k)
            b, S = tokens.shape[0] // (D * k), tokens.shape[1]
            groups = [groups_fn(step, g, b, S) if groups_fn else None for g in range(D * k)]
            n_groups = [1 if g is None else len(g) for g in groups]
            compute, shares, infos = to_compute(params, cfg), [], []
            step_mark = comm.ledger.mark()
            for j, (t, y) in enumerate(mbs):
                g = comm.rank * k + j
                ce_denom, aux_scale = loss_scales(tokens.size, n_groups[g], sum(n_groups))
                mark = comm.ledger.mark()
                ctx = sync.no_sync() if j < k - 1 else contextlib.nullcontext()
                with ctx:
                    share, info = _microbatch(compute, t, y, cfg, ce_denom, aux_scale, groups[g],
                                              moe_fn, recompute, mem, j, sync.grad_ready)  # fmt: skip
                recs = comm.ledger.since(mark)
                for layer, lb in zip(info, layer_bytes(comm, recs, cfg.n_layers)):
                    layer["bytes"] = lb
                shares.append(share)
                infos.append(info)
            run.moe.append(infos)
            run.losses.append(sum(s for every in comm.allgather_object(shares) for s in every))
            acc = sync.finish()
            sync.zero_grad()
            recs = comm.ledger.since(step_mark)
            run.step_bytes.append({
                g: (comm.ledger.sent(recs, tag=f"{g}/*"), comm.ledger.received(recs, tag=f"{g}/*"))
                for g in ("dp", "edp")
            })  # fmt: skip
            run.grads = {n: a.copy() for n, a in acc.items()}
            weights = {n: 1.0 / ep for n in acc if not is_expert(n)}
            run.grad_norms.append(clip_(acc, max_norm, (mesh["ep"],), weights=weights)[0])
            check_finite(step, rank=comm.rank, loss=run.losses[-1], grad_norm=run.grad_norms[-1],
                         where="ep_train")  # fmt: skip
            opt.step(params, acc)
        run.params = {n: p.copy() for n, p in params.items()}
        run.opt_state = {"m": opt.m, "v": opt.v}
        run.memory = mem.snapshot()
        return run
    finally:
        sync.close()
        for cat, name in statics:
            mem.free(cat, name)


def _microbatch(p, tokens, targets, cfg, ce_denom, aux_scale, groups, moe_fn, recompute, mem, j,
                ready):  # fmt: skip
    """model_forward / model_backward's arithmetic with the ep MoE block; ledger tags
    blocks.i/ep/...; ready(layer, grads) as each layer's backward finishes
    -> (loss share, [per layer {"routes", "counts", "decisions"}])."""
    x, ecache = embed_forward(p, tokens)
    caches, aux = [], []
    for i in range(cfg.n_layers):
        kw = {"recompute": recompute, "groups": groups, "mem": mem, "name": f"mb{j}.blocks.{i}"}
        with scope(f"blocks.{i}"):
            x, cache = block_forward(block_params(p, i), x, cfg, moe_fn=moe_fn, **kw)
        caches.append(cache)
        aux.append(cache["aux"])
    ce, hcache = head_forward(p, x, targets, cfg, denom=ce_denom)
    loss = float(ce) + cfg.aux_loss_coef * aux_scale * sum(aux)
    daux = cfg.aux_loss_coef * aux_scale
    dx, g = head_backward(1.0, hcache)
    ready("head", g)
    for i in reversed(range(cfg.n_layers)):
        with scope(f"blocks.{i}"):
            dx, dbp = block_backward(dx, caches[i], daux=daux)
        ready(f"blocks.{i}", {f"blocks.{i}.{n}": d for n, d in dbp.items()})
    ready("embed", embed_backward(dx, ecache))
    infos = []
    for cache in caches:
        moe = cache["saved"].get("moe")  # absent under recompute="full" (only x is kept)
        info = {k: None if moe is None else moe[k] for k in ("routes", "counts")}
        pairs = None if moe is None else list(zip(moe["groups"], moe["routes"]))
        info["decisions"] = None if moe is None else decisions(pairs, tokens.shape[1])
        infos.append(info)
    return loss, infos


def layer_bytes(comm, records, n_layers: int) -> list[dict]:
    """Per layer {phase: (sent, received)} of the ep all-to-alls in ``records``."""
    phases = ("fwd/counts", "fwd/dispatch", "fwd/combine", "bwd/combine", "bwd/dispatch")
    led = comm.ledger
    return [
        {ph: (led.sent(records, tag=f"blocks.{i}/ep/{ph}"),
              led.received(records, tag=f"blocks.{i}/ep/{ph}")) for ph in phases}
        for i in range(n_layers)
    ]  # fmt: skip


def reference_slices(ref_params, c: int, El: int) -> dict:
    """The reference's full parameters cut to this rank's shapes (for comparisons)."""
    return shard_experts(ref_params, c, El)


@dataclasses.dataclass
class FullView:
    """Every rank's EPRun put back to full shape, as parallel/check/data.py's compare_dp reads a
    data-parallel run: losses, grads, params, opt_state {"m", "v"}, routing [step][global
    micro-batch r k + j][layer] -> [Route per group]."""

    losses: list
    grad_norms: list
    grads: dict
    params: dict
    opt_state: dict
    routing: list


def assemble(runs, ep: int) -> FullView:
    """runs: the EPRun of every world rank, in rank order (gathered uncounted). Experts are cut
    along axis 0 by ep coordinate (ranks 0..ep-1 hold coordinates 0..ep-1); replicated tensors
    come from rank 0. Raises if a replica disagrees bitwise with the rank it copies."""
    for r, run in enumerate(runs):  # edp replicas are summed by the same all-reduce: same bits
        twin = runs[r % ep]
        for n, a in run.params.items():
            if a.tobytes() != twin.params[n].tobytes():
                raise AssertionError(f"rank {r} holds {n} differently from rank {r % ep}")

    def full(get):
        return {
            n: np.concatenate([get(runs[c])[n] for c in range(ep)]) if is_expert(n) else a
            for n, a in get(runs[0]).items()
        }

    routing = [
        [[lay["decisions"] for lay in mb] for run in runs for mb in run.moe[s]]
        for s in range(len(runs[0].moe))
    ]
    opt = {k: full(lambda run, k=k: run.opt_state[k]) for k in ("m", "v")}
    return FullView(runs[0].losses, runs[0].grad_norms, full(lambda run: run.grads),
                    full(lambda run: run.params), opt, routing)  # fmt: skip
