"""The oracle: a single-rank training run every parallel layout is compared with.

One step over a global batch (B, S) split into M equal micro-batches:
  loss = sum_mb CE_sum(mb) / (B*S)  +  aux_loss_coef * sum_blocks (1/G) sum_all_groups aux_g
so CE is normalised by the global token count (not per micro-batch), and a block's aux is the
mean over all G routing groups of the step (by default one group per micro-batch, G = M). Each
micro-batch is run with ce_denom = B*S and aux_scale = (its groups) / G, and the gradients are
summed, so the accumulated gradient is exactly the gradient of this global loss. Gradients are
then (optionally) clipped by global norm and AdamW updates the master parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator.data import split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import check_inputs, init_params, model_backward, model_forward, to_compute
from emulator.optim import AdamW, clip_grad_norm, grad_norm_sq
from emulator.precision import down, up


@dataclasses.dataclass
class ReferenceRun:
    losses: list  # total loss per step (CE + weighted aux)
    ce: list  # CE part per step
    grad_norms: list  # global L2 norm of the accumulated gradient, before clipping
    grads: dict  # accumulated gradient of the last step, before clipping (compute dtype)
    params: dict  # final master parameters
    init_params: dict
    opt_state: dict  # AdamW.state_dict(): step, m, v, hyper-parameters
    grads_per_step: list | None = None  # every step's gradient if keep_all_grads


def _accumulate(acc, grads):
    if acc is None:
        return grads
    return {n: down(up(a) + up(grads[n]), a.dtype) for n, a in acc.items()}


def account_state(mem, cfg, params, opt):
    """Ledger the static state: master params (+ bf16 compute copy), grads, Adam moments."""
    compute = to_compute({n: p[:0] for n, p in params.items()}, cfg)  # dtypes only
    n = sum(p.size for p in params.values())
    item_c = next(iter(compute.values())).itemsize
    mem.alloc("params", "master", sum(p.nbytes for p in params.values()))
    if cfg.dtype == "mixed":
        mem.alloc("params", "compute_copy", n * item_c)
    mem.alloc("grads", "grads", n * item_c)
    mem.alloc("optimizer", "adamw", opt.nbytes())


def reference_train(
    cfg, seed, batches, steps, *, microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
    weight_decay=0.0, max_norm=None, recompute="none", groups_fn=None, params=None,
    keep_all_grads=False, mem=None,
):  # fmt: skip
    """Train ``steps`` steps; ``batches`` is a callable step -> (tokens, targets) or a sequence.

    groups_fn(step, microbatch, B_mb, S) -> routing groups of that micro-batch (flat indices
    within it) or None for one group. ``params`` overrides init_params(cfg, seed) (copied).
    """
    check_training("reference_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    params = init_params(cfg, seed) if params is None else {n: p.copy() for n, p in params.items()}
    init = {n: p.copy() for n, p in params.items()}
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if mem is not None:
        account_state(mem, cfg, params, opt)
    run = ReferenceRun([], [], [], {}, params, init, {}, [] if keep_all_grads else None)
    for step in range(steps):
        tokens, targets = batches(step) if callable(batches) else batches[step]
        tokens, targets = check_inputs(tokens, targets, cfg)
        mbs = split_microbatches(tokens, targets, microbatches)
        S = tokens.shape[1]
        groups = [
            groups_fn(step, i, t.shape[0], S) if groups_fn else None for i, (t, _) in enumerate(mbs)
        ]
        n_groups = [1 if g is None else len(g) for g in groups]
        compute = to_compute(params, cfg)  # bf16 copy in mixed mode, the same arrays otherwise
        acc, loss, ce = None, 0.0, 0.0
        for i, (t, y) in enumerate(mbs):
            kw = {"recompute": recompute, "groups": groups[i], "mem": mem, "mem_prefix": f"mb{i}."}
            aux_scale = n_groups[i] / sum(n_groups)
            mb_loss, cache = model_forward(
                compute, t, y, cfg, ce_denom=tokens.size, aux_scale=aux_scale, **kw
            )
            acc = _accumulate(acc, model_backward(cache))
            loss, ce = loss + mb_loss, ce + cache["ce"]
        run.losses.append(loss)
        run.ce.append(ce)
        run.grads = acc
        if keep_all_grads:
            run.grads_per_step.append({n: g.copy() for n, g in acc.items()})
        if max_norm is not None:
            acc = {n: g.copy() for n, g in acc.items()}  # keep run.grads unclipped
            run.grad_norms.append(clip_grad_norm(acc, max_norm))
        else:
            run.grad_norms.append(float(np.sqrt(grad_norm_sq(acc))))
        check_finite(step, rank=0, loss=loss, grad_norm=run.grad_norms[-1], where="reference")
        opt.step(params, acc)
    run.opt_state = opt.state_dict()
    return run
