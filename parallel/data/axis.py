"""The data-parallel axis of any layout: DDP or ZeRO-1/2/3 on this rank's LOCAL parameters (the
TP shards of its pipeline stage), acting through the executor's layer hooks.

The executor (parallel/pipeline/executor.py) runs every layer as
    pre_forward -> forward -> post_forward ... pre_backward -> backward -> post_backward
and this class answers those calls (docs/CONTRACTS.md, "driver"):
  zero 0 (DDP)  every rank holds the local compute parameters; gradients are summed over the
                micro-batches locally (the reference's order) and handed to DDP's buckets once,
                at the end of the step (tag dp/grads/bucket<i>@step), then AdamW; dp = 1: AdamW
  zero 1        the same local sum, then ZeroOptimizer.step: reduce-scatter, AdamW on the
                owned slice, all-gather (parallel/data/zero.py)
  zero 2        one FSDP-style unit per layer (embed, each block, head: `layer_units`); a
                layer's gradients go to ZeroOptimizer.grad_ready as its backward produces them,
                so each unit is reduce-scattered once per micro-batch and never held whole
  zero 3        + the unit is all-gathered before the layer's forward and again before its
                backward, freed after each (reshard_after_forward; False keeps it from the
                forward to the backward), the next layer of the action prefetched if asked
One unit per layer (not FSDP's root unit of embed + head) because under a pipeline, and
interleaved chunks, the embedding and the head are on different stages or chunks: a unit must
complete its gradients within one layer's backward. `start(kind, mb, layers)` tells the hooks the
current action's layers, so prefetch gathers the next layer of the same action.
"""

from __future__ import annotations

import contextlib

from emulator.model import to_compute
from emulator.optim import AdamW
from emulator.precision import compute_dtype
from parallel.clip import clip_and_step
from parallel.data.common import backward_order
from parallel.data.ddp import DDP
from parallel.data.zero import ZeroOptimizer
from parallel.pipeline.executor import Accumulate


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: "embed", "blocks.<i>" or "head"."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    return "embed" if name.startswith("embed.") else "head"


def layer_units(names) -> list[list[str]]:
    """One unit per layer present in ``names`` (parameter order), in forward order."""
    units: dict[str, list] = {}
    for n in names:
        units.setdefault(layer_of(n), []).append(n)
    order = sorted(units, key=lambda k: (k != "embed", k == "head", int(k.split(".")[1])
                                         if k.startswith("blocks.") else 0))  # fmt: skip
    return [units[k] for k in order]


class DataAxis(Accumulate):
    def __init__(self, dp, master: dict, zero: int, cfg, *, hyper: dict, max_norm=None,
                 norm_groups=(), norm_weights=None, bucket_cap_mb=25.0,
                 reshard_after_forward=True, prefetch=False, partial=None,
                 mem=None):  # fmt: skip
        super().__init__(None)
        self.dp, self.master, self.zero, self.cfg, self.mem = dp, master, zero, cfg, mem
        self.max_norm, self.norm_groups, self.weights = max_norm, tuple(norm_groups), norm_weights
        self.reshard, self.prefetch, self.partial = reshard_after_forward, prefetch, partial
        self.D, self.statics, self.ddp, self.opt, self.engine = dp.size, [], None, None, None
        self.order: list = []
        self.last_grads: dict = {}  # no step yet: no gradient
        if zero == 0:
            self.opt = AdamW(master, **hyper)
            if self.D > 1:
                self.ddp = DDP(dp, master, bucket_cap_mb=bucket_cap_mb, dtype=cfg.dtype, mem=mem)
            n, c = sum(p.size for p in master.values()), compute_dtype(cfg.dtype).itemsize
            self.statics = [("params", "master", sum(p.nbytes for p in master.values())),
                            ("optimizer", "adamw", self.opt.nbytes())]  # fmt: skip
            if cfg.dtype == "mixed":  # the compute copy: Psi c
                self.statics.append(("params", "compute_copy", n * c))
            if self.ddp is None:  # dp = 1: the local gradient buffer
                self.statics.append(("grads", "grads", n * c))
            for cat, name, nbytes in self.statics:
                if mem is not None:
                    mem.alloc(cat, name, nbytes)
        else:
            units = layer_units(master) if zero >= 2 else None
            self.engine = ZeroOptimizer(dp, master, zero, dtype=cfg.dtype, max_norm=max_norm,
                                        norm_groups=norm_groups, norm_weights=norm_weights,
                                        bucket_cap_mb=bucket_cap_mb, units=units, mem=mem,
                                        **hyper)  # fmt: skip
            self.unit = {layer_of(lay.names[0]): lay.index for lay in self.engine.layouts}
        self.layouts = self.ddp.layouts if self.ddp else self.engine.layouts if self.engine else []

    # ---- one step -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.grads = {}
        if self.zero == 0:
            self.params = to_compute(self.master, self.cfg)
        elif self.zero < 3:
            self.params = self.engine.params

    def finish_step(self) -> float:
        """Sync, clip and update -> the global gradient norm before clipping."""
        if self.zero >= 2:
            return self.engine.step()
        grads = {n: self.grads[n] for n in self.master}  # parameter order
        if self.zero == 1:
            return self.engine.step(grads)
        if self.ddp is not None:
            for n in backward_order(grads, self.ddp.position):
                self.ddp.grad_ready(n, grads[n], where="step")
            grads = {n: g.copy() for n, g in self.ddp.finish().items()}
            self.ddp.zero_grad()
        self.last_grads = grads
        # summed (replicated) over dp after DDP: the norm reduces over the other axes only
        return clip_and_step(self.opt, self.master, grads, self.norm_groups, max_norm=self.max_norm,
                             weights=self.weights, tag="dp/clip")  # fmt: skip

    # ---- the executor's hooks --------------------------------------------------------------
    def start(self, kind: str, mb: int, layers: list) -> None:
        self.order, self.mb = list(layers), mb

    def _gather(self, layer: str, tag: str) -> dict:
        params = self.engine.gather(self.unit[layer], f"{tag}:{layer}")
        k = self.order.index(layer) + 1
        if self.prefetch and k < len(self.order):  # the next layer's unit, before computing
            self.engine.gather(self.unit[self.order[k]], f"prefetch@{tag}:{layer}")
        return params

    def pre_forward(self, layer: str) -> dict:
        return self._gather(layer, "fwd") if self.zero == 3 else self.params

    def post_forward(self, layer: str) -> None:
        if self.zero == 3 and self.reshard:
            self.engine.free(self.unit[layer])

    def pre_backward(self, layer: str) -> dict:
        return self._gather(layer, "bwd") if self.zero == 3 else self.params

    def post_backward(self, layer: str, grads: dict) -> None:
        if self.partial is not None:  # SP: sum the tp-partial gradients of this layer first
            grads = self.partial(layer, self.mb, grads)
        if self.zero < 2:
            return super().post_backward(layer, grads)
        for name in backward_order(grads, self.engine.position):
            self.engine.grad_ready(name, grads[name], f"bwd:{layer}")
        if self.zero == 3:
            self.engine.free(self.unit[layer])

    def result(self) -> None:
        return None

    # ---- state for the check (uncounted) -------------------------------------------------
    def local_state(self) -> tuple[dict, dict]:
        """(master params, the last step's summed gradient before clipping): this rank's local
        arrays (gathered over dp under ZeRO, uncounted)."""
        if self.engine is not None:
            grads = self.engine.full_grads() if self.engine.step_count else {}
            return self.engine.master_params(), grads
        return {n: p.copy() for n, p in self.master.items()}, self.last_grads

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.ddp is not None:
            self.ddp.close()
        for cat, name, _ in self.statics if self.mem is not None else ():
            with contextlib.suppress(KeyError):
                self.mem.free(cat, name)
        self.statics = []
