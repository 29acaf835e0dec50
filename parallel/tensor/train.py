"""Training with tensor (and sequence) parallelism on the tp axis of a Mesh, checked by the oracle.

Every rank rebuilds init_params(cfg, seed), keeps its shards (megatron_plan) and trains them with
the single-rank AdamW, which is elementwise and so exact on shards. One step mirrors
emulator/reference.py: micro-batches, CE normalised by the global token count, gradients summed,
then (SP only) the partial replicated gradients summed over tp, optional clipping by the global
norm (sharded squares all-reduced over tp, replicated ones counted once), then AdamW.
The layers run on the one model driver (parallel/pipeline/executor.py, one stage: F0 B0 F1 B1
...) through a TP LayerContext (parallel/layer.py). Every collective of block i in micro-batch j
runs under the scope "blocks.{i}/mb{j}/fwd" or
".../bwd" (the embedding and head likewise: "embed/mb{j}/fwd", ...), so the ledger gives bytes per
layer per micro-batch (parallel/tensor/cost.py has the formulas); the backward's SP re-gathers add
"/regather", an MoE block's gate-gradient all-reduce "/gates".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator import Mesh, affinity, scope
from emulator.data import split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import check_inputs, init_params, to_compute
from emulator.precision import compute_dtype
from parallel.data.common import Hooks, loss_scales
from parallel.data.train import check_layout
from parallel.layer import LayerContext
from parallel.pipeline.executor import OneStage, run_schedule
from parallel.pipeline.schedules import make_schedule
from parallel.tensor.block import check_tp, megatron_plan
from parallel.tensor.dp import DataParallelSync
from parallel.tensor.sequence import reduce_partial_grads
from parallel.tensor.shard import shard, unshard_each


class _TPHooks(Hooks):
    """tp_train's side of the driver: every layer computes with the rank's compute shards; a
    micro-batch's gradients, complete once its embedding backward has run, go to the dp sync
    (DDP buckets, ZeRO-1 or a local sum: parallel/tensor/dp.py) in one piece."""

    def __init__(self, compute, sync, names, k, mem):
        self.compute, self.sync, self.names, self.k, self.mem = compute, sync, names, k, mem
        self.mb_grads, self.act = {}, {}

    def start(self, kind: str, mb: int, layers: list) -> None:
        self.mb = mb
        if kind == "B":  # after this micro-batch's forward: the blocks' live activations
            self.act = {n: self.mem.nbytes("activations", n) for n in self.mem.live("activations")}

    def pre_forward(self, layer: str) -> dict:
        return self.compute

    def post_backward(self, layer: str, grads: dict) -> None:
        self.mb_grads.update(grads)
        if layer == "embed":  # the last layer of the backward
            grads, self.mb_grads = {n: self.mb_grads[n] for n in self.names}, {}
            self.sync.feed(grads, last=self.mb == self.k - 1)


@dataclasses.dataclass
class TPRun:
    losses: list
    grad_norms: list
    grads: dict  # last step's accumulated gradient (before clipping), full shape
    params: dict  # final master parameters, full shape
    local_grads: dict  # this rank's shards of ``grads``
    act_bytes: dict  # activations/<name> bytes of every block of the last micro-batch
    memory: dict  # this rank's MemoryLedger snapshot
    routing: list  # MoE: [step][reference micro-batch][block] -> moe_routing.decisions(...)
    replica_mismatch: list  # "param/grad <name>" of replicated tensors whose tp copies differ


def replica_mismatch(every: list, plan: dict, group=None) -> list[str]:
    """every: [(params, grads) of each tp rank] -> the replicated tensors whose copies are not
    bitwise equal. Every rank computes them from the same full activations (or sums the SP
    partials with one all-reduce) and steps them with the same AdamW, so they agree exactly; a
    rank that skips or repeats an update of its copy shows here whatever the dtype.
    ``group``: the tp group every rank of which calls this with the same ``every``; on virtual
    ranks (``shares_memory``) rank i compares every R-th tensor and the findings are gathered
    (uncounted), so the group compares each tensor once, not R times."""
    part, R = affinity.share(group)
    bad = []
    for i, what in enumerate(("param", "grad")):
        for j, (n, x) in enumerate(every[0][i].items()):
            if j % R != part or plan[n].sharded:
                continue
            if any(not np.array_equal(x, e[i][n]) for e in every[1:]):
                bad.append((i, j, f"{what} {n}"))
    return affinity.merge_found(group, bad, R)


def tp_train(mesh, cfg, seed, batches, steps, *, sequence_parallel=False, regather=True,
             microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
             max_norm=None, recompute="none", groups_fn=None, dp_stage=None,
             params=None) -> TPRun:  # fmt: skip
    """Train on a Mesh with a "tp" axis (and optionally "dp"), or a Comm (all ranks are tp).

    ``batches(step) -> (tokens, targets)``: the step's global batch; dp rank d takes rows
    d B/D .. and splits them into ``microbatches`` (its micro-batch j is the reference's
    micro-batch d k + j when the reference runs with D k micro-batches). ``dp_stage``: "ddp"
    (default when dp > 1) or "1" (ZeRO-1), parallel/tensor/dp.py. ``params``: full-shape initial
    parameters (default init_params(cfg, seed)), as reference_train's. Returns full-shape params
    and grads (gathered uncounted with allgather_object), the MoE routing decisions
    (parallel/check/routing.py compares them with the reference's) and the replicated tensors
    whose copies differ across tp ranks (none in a correct run).
    """
    check_training("tp_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh, tp=mesh.world_size)
    tp, t, sp = mesh["tp"], mesh.size("tp"), sequence_parallel
    ctx = LayerContext(tp=tp, sp=sp, regather=regather, tag="")
    check_tp(cfg, t)
    plan = megatron_plan(cfg)
    full = init_params(cfg, seed) if params is None else params
    params = shard(full, plan, tp.rank, t)  # this rank's master shards (copies)
    hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    sync = DataParallelSync(mesh, params, plan, cfg, dp_stage, max_norm=max_norm, **hyper)
    mem, losses, norms, k, routing = mesh.comm.memory, [], [], microbatches, []
    for step in range(steps):
        mesh.comm.ledger.step = step
        tokens, targets = check_inputs(
            *(batches(step) if callable(batches) else batches[step]), cfg
        )
        check_tp(cfg, t, tokens.shape[1], sp)
        check_layout("ddp", sync.D, tokens.shape[0], k)
        mbs = split_microbatches(*sync.shard_batch(tokens, targets), k)
        b, S = mbs[0][0].shape
        groups = [groups_fn(step, g, b, S) if groups_fn else None for g in range(sync.D * k)]
        n_groups = [1 if g is None else len(g) for g in groups]
        compute = sync.compute_params(to_compute)
        hooks = _TPHooks(compute, sync, list(params), k, mem)
        mb_losses, routes = {}, {}
        if recompute not in ("none", "selective"):
            raise ValueError(
                f"tensor parallel supports recompute 'none' or 'selective', not {recompute!r}"
            )
        # the one model driver: one stage running F0 B0 F1 B1 ... with the TP layer context;
        # scopes "<layer>/mb<j>/<fwd|bwd>" as before (tag="")
        run_schedule(OneStage(), make_schedule("1f1b", 1, k), [list(range(cfg.n_layers))], None,
                     mbs, cfg, ce_denom=tokens.size,
                     aux_scales=[loss_scales(tokens.size, n_groups[sync.rank * k + j],
                                             sum(n_groups))[1] for j in range(k)],
                     groups=groups[sync.rank * k : (sync.rank + 1) * k], recompute=recompute,
                     mem=mem, ctx=ctx, hooks=hooks, dtype=compute_dtype(cfg.dtype),
                     mb_losses=mb_losses, routing=routes, io_activations=False)  # fmt: skip
        act, shares = hooks.act, [mb_losses[j] for j in range(k)]
        routing.append([routes.get(j, []) for j in range(k)] if cfg.is_moe else [])
        acc = sync.gradients()
        if sp:
            with scope("sp/grads"):  # LayerNorm & co. saw only S/R positions: sum them over tp
                acc = reduce_partial_grads(tp, acc)
        losses.append(sync.total_loss(shares))
        norms.append(sync.step(acc))
        check_finite(step, rank=mesh.comm.rank, loss=losses[-1], grad_norm=norms[-1],
                     where="tensor parallel")  # fmt: skip
    master, grads = sync.full_state()
    grads = acc if grads is None else grads
    every = tp.allgather_object((master, grads))  # uncounted: the check, not the training
    full_p, full_g = unshard_each(tp, [[e[0] for e in every], [e[1] for e in every]], plan)
    if sync.dp is not None:  # every micro-batch, in the reference's order (d k + j)
        per_dp = sync.dp.allgather_object(routing)
        routing = [[mb for d in per_dp for mb in d[step]] for step in range(steps)]
    bad = replica_mismatch(every, plan, tp)
    run = TPRun(losses, norms, full_g, full_p, grads, act, mem.snapshot(), routing, bad)
    sync.close()  # free the dp engine's memory entries: another run may follow on these ranks
    return run
