"""Training with pipeline parallelism, alone on a `pp` group or on a dp x pp mesh.

One optimizer step: the global batch (B, S) is cut into D data-parallel shards (D = 1 without
dp) and each shard into m micro-batches of b = B/(D m) sequences; every stage runs its schedule
(pipeline.run_schedule), so the m micro-batches' gradients accumulate into one step - the
pipeline's micro-batches are the gradient-accumulation micro-batches. CE is divided by the
global token count B*S and a micro-batch's MoE aux weighted by its share of the step's routing
groups (1/(m D) with one group each), so gradients are summed (never averaged) over micro-batches
and over dp: exactly reference_train's gradient (docs/CONTRACTS.md, "parallel data-parallel
API"). Its dp traffic per stage is DDP's / ZeRO-1's formula on the stage's own parameters
(pipeline_cost.dp_bytes).

Optimizer: each stage runs AdamW on its own parameters; clipping needs the global norm, so the
local sum of squares is all-reduced over pp (ZeRO-1: over dp, then pp) by parallel/clip.py. With dp, "ddp" all-reduces the stage's
gradients over its dp group (parallel/data/ddp.py); "zero1" reduce-scatters them and each dp rank
updates its shard of the stage's optimizer state (parallel/data/zero.py, stage 1).
"""

from __future__ import annotations

import dataclasses

import emulator
from emulator.data import shard_batch, split_microbatches
from emulator.guards import check_finite, check_training
from emulator.model import check_inputs
from emulator.precision import compute_dtype
from emulator.shared_init import shared_init_params
from parallel.data.axis import DataAxis
from parallel.pipeline.executor import OneStage, run_schedule, split_layers, stage_param_names
from parallel.pipeline.schedules import SCHEDULES, Schedule, make_schedule, validate

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
    dp_bytes: list  # per stage: bytes this dp replica sent over its dp group ("dp/grads*",
    #                 "dp/params*") in the last step; [0] * p without dp


def pipeline_train(where, cfg, seed, batches, steps, *, schedule="1f1b", microbatches=None,
                   chunks=None, sizes=None, dp_mode="none", recompute="none", groups_fn=None,
                   lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                   max_norm=None):  # fmt: skip
    """Train on a Comm (all ranks are pipeline stages) or a Mesh with a "pp" axis (and "dp").

    schedule: a name in schedules.SCHEDULES (with microbatches, default 4, and chunks, default
    1) or a user-built schedules.Schedule (its m and v; microbatches / chunks, if given, must
    agree), validated before anything runs. groups_fn(step, microbatch, b, S) -> MoE routing
    groups of a global micro-batch (as reference_train's). Returns a PipelineRun on every rank,
    comparable with reference_train(cfg, seed, batches, steps, microbatches=D*m).
    """
    check_training("pipeline_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    mesh = where if isinstance(where, emulator.Mesh) else None
    pp = mesh["pp"] if mesh else where
    dp = mesh["dp"] if mesh and "dp" in mesh.names else None
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r}: choose one of {DP_MODES}")
    if dp_mode != "none" and dp is None:
        raise ValueError(f"dp_mode={dp_mode!r} needs a Mesh with a 'dp' axis, e.g. Mesh(comm, dp=2, pp=2)")  # fmt: skip
    D, r = (dp.size, dp.rank) if dp is not None else (1, 0)
    sched = resolve_schedule(schedule, pp.size, microbatches, chunks)
    m = sched.m
    if sched.split and recompute == "full":
        raise ValueError(f"{sched.name}: the B/W split needs the blocks' caches; use recompute "
                         f"'none' or 'selective' (full keeps only each block's input)")  # fmt: skip
    split = split_layers(cfg.n_layers, pp.size * sched.v, sizes)
    names = stage_param_names(cfg, split, pp.rank, pp.size)
    full = shared_init_params(pp, cfg, seed)  # read-only, shared on virtual ranks
    master = {n: full[n].copy() for n in names}
    mem = pp.memory
    # the dp side: DataAxis (parallel/data/axis.py) on this stage's parameters - local sum over
    # the micro-batches, then DDP's all-reduce or ZeRO-1's step; the norm over (dp,) pp
    axis = DataAxis(dp if dp_mode != "none" else OneStage(), master, int(dp_mode == "zero1"),
                    cfg, hyper={"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
                    max_norm=max_norm, norm_groups=(pp,), mem=None)  # fmt: skip
    run = PipelineRun([], {}, {}, sched, split, [], [], [], [])
    for step in range(steps):
        tokens, targets = batches(step) if callable(batches) else batches[step]
        tokens, targets = check_inputs(tokens, targets, cfg)
        if dp is not None:
            tokens, targets = shard_batch(tokens, targets, r, D)
        # each micro-batch its own arrays (not views of the batch), so a cache holding its ids
        # is charged for its b x S tokens in the memory ledger, not the whole batch's
        mbs = [(t.copy(), y.copy()) for t, y in split_microbatches(tokens, targets, m)]
        b, S = mbs[0][0].shape
        # routing groups of the D m global micro-batches, numbered as reference_train's
        groups = [groups_fn(step, g, b, S) if groups_fn else None for g in range(D * m)]
        n_groups = [1 if g is None else len(g) for g in groups]
        axis.begin_step()
        mem.reset_peak()
        mark = pp.ledger.mark()
        _, loss, done, peak = run_schedule(  # boundary traffic tagged "pp/act|grad/mb<j>"
            pp, sched, split, None, mbs, cfg, ce_denom=tokens.size * D,
            aux_scales=[n_groups[r * m + j] / sum(n_groups) for j in range(m)],
            groups=groups[r * m : (r + 1) * m], recompute=recompute, mem=mem, hooks=axis,
            dtype=compute_dtype(cfg.dtype),
        )  # fmt: skip
        boundary = pp.ledger.since(mark)
        axis.finish_step()
        recs = pp.ledger.since(mark)
        losses = pp.allgather_object(loss)
        total = sum(losses) if dp is None else sum(dp.allgather_object(sum(losses)))
        run.losses.append(total)
        check_finite(step, rank=pp.rank, losses=losses, loss=total, where="pipeline: pp ranks")
    run.in_flight = pp.allgather_object(peak)
    run.act_peak = pp.allgather_object(mem.peak("activations"))
    sent = sum(x.nbytes for x in boundary if x.direction == "send" and x.group == pp.name)
    recv = sum(x.nbytes for x in boundary if x.direction == "recv" and x.group == pp.name)
    run.p2p = pp.allgather_object({"sent": sent, "recv": recv})
    L = pp.ledger
    run.dp_bytes = pp.allgather_object(L.sent(recs, tag="dp/grads*") + L.sent(recs, tag="dp/params*"))  # fmt: skip
    executed = pp.allgather_object(done)
    run.schedule = Schedule(sched.name, sched.p, sched.m, sched.v, sched.split, executed)
    final, grads = axis.local_state()  # ZeRO-1: gathered over dp (uncounted, the check)
    for part in pp.allgather_object(final):
        run.params.update(part)
    for part in pp.allgather_object(grads):
        run.grads.update(part)
    axis.close()
    return run


def resolve_schedule(schedule, p: int, microbatches=None, chunks=None) -> Schedule:
    """The validated Schedule to run on p stages: make_schedule(name, p, m, v) or the given
    Schedule, which must be built for p stages and agree with microbatches / chunks if given."""
    if isinstance(schedule, Schedule):
        for what, given, has in (("microbatches", microbatches, schedule.m),
                                 ("chunks", chunks, schedule.v)):  # fmt: skip
            if given is not None and given != has:
                raise ValueError(f"{what}={given} but the given schedule {schedule.name!r} "
                                 f"has {has}; omit {what} or build the schedule with it")  # fmt: skip
        sched = schedule
    elif isinstance(schedule, str):
        m, v = 4 if microbatches is None else microbatches, 1 if chunks is None else chunks
        sched = make_schedule(schedule, p, m, v)
    else:
        raise TypeError(f"schedule={schedule!r}: give a name in {SCHEDULES} or a Schedule")
    if sched.p != p:
        raise ValueError(f"schedule {sched.name!r} is built for p={sched.p} stages but the "
                         f"pipeline group has {p} ranks")  # fmt: skip
    return validate(sched)
