"""Gradient synchronisation of an ep x dp run: which group sums which gradient, and how.

Replicated parameters (embeddings, attention, LayerNorms, the router, the head) were computed on
every rank from its own tokens: summed over all D data-parallel ranks. Expert parameters are
already complete over the ep group's tokens (the all-to-alls brought every token copy to its
expert), so they are summed only over the D / ep ranks holding the same experts - the
"expert-data-parallel" group of Megatron-core and DeepSpeed-MoE. Two ways, same numbers:

  "allreduce"  accumulate the micro-batches locally, then one ring all-reduce per tensor at the
               end of the step (tags dp/grads, edp/grads)
  "ddp"        two parallel/data/ddp.py engines - one over the world for the replicated
               tensors, one over edp for the experts (tags dp/grads/bucket*, edp/dp/grads/bucket*)
               - fed layer by layer as the backward produces gradients, with no_sync() for the
               first k-1 micro-batches: PyTorch DDP's buckets and overlap, per group
"""

from __future__ import annotations

import contextlib

from collectives.api import all_reduce
from emulator import scope
from emulator.precision import down, up
from parallel.data.common import backward_order
from parallel.data.ddp import DDP
from parallel.expert.layer import EXPERT_NAMES

MODES = ("allreduce", "ddp")


def is_expert(name: str) -> bool:
    return ".moe." in name and name.rsplit(".", 1)[1] in EXPERT_NAMES


class AllReduceSync:
    def __init__(self, world, edp, params):
        self.world, self.edp, self.acc = world, edp, None
        self.names = list(params)

    @contextlib.contextmanager
    def no_sync(self):
        yield

    def grad_ready(self, layer: str, grads: dict) -> None:
        if self.acc is None:
            self.acc = {}
        for n, g in grads.items():
            a = self.acc.get(n)
            self.acc[n] = g if a is None else down(up(a) + up(g), a.dtype)

    def finish(self) -> dict:
        for n, g in self.acc.items():
            group, tag = (self.edp, "edp/grads") if is_expert(n) else (self.world, "dp/grads")
            if group.size > 1:
                with scope(tag):
                    self.acc[n] = all_reduce(group, g, op="sum", algorithm="ring")
        return {n: self.acc[n] for n in self.names}

    def zero_grad(self) -> None:
        self.acc = None

    def close(self) -> None:
        pass


class DDPSync:
    def __init__(self, world, edp, params, *, bucket_cap_mb, dtype, mem):
        self.names = list(params)
        self.position = {n: i for i, n in enumerate(params)}
        dense = {n: p for n, p in params.items() if not is_expert(n)}
        experts = {n: p for n, p in params.items() if is_expert(n)}
        kw = {"bucket_cap_mb": bucket_cap_mb, "dtype": dtype, "mem": mem}
        self.dense = DDP(world, dense, **kw)
        self.experts = DDP(edp, experts, **{**kw, "mem": None})  # its buckets, renamed:
        self.mem, itemsize = mem, self.experts.dtype.itemsize
        for b in self.experts.layouts if mem is not None else ():
            mem.alloc("grads", f"edp.ddp.bucket{b.index}", b.padded * itemsize)

    @contextlib.contextmanager
    def no_sync(self):
        with self.dense.no_sync(), self.experts.no_sync():
            yield

    def grad_ready(self, layer: str, grads: dict) -> None:
        for n in backward_order(grads, self.position):  # DDP's bucket order
            if is_expert(n):
                with scope("edp"):
                    self.experts.grad_ready(n, grads[n], where=f"bwd:{layer}")
            else:
                self.dense.grad_ready(n, grads[n], where=f"bwd:{layer}")

    def finish(self) -> dict:
        out = {**self.dense.finish(), **self.experts.finish()}
        return {n: out[n].copy() for n in self.names}

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.experts.zero_grad()

    def close(self) -> None:
        self.dense.close()
        for b in self.experts.layouts if self.mem is not None else ():
            self.mem.free("grads", f"edp.ddp.bucket{b.index}")
        self.mem = None


def make_sync(mode: str, world, edp, params, *, bucket_cap_mb=25.0, dtype="float64", mem=None):
    if mode not in MODES:
        raise ValueError(f"grad_sync={mode!r} must be one of {MODES}")
    if mode == "allreduce":
        return AllReduceSync(world, edp, params)
    return DDPSync(world, edp, params, bucket_cap_mb=bucket_cap_mb, dtype=dtype, mem=mem)
