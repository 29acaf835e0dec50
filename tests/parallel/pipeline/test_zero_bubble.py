"""The B/W split of a block's backward equals block_backward bitwise (dense and MoE)."""

from __future__ import annotations

import numpy as np
import pytest

from emulator.memory import MemoryLedger
from emulator.model import ModelConfig, block_backward, block_forward, block_params, init_params
from parallel.pipeline.zero_bubble import block_backward_b, block_backward_w


@pytest.mark.parametrize("experts", [0, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_b_then_w_is_block_backward_bitwise(experts, recompute):
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=1,
                      n_experts=experts, moe_top_k=min(2, max(experts, 1)))  # fmt: skip
    bp = block_params(init_params(cfg, 3), 0)
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(2, 6, 8)), rng.normal(size=(2, 6, 8))
    _, c1 = block_forward(bp, x, cfg, recompute=recompute)
    want_dx, want = block_backward(dy, c1, daux=0.25)
    mem = MemoryLedger()
    _, c2 = block_forward(bp, x, cfg, recompute=recompute, mem=mem, name="blk")
    dx, stash = block_backward_b(dy, c2, daux=0.25)
    assert set(mem.live("activations")) == {"blk.w"}  # B freed the cache, kept the W stash
    got = block_backward_w(stash)
    assert mem.current("activations") == 0
    assert np.array_equal(dx, want_dx)
    assert list(got) == list(want)
    for n in want:
        assert np.array_equal(got[n], want[n]), n


def test_full_recompute_is_refused():
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=1)
    bp = block_params(init_params(cfg, 3), 0)
    _, c = block_forward(bp, np.zeros((1, 4, 8)), cfg, recompute="full")
    with pytest.raises(ValueError, match="B/W split needs the block's cache"):
        block_backward_b(np.zeros((1, 4, 8)), c)
