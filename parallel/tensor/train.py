"""Training with tensor (and sequence) parallelism on the tp axis of a Mesh, checked by the oracle.

Every rank rebuilds init_params(cfg, seed), keeps its shards (megatron_plan) and trains them with
the single-rank AdamW, which is elementwise and so exact on shards. One step mirrors
emulator/reference.py: micro-batches, CE normalised by the global token count, gradients summed,
then (SP only) the partial replicated gradients summed over tp, optional clipping by the global
norm (sharded squares all-reduced over tp, replicated ones counted once), then AdamW.
Every collective of block i in micro-batch j runs under the scope "blocks.{i}/mb{j}/fwd" or
".../bwd" (the embedding and head likewise: "embed/mb{j}/fwd", ...), so the ledger gives bytes per
layer per micro-batch (parallel/tensor/cost.py has the formulas); the backward's SP re-gathers add
"/regather", an MoE block's gate-gradient all-reduce "/gates".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator import Mesh, scope
from emulator.data import split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import block_params, check_inputs, init_params, to_compute
from parallel.check.routing import decisions
from parallel.data.common import loss_scales
from parallel.data.train import check_layout
from parallel.tensor.block import check_tp, megatron_plan, tp_block_backward, tp_block_forward
from parallel.tensor.dp import DataParallelSync
from parallel.tensor.sequence import reduce_partial_grads
from parallel.tensor.shard import shard, unshard
from parallel.tensor.vocab import (
    vocab_embedding_backward,
    vocab_embedding_forward,
    vocab_head_backward,
    vocab_head_forward,
)


def _scope(where: str, mb: str, phase: str):
    """The ledger tag "<where>/<mb>/<phase>" ("blocks.0/mb1/bwd"; no mb part if mb is "")."""
    return scope("/".join(x for x in (where, mb, phase) if x))


def tp_model_forward(tp, p, tokens, targets, cfg, *, sp=False, regather=True, recompute="none",
                     groups=None, ce_denom=None, aux_scale=1.0, mem=None, prefix=""):  # fmt: skip
    """p: this rank's shards (compute dtype) -> (loss, cache). Blocks' activations -> ``mem``
    under names prefixed by ``prefix`` ("mb{j}."), which also names the ledger scopes."""
    if recompute not in ("none", "selective"):
        raise ValueError(
            f"tensor parallel supports recompute 'none' or 'selective', not {recompute!r}"
        )
    mb = prefix.rstrip(".")
    with _scope("embed", mb, "fwd"):
        x, ecache = vocab_embedding_forward(tp, tokens, p["embed.tok"], p["embed.pos"], sp=sp)
    blocks = []
    for i in range(cfg.n_layers):
        with _scope(f"blocks.{i}", mb, "fwd"):
            kw = {"sp": sp, "regather": regather, "keep_probs": recompute == "none"}
            x, c = tp_block_forward(tp, block_params(p, i), x, cfg, groups=groups, mem=mem,
                                    name=f"{prefix}blocks.{i}", **kw)  # fmt: skip
        blocks.append(c)
    with _scope("head", mb, "fwd"):
        ce, hcache = vocab_head_forward(tp, p, x, targets, cfg, sp=sp, denom=ce_denom)
    daux = cfg.aux_loss_coef * aux_scale
    loss = float(ce) + daux * sum(c["aux"] for c in blocks)
    cache = {"embed": ecache, "blocks": blocks, "head": hcache, "daux": daux, "ce": float(ce)}
    return loss, cache | {"mb": mb}


def tp_model_backward(tp, cache, names) -> dict:
    """-> this rank's gradients by name (in ``names`` order)."""
    grads, mb = {}, cache["mb"]
    with _scope("head", mb, "bwd"):
        dx, g = vocab_head_backward(tp, 1.0, cache["head"])
    grads.update(g)
    for i in reversed(range(len(cache["blocks"]))):
        with _scope(f"blocks.{i}", mb, "bwd"):
            dx, dbp = tp_block_backward(tp, dx, cache["blocks"][i], daux=cache["daux"])
        grads.update({f"blocks.{i}.{n}": d for n, d in dbp.items()})
    with _scope("embed", mb, "bwd"):
        grads["embed.tok"], grads["embed.pos"] = vocab_embedding_backward(tp, dx, cache["embed"])
    return {n: grads[n] for n in names}


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


def replica_mismatch(every: list, plan: dict) -> list[str]:
    """every: [(params, grads) of each tp rank] -> the replicated tensors whose copies are not
    bitwise equal. Every rank computes them from the same full activations (or sums the SP
    partials with one all-reduce) and steps them with the same AdamW, so they agree exactly; a
    rank that skips or repeats an update of its copy shows here whatever the dtype."""
    bad = []
    for i, what in enumerate(("param", "grad")):
        for n, x in every[0][i].items():
            if not plan[n].sharded and any(not np.array_equal(x, e[i][n]) for e in every[1:]):
                bad.append(f"{what} {n}")
    return bad


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
        compute, shares = sync.compute_params(to_compute), []
        routing.append([])
        for j, (tk, tg) in enumerate(mbs):
            g_id = sync.rank * k + j  # the reference's micro-batch number
            ce_denom, aux_scale = loss_scales(tokens.size, n_groups[g_id], sum(n_groups))
            mb_loss, cache = tp_model_forward(
                tp, compute, tk, tg, cfg, sp=sp, regather=regather, recompute=recompute,
                groups=groups[g_id], ce_denom=ce_denom, aux_scale=aux_scale, mem=mem,
                prefix=f"mb{j}.",
            )  # fmt: skip
            act = {n: mem.nbytes("activations", n) for n in mem.live("activations")}
            if cfg.is_moe:
                routing[-1].append([decisions(c["moe"]["groups"]) for c in cache["blocks"]])
            sync.feed(tp_model_backward(tp, cache, params), last=j == k - 1)
            shares.append(mb_loss)
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
    full_p = unshard([e[0] for e in every], plan)
    full_g = unshard([e[1] for e in every], plan)
    if sync.dp is not None:  # every micro-batch, in the reference's order (d k + j)
        per_dp = sync.dp.allgather_object(routing)
        routing = [[mb for d in per_dp for mb in d[step]] for step in range(steps)]
    bad = replica_mismatch(every, plan)
    run = TPRun(losses, norms, full_g, full_p, grads, act, mem.snapshot(), routing, bad)
    sync.close()  # free the dp engine's memory entries: another run may follow on these ranks
    return run
