"""Training with tensor (and sequence) parallelism on the tp axis of a Mesh, checked by the oracle.

Every rank rebuilds init_params(cfg, seed), keeps its shards (megatron_plan) and trains them with
the single-rank AdamW, which is elementwise and so exact on shards. One step mirrors
emulator/reference.py: micro-batches, CE normalised by the global token count, gradients summed,
then (SP only) the partial replicated gradients summed over tp, optional clipping by the global
norm (sharded squares all-reduced over tp, replicated ones counted once), then AdamW.
Every collective of block i runs under the scope "blocks.{i}/fwd" or "blocks.{i}/bwd", so the
ledger gives bytes per layer (parallel/tp_cost.py has the formulas).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from collectives.api import all_reduce
from emulator import Mesh, scope
from emulator.check import compare, rel_diff
from emulator.data import split_microbatches
from emulator.model import block_params, check_inputs, init_params, to_compute
from emulator.optim import AdamW, clip_coefficient, grad_norm_sq
from emulator.precision import down, up
from parallel.sequence import reduce_partial_grads
from parallel.shard import shard, unshard
from parallel.tensor import check_tp, megatron_plan, tp_block_backward, tp_block_forward
from parallel.vocab import (
    vocab_embedding_backward,
    vocab_embedding_forward,
    vocab_head_backward,
    vocab_head_forward,
)


def tp_model_forward(tp, p, tokens, targets, cfg, *, sp=False, regather=True, recompute="none",
                     groups=None, ce_denom=None, aux_scale=1.0, mem=None, prefix=""):  # fmt: skip
    """p: this rank's shards (compute dtype) -> (loss, cache). Blocks' activations -> ``mem``."""
    if recompute not in ("none", "selective"):
        raise ValueError(
            f"tensor parallel supports recompute 'none' or 'selective', not {recompute!r}"
        )
    with scope("embed/fwd"):
        x, ecache = vocab_embedding_forward(tp, tokens, p["embed.tok"], p["embed.pos"], sp=sp)
    blocks = []
    for i in range(cfg.n_layers):
        with scope(f"blocks.{i}/fwd"):
            kw = {"sp": sp, "regather": regather, "keep_probs": recompute == "none"}
            x, c = tp_block_forward(tp, block_params(p, i), x, cfg, groups=groups, mem=mem,
                                    name=f"{prefix}blocks.{i}", **kw)  # fmt: skip
        blocks.append(c)
    with scope("head/fwd"):
        ce, hcache = vocab_head_forward(tp, p, x, targets, cfg, sp=sp, denom=ce_denom)
    daux = cfg.aux_loss_coef * aux_scale
    loss = float(ce) + daux * sum(c["aux"] for c in blocks)
    return loss, {"embed": ecache, "blocks": blocks, "head": hcache, "daux": daux, "ce": float(ce)}


def tp_model_backward(tp, cache, names) -> dict:
    """-> this rank's gradients by name (in ``names`` order)."""
    grads = {}
    with scope("head/bwd"):
        dx, g = vocab_head_backward(tp, 1.0, cache["head"])
    grads.update(g)
    for i in reversed(range(len(cache["blocks"]))):
        with scope(f"blocks.{i}/bwd"):
            dx, dbp = tp_block_backward(tp, dx, cache["blocks"][i], daux=cache["daux"])
        grads.update({f"blocks.{i}.{n}": d for n, d in dbp.items()})
    with scope("embed/bwd"):
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


def tp_train(mesh, cfg, seed, batches, steps, *, sequence_parallel=False, regather=True,
             microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
             max_norm=None, recompute="none", groups_fn=None) -> TPRun:  # fmt: skip
    """Train on ``mesh["tp"]`` (a Mesh with a "tp" axis, or a Comm: all its ranks are tp).

    ``batches(step) -> (tokens, targets)``: the step's batch (every tp rank gets the same).
    Returns full-shape params and grads (gathered uncounted with allgather_object).
    """
    mesh = mesh if isinstance(mesh, Mesh) else Mesh(mesh, tp=mesh.world_size)
    tp, t, sp = mesh["tp"], mesh.size("tp"), sequence_parallel
    check_tp(cfg, t)
    plan = megatron_plan(cfg)
    params = shard(init_params(cfg, seed), plan, tp.rank, t)  # this rank's master shards
    sharded = [n for n in params if plan[n].sharded]
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    mem, losses, norms, acc = mesh.comm.memory, [], [], None
    for step in range(steps):
        mesh.comm.ledger.step = step
        tokens, targets = check_inputs(
            *(batches(step) if callable(batches) else batches[step]), cfg
        )
        check_tp(cfg, t, tokens.shape[1], sp)
        mbs = split_microbatches(tokens, targets, microbatches)
        compute, acc, loss = to_compute(params, cfg), None, 0.0
        for i, (tk, tg) in enumerate(mbs):
            grp = groups_fn(step, i, tk.shape[0], tk.shape[1]) if groups_fn else None
            mb_loss, cache = tp_model_forward(
                tp, compute, tk, tg, cfg, sp=sp, regather=regather, recompute=recompute,
                groups=grp, ce_denom=tokens.size, aux_scale=1 / microbatches, mem=mem, prefix=f"mb{i}.",
            )  # fmt: skip
            act = {n: mem.nbytes("activations", n) for n in mem.live("activations")}
            g = tp_model_backward(tp, cache, params)
            acc = g if acc is None else {n: down(up(a) + up(g[n]), a.dtype) for n, a in acc.items()}
            loss += mb_loss
        if sp:
            with scope("sp/grads"):  # LayerNorm & co. saw only S/R positions: sum them
                acc = reduce_partial_grads(tp, acc)
        losses.append(loss)
        with scope("clip"):
            local_sq = grad_norm_sq([acc[n] for n in sharded])
            sq = float(all_reduce(tp, np.array([local_sq]), algorithm="ring")[0])
            total = float(
                np.sqrt(sq + grad_norm_sq([a for n, a in acc.items() if n not in sharded]))
            )
        norms.append(total)
        step_grads = acc
        if max_norm is not None and clip_coefficient(total, max_norm) < 1.0:
            coef = clip_coefficient(total, max_norm)
            step_grads = {n: down(up(a) * coef, a.dtype) for n, a in acc.items()}
        opt.step(params, step_grads)
    every = tp.allgather_object((params, acc))  # uncounted: the check, not the training
    full_p = unshard([e[0] for e in every], plan)
    full_g = unshard([e[1] for e in every], plan)
    return TPRun(losses, norms, full_g, full_p, acc, act, mem.snapshot())


# dL/d(attn.bk) = 0 exactly: q . (k_j + bk) shifts every score of a query row by the same q . bk
# and softmax ignores it. The reference's "gradient" is rounding noise (~1e-20), so this one
# tensor is compared on the scale of the whole model (absolute / max over all tensors).
NULL_GRADIENT = ("attn.bk",)


def compare_with_reference(run, ref, rtol: float) -> tuple[dict, list]:
    """Worst relative difference of losses, grads and params; a message per failure."""
    worst, problems = {}, []
    d = rel_diff(run.losses, ref.losses)
    worst["loss"] = d
    if not d <= rtol:
        problems.append(f"losses differ by {d:.3e} > {rtol:.1e}: {run.losses} vs {ref.losses}")
    for what, got, want in (("grad", run.grads, ref.grads), ("param", run.params, ref.params)):
        scale = max(float(np.max(np.abs(np.asarray(a, np.float64)))) for a in want.values())
        normal = {n: a for n, a in want.items() if not n.endswith(NULL_GRADIENT)}
        worst[what], probs = compare({n: got[n] for n in normal}, normal, rtol, what)
        problems += probs
        for n in set(want) - set(normal):
            e = float(
                np.max(np.abs(np.asarray(got[n], np.float64) - np.asarray(want[n], np.float64)))
            )
            if not e <= rtol * scale:
                problems.append(
                    f"{what} {n}: |diff| {e:.3e} > {rtol:.1e} x model scale {scale:.3e}"
                )
    return worst, problems
