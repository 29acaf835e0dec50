"""The data-parallel half of a dp x tp mesh: gradient sync and the optimizer step of a TP shard.

Each tp group is one model replica; the dp axis copies it (Narayanan et al. 2021, section 2.3).
A rank's TP shard is just "a rank-local dict of named parameters" to parallel/data/ddp.py and
parallel/data/zero.py (docs/CONTRACTS.md), which are used unchanged on mesh["dp"]:
  none   pure TP: local AdamW; the clip norm (parallel/clip.py) sums the squares over tp,
         weighting the gradients replicated over tp by 1/t so that each counts once
  ddp    DDP buckets summed over dp per step (no_sync for the first k-1 micro-batches)
  1      ZeRO-1 over dp: reduce-scatter, AdamW on the owned slice, all-gather; the norm also
         sums over tp, with weight 1/t on the parameters replicated over tp
Order matters: tp reductions (the SP partial gradients) happen before the optimizer step, dp
ones inside it; sums commute, so the result is the reference's summed gradient either way.
"""

from __future__ import annotations

import contextlib

from emulator.data import shard_batch
from emulator.optim import AdamW
from emulator.precision import down, up
from parallel.clip import global_grad_norm, scale_
from parallel.data.ddp import DDP
from parallel.data.zero import ZeroOptimizer

DP_STAGES = (None, "ddp", "1")


class DataParallelSync:
    def __init__(self, mesh, params, plan, cfg, stage, *, max_norm=None, **hyper):
        stage = None if stage in (None, "none") else str(stage)
        if stage not in DP_STAGES:
            raise ValueError(f"dp stage {stage!r}: tensor parallelism composes with {DP_STAGES}")
        self.D = mesh.size("dp") if "dp" in mesh.names else 1
        if self.D > 1 and stage is None:
            stage = "ddp"
        self.stage, self.tp, self.cfg, self.max_norm = stage, mesh["tp"], cfg, max_norm
        self.dp = mesh["dp"] if "dp" in mesh.names else None
        self.rank = mesh.coord("dp") if self.dp is not None else 0
        self.params, mem = params, mesh.comm.memory
        # a gradient replicated over tp (LayerNorms, row-parallel biases) counts once in the norm
        self.weights = {n: 1.0 / self.tp.size for n in params if not plan[n].sharded}
        if stage == "1":
            self.engine = ZeroOptimizer(self.dp, params, 1, dtype=cfg.dtype, max_norm=max_norm,
                                        norm_groups=[self.tp], norm_weights=self.weights,
                                        mem=mem, **hyper)  # fmt: skip
        else:
            self.opt = AdamW(params, **hyper)
            self.engine = DDP(self.dp, params, dtype=cfg.dtype, mem=mem) if stage == "ddp" else None
        self.acc = None

    def shard_batch(self, tokens, targets):
        return shard_batch(tokens, targets, self.rank, self.D) if self.D > 1 else (tokens, targets)

    def compute_params(self, to_compute):
        return self.engine.params if self.stage == "1" else to_compute(self.params, self.cfg)

    def feed(self, grads: dict, last: bool) -> None:
        """One micro-batch's local gradients (DDP: bucket by bucket, in backward order)."""
        if self.stage == "ddp":
            with contextlib.nullcontext() if last else self.engine.no_sync():
                for n in reversed(list(grads)):
                    self.engine.grad_ready(n, grads[n], where="step")
        elif self.acc is None:
            self.acc = grads
        else:
            self.acc = {n: down(up(a) + up(grads[n]), a.dtype) for n, a in self.acc.items()}

    def gradients(self) -> dict:
        """The step's gradient: summed over dp (DDP) or this rank's local sum (none, ZeRO-1)."""
        if self.stage == "ddp":
            return {n: g.copy() for n, g in self.engine.finish().items()}
        acc, self.acc = self.acc, None
        return acc

    def total_loss(self, shares: list) -> float:
        """The global loss, summed in the reference's micro-batch order (uncounted)."""
        if self.dp is None:
            return sum(shares, 0.0)
        return sum((s for every in self.dp.allgather_object(shares) for s in every), 0.0)

    def step(self, grads: dict) -> float:
        """Clip and update -> the global norm before clipping (parallel/clip.py: TP shards summed
        over tp, the replicated gradients weighted 1/t so they count once). ``grads`` is left
        as it is (tp_train returns it as the unclipped gradient): a clipped copy is stepped."""
        if self.stage == "1":
            return self.engine.step(grads)
        norm, coef = global_grad_norm(grads, (self.tp,), max_norm=self.max_norm,
                                      weights=self.weights, tag="clip")  # fmt: skip
        step_grads = grads if coef >= 1.0 else {n: g.copy() for n, g in grads.items()}
        scale_(step_grads, coef)
        self.opt.step(self.params, step_grads)
        if self.stage == "ddp":
            self.engine.zero_grad()
        return norm

    def close(self) -> None:
        """Free the DDP / ZeRO-1 engine's memory-ledger entries (idempotent)."""
        if self.engine is not None:
            self.engine.close()

    def full_state(self) -> tuple[dict, dict]:
        """(master params, last summed grads), this rank's TP shards (gathered over dp if ZeRO)."""
        if self.stage == "1":
            return self.engine.master_params(), self.engine.full_grads()
        return self.params, None
