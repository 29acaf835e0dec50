"""What DDP and ZeRO share: the loss normalisation and the hook interface the model driver
(parallel/pipeline/executor.py) calls, so a layout can act exactly when the backward produces a
gradient.
(Clipping by the global norm, for every layout: parallel/clip.py.)

Shape letters: B batch (this rank's micro-batch), S sequence, H d_model.

Normalisation (docs/CONTRACTS.md): each dp rank computes the gradient of its share of the global
loss - CE divided by the global token count of the step, aux weighted by its share of the step's
routing groups - so gradients are SUMMED over dp and equal the reference's exactly.
"""

from __future__ import annotations

import numpy as np


def loss_scales(global_tokens: int, my_groups: int, all_groups: int) -> tuple[int, float]:
    """(ce_denom, aux_scale) of one micro-batch on one dp rank (see the module docstring)."""
    if global_tokens < 1 or not 0 < my_groups <= all_groups:
        raise ValueError(
            f"loss_scales: need global_tokens >= 1 and 0 < my_groups <= all_groups, got "
            f"{global_tokens}, {my_groups}, {all_groups}"
        )
    return int(global_tokens), my_groups / all_groups


def rebind(obj, table: dict):
    """A copy of a cache with every array whose id is in `table` replaced by table[id].

    FSDP frees a unit's gathered parameters after its forward and gathers them again for its
    backward; rebinding the saved caches to the re-gathered arrays makes the backward provably
    run on the second gather, not on memory the ledger says was freed.
    """
    if isinstance(obj, np.ndarray):
        return table.get(id(obj), obj)
    if isinstance(obj, dict):
        return {k: rebind(v, table) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(rebind(v, table) for v in obj)
    return obj


def backward_order(grads, position: dict) -> list:
    """Gradient names in the order a backward produces them: reverse parameter order
    (position: {name: index in the parameter dict}), the order DDP / ZeRO buckets are built in
    (flat.make_buckets), whatever order a layer's backward returned its dict in. Then a bucket
    is complete before the next one's first gradient arrives (one transient bucket at a time)."""
    return sorted(grads, key=position.__getitem__, reverse=True)


class Hooks:
    """The layout's say in a step, called by the model driver (parallel/pipeline/executor.py,
    docs/CONTRACTS.md "driver contract"). Layers: "embed",
    "blocks.i", "head" (forward order)."""

    def start(self, kind: str, mb: int, layers: list) -> None:  # each F / B / W action
        pass

    def result(self):  # what run_schedule returns as its gradients
        return None

    def pre_forward(self, layer: str) -> dict:  # full-name params the layer computes with
        raise NotImplementedError

    def post_forward(self, layer: str) -> None:
        pass

    def pre_backward(self, layer: str) -> dict:
        return self.pre_forward(layer)

    def post_backward(self, layer: str, grads: dict) -> None:
        raise NotImplementedError


def layers(cfg) -> list[str]:
    return ["embed", *(f"blocks.{i}" for i in range(cfg.n_layers)), "head"]
