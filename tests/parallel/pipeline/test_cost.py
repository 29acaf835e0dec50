"""Closed forms of a pipeline stage: W stash bytes (vs the ledger), peak activation bytes, bytes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.flops import activation_bytes_per_block
from emulator.memory import MemoryLedger
from emulator.model import ModelConfig, block_forward, block_params, init_params
from emulator.precision import compute_dtype
from parallel.pipeline.cost import (
    UnitBytes,
    boundary_bytes,
    peak_activation_bytes,
    peak_closed_form,
    stash_bytes_per_block,
)
from parallel.pipeline.schedules import interleaved, make_schedule
from parallel.pipeline.zero_bubble import block_backward_b


@pytest.mark.parametrize("dtype", ["float64", "float32", "mixed"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_stash_bytes_equal_what_the_ledger_charges(dtype, recompute):
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=1, d_ff=24,
                      dtype=dtype)  # fmt: skip
    bp = block_params(
        {n: x.astype(compute_dtype(dtype)) for n, x in init_params(cfg, 1).items()}, 0
    )
    b, S = 3, 5
    x = np.random.default_rng(0).normal(size=(b, S, 8)).astype(compute_dtype(dtype))
    mem = MemoryLedger()
    _, cache = block_forward(bp, x, cfg, recompute=recompute, mem=mem, name="blk")
    assert mem.nbytes("activations", "blk") == activation_bytes_per_block(cfg, b, S, recompute)
    block_backward_b(x, cache)  # any dy of the right shape and dtype
    assert mem.live("activations") == {"blk.w": stash_bytes_per_block(cfg, b, S)}
    if recompute == "none":  # the stash exceeds the cache by a b S (4 H - A S)
        a = compute_dtype(dtype).itemsize
        excess = stash_bytes_per_block(cfg, b, S) - activation_bytes_per_block(cfg, b, S)
        assert excess == a * b * S * (4 * 8 - 2 * S)


def test_no_stash_formula_for_moe():
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=1, n_experts=2)
    with pytest.raises(ValueError, match="no closed form for an MoE block's stash"):
        stash_bytes_per_block(cfg, 1, 4)


units = st.builds(
    lambda c, h, w, r: UnitBytes(c + h, h, w, r),
    st.integers(1, 50), st.integers(0, 20), st.integers(0, 80), st.integers(0, 60),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "zb-h1"]), p=st.integers(1, 6),
       m=st.integers(1, 12), data=st.data())  # fmt: skip
def test_closed_forms_equal_the_per_chunk_count(name, p, m, data):
    # any unit sizes per stage (a head freed first, a stash, a recompute rise)
    per = [data.draw(units) for _ in range(p)]
    if name == "zb-h1":
        per = [UnitBytes(x.cache, x.head, x.stash, 0) for x in per]  # no full recompute
    else:
        per = [UnitBytes(x.cache, x.head, 0, x.rise) for x in per]
    sched = make_schedule(name, p, m)
    unit = lambda s, c: per[s]
    if name == "zb-h1" and m < p:
        with pytest.raises(ValueError, match="needs m >= p"):
            peak_closed_form(sched, unit)
        return
    assert peak_activation_bytes(sched, unit) == peak_closed_form(sched, unit)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 5), k=st.integers(1, 3), v=st.integers(1, 3), c=st.integers(1, 40))
def test_interleaved_equal_chunks_peak_is_in_flight_times_one_chunk(p, k, v, c):
    sched = interleaved(p, p * k, v)
    got = peak_activation_bytes(sched, lambda s, ch: UnitBytes(c))
    assert got == [c * min(2 * (p - 1 - s) + (v - 1) * p + 1, p * k * v) for s in range(p)]
    with pytest.raises(ValueError, match="no closed-form peak for 'interleaved'"):
        peak_closed_form(sched, lambda s, ch: UnitBytes(c))


def test_interleaved_peak_counts_each_chunk_at_its_size():
    # p = 2, m = 2, v = 2, stage 0: F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1 (warm-up 2 + 2 = 4: all)
    sched = interleaved(2, 2, 2)
    sizes = {0: UnitBytes(10), 1: UnitBytes(3)}
    assert peak_activation_bytes(sched, lambda s, c: sizes[c])[0] == 2 * 10 + 2 * 3


def test_boundary_bytes():
    assert boundary_bytes(make_schedule("1f1b", 4, 8), 100) == [800, 1600, 1600, 800]
    assert boundary_bytes(interleaved(2, 4, 3), 10) == [200, 200]  # 2 m v - m each
    assert boundary_bytes(interleaved(1, 3, 3), 10) == [0]  # one rank: nothing crosses
