"""Context-parallel (x data-parallel) training, comparable with emulator.reference.reference_train:
a thin recipe on the one N-D program, parallel.train(comm, Layout(dp=world/cp, cp=cp, ...)).

Mesh dp x cp (cp varies fastest: a cp group is neighbouring ranks). Rank (d, c) takes the
data-parallel rows of dp rank d (emulator.data.shard_batch), splits them into k micro-batches
and keeps the sequence columns of cp rank c (layout.table): everything outside attention runs on
those local tokens unchanged - the position embedding takes the rows of their global positions -
and attention is the context-parallel core (parallel.context.attention) on the cp group.

Gradients: each rank's loss share is CE over its local tokens / the global token count (plus its
aux share), so the gradient of every replicated weight is the SUM over dp x cp of the ranks'
gradients - one DDP over the whole dp x cp group (cp is, for the weights, more data parallelism;
parallel/train.py hands the DataAxis Mesh.group("dp", "cp")).

MoE routing groups under cp: each cp rank's tokens of a micro-batch form one routing group (its
capacity and aux loss are computed on the tokens it holds; no cross-rank routing). The reference
is handed the same groups: routing_groups(B_mb, S, table) -> C groups per micro-batch, flat
indices b S + position, in the local token order. So a micro-batch has C groups and a rank's
aux share is 1 / (D k C).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator.mesh import Mesh
from emulator.model import check_inputs
from parallel.context.attention import check_method
from parallel.context.layout import table
from parallel.layout import Layout
from parallel.tag_bytes import tag_bytes
from parallel.train import train


@dataclasses.dataclass
class CPRun:
    losses: list
    grad_norms: list
    grads: dict  # the last step's summed gradient, before clipping
    params: dict  # final master parameters
    step_bytes: list  # per step: {"fwd", "bwd", "grads"}: (sent, received) of this rank
    act_bytes: dict  # the last step's activations/<mb j.blocks.i> bytes on this rank
    positions: np.ndarray  # the (C, S_local) table of the last step


def routing_groups(B_mb: int, S: int, table) -> list:
    """The reference's routing groups of one micro-batch under cp: cp rank c's tokens."""
    b = np.arange(B_mb)[:, None] * S
    return [(b + row[None, :]).reshape(-1) for row in np.asarray(table)]


def _check_cp(comm, cp) -> None:
    if not isinstance(cp, (int, np.integer)) or cp < 1 or comm.size % cp:
        raise ValueError(
            f"context parallel: cp={cp!r} must divide the world size {comm.size} "
            f"(dp = world / cp); choose cp in {[c for c in range(1, comm.size + 1) if comm.size % c == 0]}"
        )


def cp_mesh(comm, cp: int) -> Mesh:
    _check_cp(comm, cp)
    return Mesh(comm, dp=comm.size // cp, cp=cp)


def cp_train(comm, cfg, seed, batches, steps, *, cp, method="ring", balance="zigzag",
             microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
             max_norm=None, recompute="none", bucket_cap_mb=25.0) -> CPRun:  # fmt: skip
    """Train `steps` steps on dp x cp = comm.size ranks; every rank returns the same figures."""
    check_method(method)
    _check_cp(comm, cp)
    layout = Layout(dp=comm.size // cp, cp=int(cp), cp_method=method, cp_balance=balance,
                    microbatches=microbatches, recompute=recompute, dtype=cfg.dtype,
                    bucket_cap_mb=bucket_cap_mb)  # fmt: skip
    mark = comm.ledger.mark()
    run = train(comm, layout, cfg, batches, steps, seed, lr=lr, betas=betas, eps=eps,
                weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    step_bytes = tag_bytes(comm.ledger.since(mark), steps,
                           {"fwd": "cp-attn/fwd", "bwd": "cp-attn/bwd", "grads": "dp/grads*"})  # fmt: skip
    if run.positions is None:  # cp = 1: one rank holds the whole (last) sequence
        S = check_inputs(*(batches(steps - 1) if callable(batches) else batches[steps - 1]),
                         cfg)[0].shape[1]  # fmt: skip
        run.positions = table(S, 1, balance)
    positions = run.positions
    return CPRun(run.losses, run.grad_norms, run.grads, run.params, step_bytes, run.act_bytes,
                 positions)  # fmt: skip
