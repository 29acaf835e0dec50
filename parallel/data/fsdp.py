"""FSDP: the ZeRO-3 unit lifecycle as hooks on the model driver (parallel/pipeline/executor.py).

Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB:
a unit (one transformer block, plus a root unit for the embeddings, final norm and head) is
all-gathered just before its first layer's forward and freed after its last (section 3.2.2,
`reshard_after_forward=True`), all-gathered again just before its backward and freed after it,
its gradient reduce-scattered as soon as the unit's backward is complete (ZeroOptimizer).
`reshard_after_forward=False` keeps the gathered unit from the forward to its backward: one
all-gather per micro-batch instead of two (2 Psi; the variant Llama 3 uses, section 3.3.2).
`prefetch=True` issues the next unit's gather before the current unit computes (forward and
backward prefetch, section 3.3.3); the ledger's order of records shows it, tagged "prefetch@...".

The root unit serves two layers in the forward (embed first, head last), so it stays gathered
through the whole forward and the whole backward; it is resharded between the two like every
other unit, so the volume is exactly 3 Psi (PyTorch skips that reshard for the root).
"""

from __future__ import annotations

from parallel.data.common import Hooks, backward_order, layers


class FSDPHooks(Hooks):
    def __init__(self, opt, cfg, *, reshard_after_forward=True, prefetch=False):
        self.opt, self.reshard, self.prefetch = opt, reshard_after_forward, prefetch
        self.fwd = layers(cfg)
        self.bwd = self.fwd[::-1]
        owner = {n: lay.index for lay in opt.layouts for n in lay.names}
        self.unit = {
            "embed": owner["embed.tok"],
            "head": owner["head.w"],
            **{f"blocks.{i}": owner[f"blocks.{i}.ln1.gain"] for i in range(cfg.n_layers)},
        }
        # the last layer of each pass that uses a unit: where that unit is freed
        self.fwd_last = {self.unit[x]: x for x in self.fwd}
        self.bwd_last = {self.unit[x]: x for x in self.bwd}

    def _get(self, layer: str, order: list, tag: str) -> dict:
        params = self.opt.gather(self.unit[layer], f"{tag}:{layer}")
        k = order.index(layer) + 1
        if self.prefetch and k < len(order):  # issue the next unit's gather before computing
            self.opt.gather(self.unit[order[k]], f"prefetch@{tag}:{layer}")
        return params

    def pre_forward(self, layer: str) -> dict:
        return self._get(layer, self.fwd, "fwd")

    def post_forward(self, layer: str) -> None:
        u = self.unit[layer]
        if self.reshard and self.fwd_last[u] == layer:
            self.opt.free(u)

    def pre_backward(self, layer: str) -> dict:
        return self._get(layer, self.bwd, "bwd")

    def post_backward(self, layer: str, grads: dict) -> None:
        for name in backward_order(grads, self.opt.position):
            self.opt.grad_ready(name, grads[name], f"bwd:{layer}")
        u = self.unit[layer]
        if self.bwd_last[u] == layer:
            self.opt.free(u)


class ReplicatedHooks(Hooks):
    """DDP / ZeRO-1 / ZeRO-2: every rank holds the full compute parameters; gradients go to
    `sink.grad_ready` (a DDP or a ZeroOptimizer) as the backward produces them."""

    sync_at = None  # DDP: the micro-batch whose backward all-reduces (the others: no_sync)

    def __init__(self, params: dict, sink):
        self.params, self.sink = params, sink

    def start(self, kind: str, mb: int, layers: list) -> None:
        if self.sync_at is not None:
            self.sink.sync = mb == self.sync_at

    def pre_forward(self, layer: str) -> dict:
        return self.params

    def post_backward(self, layer: str, grads: dict) -> None:
        for name in backward_order(grads, self.sink.position):
            self.sink.grad_ready(name, grads[name], f"bwd:{layer}")
