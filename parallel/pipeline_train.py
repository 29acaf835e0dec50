"""Training with pipeline parallelism, alone on a `pp` group or on a dp x pp mesh.

One optimizer step: the global batch (B, S) is cut into D data-parallel shards (D = 1 without
dp) and each shard into m micro-batches of b = B/(D m) sequences; every stage runs its schedule
(pipeline.run_schedule), so the m micro-batches' gradients accumulate into one step - the
pipeline's micro-batches are the gradient-accumulation micro-batches. CE is divided by the
global token count B*S and a micro-batch's MoE aux by m*D, so gradients are summed (never
averaged) over micro-batches and over dp: exactly reference_train's gradient
(docs/CONTRACTS.md, "parallel data-parallel API").

Optimizer: each stage runs AdamW on its own parameters; clipping needs the global norm, so the
local sum of squares is all-reduced over pp (and dp). With dp, "ddp" all-reduces the stage's
gradients over its dp group (parallel/ddp.py); "zero1" reduce-scatters them and each dp rank
updates its shard of the stage's optimizer state (parallel/zero.py, stage 1).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import emulator
from collectives.api import all_reduce
from emulator.data import shard_batch, split_microbatches
from emulator.model import check_inputs, init_params, to_compute
from emulator.optim import AdamW, clip_coefficient, grad_norm_sq
from emulator.precision import down, up

from .pipeline import run_schedule, split_layers, stage_param_names
from .schedules import Schedule, make_schedule, validate

DP_MODES = ("none", "ddp", "zero1")


@dataclasses.dataclass
class PipelineRun:
    losses: list  # total loss per step (every rank)
    params: dict  # final master parameters, full names (gathered, uncounted)
    grads: dict  # last step's gradient summed over micro-batches and dp, before clipping
    schedule: Schedule  # the schedule every stage executed (its recorded action order)
    split: list  # blocks per virtual stage
    in_flight: list  # per stage: peak micro-batch (chunk) units alive, measured by the executor
    act_peak: list  # per stage: peak "activations" bytes of the memory ledger in the last step
    p2p: list  # per stage: {"sent": bytes, "recv": bytes} of stage-boundary messages, one step


def pipeline_train(where, cfg, seed, batches, steps, *, schedule="1f1b", microbatches=4,
                   chunks=1, sizes=None, dp_mode="none", recompute="none", lr=1e-3,
                   betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_norm=None):  # fmt: skip
    """Train on a Comm (all ranks are pipeline stages) or a Mesh with a "pp" axis (and "dp").

    Returns a PipelineRun on every rank, comparable with reference_train(cfg, seed, batches,
    steps, microbatches=D*m).
    """
    mesh = where if isinstance(where, emulator.Mesh) else None
    pp = mesh["pp"] if mesh else where
    dp = mesh["dp"] if mesh and "dp" in mesh.names else None
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r}: choose one of {DP_MODES}")
    if dp_mode != "none" and dp is None:
        raise ValueError(f"dp_mode={dp_mode!r} needs a Mesh with a 'dp' axis, e.g. Mesh(comm, dp=2, pp=2)")  # fmt: skip
    D = dp.size if dp is not None else 1
    sched = validate(make_schedule(schedule, pp.size, microbatches, chunks))
    split = split_layers(cfg.n_layers, pp.size * chunks, sizes)
    names = stage_param_names(cfg, split, pp.rank, pp.size)
    full = init_params(cfg, seed)
    master = {n: full[n].copy() for n in names}
    mem = pp.memory
    opt, ddp = _optimizer(dp, dp_mode, master, cfg, lr, betas, eps, weight_decay, max_norm, pp)
    run = PipelineRun([], {}, {}, sched, split, [], [], [])
    for step in range(steps):
        tokens, targets = batches(step) if callable(batches) else batches[step]
        tokens, targets = check_inputs(tokens, targets, cfg)
        if dp is not None:
            tokens, targets = shard_batch(tokens, targets, dp.rank, D)
        # each micro-batch its own arrays (not views of the batch), so a cache holding its ids
        # is charged for its b x S tokens in the memory ledger, not the whole batch's
        mbs = [(t.copy(), y.copy()) for t, y in split_microbatches(tokens, targets, microbatches)]
        compute = to_compute(opt.params if dp_mode == "zero1" else master, cfg)
        mem.reset_peak()
        mark = pp.ledger.mark()
        with emulator.scope("pp"):
            grads, loss, done, peak = run_schedule(
                pp, sched, split, compute, mbs, cfg, ce_denom=tokens.size * D,
                aux_scale=1.0 / (microbatches * D), recompute=recompute, mem=mem,
            )  # fmt: skip
        boundary = pp.ledger.since(mark)
        grads = {n: grads[n] for n in names}  # state_dict order: sums of squares add alike
        if dp_mode == "zero1":
            opt.step(grads)
        else:
            if ddp is not None:
                for n in reversed(names):  # buckets fill in reverse order, as in PyTorch
                    ddp.grad_ready(n, grads[n], where="pp")
                grads = dict(ddp.finish())
            _clip_and_step(opt, master, grads, max_norm, pp)
            if ddp is not None:
                ddp.zero_grad()
        losses = pp.allgather_object(loss)
        total = sum(losses) if dp is None else sum(dp.allgather_object(sum(losses)))
        run.losses.append(total)
    run.in_flight = pp.allgather_object(peak)
    run.act_peak = pp.allgather_object(mem.peak("activations"))
    sent = sum(r.nbytes for r in boundary if r.direction == "send" and r.group == pp.name)
    recv = sum(r.nbytes for r in boundary if r.direction == "recv" and r.group == pp.name)
    run.p2p = pp.allgather_object({"sent": sent, "recv": recv})
    executed = pp.allgather_object(done)
    run.schedule = Schedule(sched.name, sched.p, sched.m, sched.v, sched.split, executed)
    final = opt.master_params() if dp_mode == "zero1" else master
    if dp is not None and dp_mode == "zero1":
        grads = _sum_over(dp, grads)  # for the check only (uncounted)
    for part in pp.allgather_object(final):
        run.params.update(part)
    for part in pp.allgather_object(grads):
        run.grads.update(part)
    return run


def _optimizer(dp, mode, master, cfg, lr, betas, eps, weight_decay, max_norm, pp):
    if mode == "zero1":
        from .zero import ZeroOptimizer

        return ZeroOptimizer(dp, master, stage=1, dtype=cfg.dtype, lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay, max_norm=max_norm,
                             norm_groups=[pp]), None  # fmt: skip
    opt = AdamW(master, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if mode == "ddp":
        from .ddp import DDP

        return opt, DDP(dp, master, dtype=cfg.dtype)
    return opt, None


def _clip_and_step(opt, master, grads, max_norm, pp):
    """Clip by the global norm, then AdamW on this stage's parameters. The local sum of
    squares is all-reduced over pp only: every dp replica of a stage holds the same summed
    gradient (DDP), so adding over dp would count it D times."""
    if max_norm is not None:
        with emulator.scope("clip"):
            sq = all_reduce(pp, np.array([grad_norm_sq(grads)]))
        coef = clip_coefficient(float(np.sqrt(sq[0])), max_norm)
        if coef < 1.0:
            grads = {n: down(up(g) * coef, g.dtype) for n, g in grads.items()}
    opt.step(master, grads)


def _sum_over(comm, grads):
    parts = comm.allgather_object(grads)
    return {n: sum(p[n] for p in parts[1:]) + parts[0][n] for n in grads}
