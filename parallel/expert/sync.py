"""Which gradient of an ep x dp run is summed over which group: expert tensors or replicated.

Replicated parameters (embeddings, attention, LayerNorms, the router, the head) were computed on
every rank from its own tokens: summed over all D data-parallel ranks. Expert parameters are
already complete over the ep group's tokens (the all-to-alls brought every token copy to its
expert), so they are summed only over the D / ep ranks holding the same experts - the
"expert-data-parallel" group of Megatron-core and DeepSpeed-MoE. parallel/expert/nd.py's ep_axis
runs one DDP or ZeroOptimizer per group (tags dp/grads*, edp/dp/grads*) and asks ``is_expert``.
"""

from __future__ import annotations

import functools

from parallel.expert.layer import EXPERT_NAMES


@functools.cache  # asked ~570 times per rank and run (ep4 at the small size) of ~60 names
def is_expert(name: str) -> bool:
    """blocks.<i>.moe.{w1, b1, w2, b2}: cut over ep (axis 0 = the expert); the router is not."""
    return ".moe." in name and name.rsplit(".", 1)[1] in EXPERT_NAMES
