"""A user's own layouts, tested with the public kit only (docs/testing.md walks through it).

    python -m pytest -q examples/testing

1. A hand-made 2-way tensor split of the MLP (column-split w1, row-split w2, one all-reduce),
   checked against the single-rank MLP on drawn shapes, with its bytes by formula.
2. A custom pipeline schedule as data (GPipe with the backwards in reverse order), trained
   with the project's executor and checked against the single-rank reference on every rank.
Each ends with the bug it exists for, planted, and shown failing with its message.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import all_reduce
from emulator import scope
from emulator.model import ModelConfig
from emulator.ops import gelu_forward, linear_forward
from parallel.pipeline.schedules import Action, Schedule
from parallel.pipeline.train import pipeline_train
from parallel.testing import assert_bytes, check_layout, on_virtual_ranks


# ---- 1. my tensor-parallel MLP -------------------------------------------------------------
def my_mlp(comm, m, w1, b1, w2, b2, bias_once=True):
    """m (B, S, H); this rank holds columns of w1 / b1 and rows of w2: Megatron's MLP."""
    h, _ = gelu_forward(linear_forward(m, w1, b1)[0])  # (B, S, F / 2): no communication
    y, _ = linear_forward(h, w2, b2 if (comm.rank == 0 or not bias_once) else None)
    with scope("my_mlp"):
        return all_reduce(comm, y, algorithm="ring")  # sum the partial outputs


def check_my_mlp(B, S, H, F, bias_once=True):
    rng = np.random.default_rng(0)
    m, w1, b1 = rng.normal(size=(B, S, H)), rng.normal(size=(H, F)), rng.normal(size=F)
    w2, b2 = rng.normal(size=(F, H)), rng.normal(size=H)
    want = linear_forward(gelu_forward(linear_forward(m, w1, b1)[0])[0], w2, b2)[0]

    @on_virtual_ranks(2)
    def body(comm):
        cols = np.array_split(np.arange(F), 2)[comm.rank]  # this rank's share of F
        y = my_mlp(comm, m, w1[:, cols], b1[cols], w2[cols], b2, bias_once)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        assert_bytes(comm.ledger, {"my_mlp": B * S * H * 8})  # ring, p = 2: 2 (p-1)/p x 8 bytes

    body()


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([2, 4]), st.integers(2, 9))
def test_my_mlp_matches_the_single_rank_mlp(B, S, H, F):
    check_my_mlp(B, S, H, F)


def test_my_mlp_with_the_bias_added_on_both_ranks_fails():
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_my_mlp(2, 3, 4, 6, bias_once=False)


# ---- 2. my pipeline schedule ---------------------------------------------------------------
def reversed_gpipe(p, m):
    """All forwards, then the backwards newest first (any order a stage can run is data)."""
    acts = [Action("F", j) for j in range(m)] + [Action("B", j) for j in reversed(range(m))]
    return Schedule("reversed-gpipe", p, m, 1, False, [list(acts) for _ in range(p)])


CFG = ModelConfig(vocab_size=16, max_seq_len=6, d_model=8, n_heads=2, n_layers=2)


def test_my_schedule_trains_exactly_as_the_reference():
    train = lambda comm, cfg, seed, batches, steps, **optim: pipeline_train(
        comm, cfg, seed, batches, steps, schedule=reversed_gpipe(2, 4), **optim
    )
    check_layout(train, CFG, world_size=2, batch=8, ref_microbatches=4, steps=2, weight_decay=0.1)


def test_a_schedule_that_drops_the_weight_decay_fails():
    train = lambda comm, cfg, seed, batches, steps, weight_decay=0.0, **optim: pipeline_train(
        comm, cfg, seed, batches, steps, schedule=reversed_gpipe(2, 4), **optim
    )  # the planted bug: weight_decay never reaches the optimizer
    with pytest.raises(
        AssertionError, match=r"rank 0: run differs from the reference:\n  losses differ"
    ):
        check_layout(train, CFG, world_size=2, batch=8, ref_microbatches=4, weight_decay=0.1)
