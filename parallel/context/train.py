"""Context-parallel (x data-parallel) training, comparable with emulator.reference.reference_train.

Mesh dp x cp (cp varies fastest: a cp group is neighbouring ranks). Rank (d, c) takes the
data-parallel rows of dp rank d (emulator.data.shard_batch), splits them into k micro-batches
and keeps the sequence columns of cp rank c (layout.table): everything outside attention runs on
those local tokens unchanged - the position embedding takes the rows of their global positions -
and attention is the context-parallel core (parallel.context.attention) on the cp group.

Gradients: each rank's loss share is CE over its local tokens / the global token count (plus its
aux share), so the gradient of every replicated weight is the SUM over dp x cp of the ranks'
gradients - one DDP over the whole dp x cp group (cp is, for the weights, more data parallelism).

MoE routing groups under cp: each cp rank's tokens of a micro-batch form one routing group (its
capacity and aux loss are computed on the tokens it holds; no cross-rank routing). The reference
is handed the same groups: routing_groups(B_mb, S, table) -> C groups per micro-batch, flat
indices b S + position, in the local token order. So a micro-batch has C groups and a rank's
aux share is 1 / (D k C).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from emulator.data import shard_batch, split_microbatches
from emulator.guards import check_finite, check_training
from emulator.mesh import Mesh
from emulator.model import check_inputs, init_params, to_compute
from emulator.optim import AdamW
from parallel.clip import clip_
from parallel.context import layout
from parallel.context.attention import check_method, cp_attention_backward, cp_attention_forward
from parallel.data.common import loss_scales, microbatch_step
from parallel.data.ddp import DDP
from parallel.data.fsdp import ReplicatedHooks
from parallel.data.train import check_layout


@dataclasses.dataclass
class CPRun:
    losses: list
    grad_norms: list
    grads: dict  # the last step's summed gradient, before clipping
    params: dict  # final master parameters
    step_bytes: list  # per step: {"fwd", "bwd", "grads"}: (sent, received) of this rank
    act_bytes: dict  # the last step's activations/<mb j.blocks.i> bytes on this rank
    positions: np.ndarray  # the (C, S_local) table of the last step


class _Hooks(ReplicatedHooks):
    """DDP's hooks, noting each block's activation bytes right after its forward."""

    def __init__(self, params, sink, mem, prefix, out):
        super().__init__(params, sink)
        self.mem, self.prefix, self.out = mem, prefix, out

    def post_forward(self, layer: str) -> None:
        if layer.startswith("blocks."):
            name = self.prefix + layer
            self.out[name] = self.mem.nbytes("activations", name)


def routing_groups(B_mb: int, S: int, table) -> list:
    """The reference's routing groups of one micro-batch under cp: cp rank c's tokens."""
    b = np.arange(B_mb)[:, None] * S
    return [(b + row[None, :]).reshape(-1) for row in np.asarray(table)]


def cp_mesh(comm, cp: int) -> Mesh:
    if not isinstance(cp, (int, np.integer)) or cp < 1 or comm.size % cp:
        raise ValueError(
            f"context parallel: cp={cp!r} must divide the world size {comm.size} "
            f"(dp = world / cp); choose cp in {[c for c in range(1, comm.size + 1) if comm.size % c == 0]}"
        )
    return Mesh(comm, dp=comm.size // cp, cp=cp)


def cp_train(comm, cfg, seed, batches, steps, *, cp, method="ring", balance="zigzag",
             microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
             max_norm=None, recompute="none", bucket_cap_mb=25.0) -> CPRun:  # fmt: skip
    """Train `steps` steps on dp x cp = comm.size ranks; every rank returns the same figures."""
    check_training("cp_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    check_method(method)
    mesh = cp_mesh(comm, cp)
    D, d, c = mesh.size("dp"), mesh.coord("dp"), mesh.coord("cp")
    attention = (
        functools.partial(cp_attention_forward, mesh["cp"], method=method),
        cp_attention_backward,
    )
    params = init_params(cfg, seed)  # same seed everywhere: identical replicas
    opt = AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    run = CPRun([], [], {}, {}, [], {}, np.zeros((cp, 0), np.int64))
    with DDP(comm, params, bucket_cap_mb=bucket_cap_mb, dtype=cfg.dtype) as ddp:
        for step in range(steps):
            tokens, targets = batches(step) if callable(batches) else batches[step]
            tokens, targets = check_inputs(tokens, targets, cfg)
            B, S = tokens.shape
            check_layout("ddp", D, B, microbatches)
            tab = run.positions = layout.table(S, cp, balance)  # checks S against cp
            mine, k = tab[c], microbatches
            attn = (functools.partial(attention[0], positions=tab), attention[1])
            mbs = split_microbatches(*shard_batch(tokens, targets, d, D), k)
            ce_denom, aux_scale = loss_scales(tokens.size, 1, D * k * cp)
            compute = to_compute(params, cfg)
            mark, shares = comm.ledger.mark(), []
            for j, (t, y) in enumerate(mbs):
                hooks = _Hooks(compute, ddp, comm.memory, f"mb{j}.", run.act_bytes)
                ctx = ddp.no_sync() if j < k - 1 else contextlib.nullcontext()
                with ctx:
                    shares.append(microbatch_step(
                        hooks, t[:, mine], y[:, mine], cfg, ce_denom=ce_denom,
                        aux_scale=aux_scale, recompute=recompute, positions=mine, attention=attn,
                        mem=comm.memory, mem_prefix=f"mb{j}.",
                    ))  # fmt: skip
            run.losses.append(sum(s for every in comm.allgather_object(shares) for s in every))
            grads = ddp.finish()  # summed over dp x cp
            run.grads = {n: g.copy() for n, g in grads.items()}
            run.grad_norms.append(clip_(grads, max_norm, (), tag="dp/clip")[0])
            check_finite(step, rank=comm.rank, loss=run.losses[-1], grad_norm=run.grad_norms[-1],
                         where="cp_train")  # fmt: skip
            opt.step(params, grads)
            ddp.zero_grad()
            recs = comm.ledger.since(mark)
            run.step_bytes.append({
                what: (comm.ledger.sent(recs, tag=tag), comm.ledger.received(recs, tag=tag))
                for what, tag in (("fwd", "cp-attn/fwd"), ("bwd", "cp-attn/bwd"),
                                  ("grads", "dp/grads*"))
            })  # fmt: skip
    run.params = {n: p.copy() for n, p in params.items()}
    return run
