"""Context-parallel (x dp) training vs the single-rank reference: losses, every gradient and the
parameters after several steps, float64 ~1e-12; every rank's attention bytes per step equal
layers x micro-batches x cost.attention_bytes (twice the forward's under full recompute)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.flops import activation_bytes_per_block
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel.context import cost, layout
from parallel.context.train import cp_train, routing_groups

STEPS = 3


def cfg_for(moe=False, heads=4):
    kw = {"n_experts": 4, "moe_top_k": 2} if moe else {}
    return ModelConfig(vocab_size=16, d_model=8 * heads // 4 * 2, n_heads=heads, n_layers=2,
                       d_ff=16, max_seq_len=24, **kw)  # fmt: skip


def check_cp(world, C, method, balance, *, B=2, S=24, k=1, recompute="none", moe=False, heads=4):
    cfg = cfg_for(moe, heads)
    batches = lambda s: synthetic_batch(5, s, B, S, cfg.vocab_size)
    tab = layout.table(S, C, balance)
    groups_fn = (lambda step, mb, b, s: routing_groups(b, s, tab)) if moe else None
    ref = reference_train(cfg, 3, batches, STEPS, microbatches=world // C * k,
                          recompute=recompute, groups_fn=groups_fn)  # fmt: skip

    def fn(comm):
        return cp_train(comm, cfg, 3, batches, STEPS, cp=C, method=method, balance=balance,
                        microbatches=k, recompute=recompute)  # fmt: skip

    runs = emulator.spawn(fn, world, timeout=120)
    worst, problems = compare_run(runs[0], ref, 1e-12)
    assert not problems, "\n".join(problems)
    want = cost.attention_bytes(method, B // (world // C) // k, S, cfg.d_model, cfg.n_heads, C, 8)
    n = cfg.n_layers * k
    fwd = n * want["forward"] * (2 if recompute == "full" else 1)
    for r, run in enumerate(runs):
        assert run.losses == runs[0].losses  # every rank reports the same run
        b = B // (world // C) // k
        act = cost.block_activation_bytes(cfg, method, b, S, C, recompute=recompute,
                                          balance=balance, rank=r % C)  # fmt: skip
        if C == 1:  # one cp rank: parallel.train runs emulator's own attention, no cp cache
            act = activation_bytes_per_block(cfg, b, S, recompute)
        assert run.act_bytes and set(run.act_bytes.values()) == {act}, (r, run.act_bytes, act)
        for b in run.step_bytes:
            assert b["fwd"] == (fwd, fwd), (r, b, want)
            assert b["bwd"] == (n * want["backward"],) * 2, (r, b, want)
    return worst


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_cp_matches_reference(method, balance, C):
    heads = 6 if method == "ulysses" and C == 3 else 4
    check_cp(C, C, method, balance, heads=heads)


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_cp_recompute(method, recompute):
    check_cp(2, 2, method, "zigzag", recompute=recompute)


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_cp_times_dp_with_microbatches(method):
    check_cp(4, 2, method, "zigzag", B=4, k=2)


@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp_moe(method):
    """Routing groups = each cp rank's tokens, handed to the reference as the same groups."""
    check_cp(4, 2, method, "zigzag", B=4, moe=True)


@settings(max_examples=15)
@given(
    C=st.integers(1, 4),
    dp=st.integers(1, 2),
    method=st.sampled_from(["ring", "all-gather", "ulysses"]),
    balance=st.sampled_from(["contiguous", "zigzag"]),
    chunks=st.integers(1, 2),
    k=st.integers(1, 2),
    moe=st.booleans(),
)
def test_property(C, dp, method, balance, chunks, k, moe):
    """cp (x dp) over random degrees, sequence lengths, micro-batches and MoE."""
    if C * dp > 4:
        C = 4 // dp
    heads = 6 if method == "ulysses" and C == 3 else 4
    check_cp(C * dp, C, method, balance, B=dp * k, S=2 * C * chunks, k=k, moe=moe, heads=heads)


def test_errors():
    cfg = cfg_for()
    batches = lambda s: synthetic_batch(5, s, 2, 20, cfg.vocab_size)
    with pytest.raises(ValueError, match="cp=3 must divide the world size 4"):
        emulator.spawn(lambda c: cp_train(c, cfg, 3, batches, 1, cp=3), 4, timeout=30)
    with pytest.raises(ValueError, match="S=20 does not split into 8 equal 2 cp chunks"):
        emulator.spawn(lambda c: cp_train(c, cfg, 3, batches, 1, cp=4), 4, timeout=30)
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by cp=3"):
        b3 = lambda s: synthetic_batch(5, s, 2, 18, cfg.vocab_size)
        emulator.spawn(lambda c: cp_train(c, cfg, 3, b3, 1, cp=3, method="ulysses"), 3,
                       timeout=30)  # fmt: skip
    assert np.array_equal(routing_groups(2, 4, [[0, 3], [1, 2]])[1], [1, 2, 5, 6])


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_cp_lower_precision(method, dtype):
    """float32 / mixed vs the same-dtype reference by tensor parallelism's measured rule
    (parallel/check/tensor.py: cp, like tp, reorders sums inside the forward). Measured over 240
    random cp runs (cp 2/4, the 3 methods, both balancings, S 8/16, examples/08's model): worst
    float32 grad L2 8.7e-6, update L2 1.5e-5; mixed grad L2 0.034, loss 1.9e-4, update L2
    0.048, per tensor 0.25, noise-level 1.85 - all inside TP's bounds. Bytes: K/V and Ulysses'
    buffers in the stored dtype (x = 2 in mixed), dK/dV accumulators in the arithmetic one (4)."""
    from emulator.precision import arith_dtype, compute_dtype
    from parallel.check.tensor import compare_tp

    cfg = ModelConfig(vocab_size=32, d_model=32, n_heads=8, n_layers=2, d_ff=64, max_seq_len=16,
                      dtype=dtype)  # fmt: skip
    batches = lambda s: synthetic_batch(9, s, 2, 16, 32)
    ref = reference_train(cfg, 4, batches, STEPS)
    runs = emulator.spawn(lambda c: cp_train(c, cfg, 4, batches, STEPS, cp=4, method=method), 4,
                          timeout=120)  # fmt: skip
    _, problems, _ = compare_tp(runs[0], ref, dtype)
    assert not problems, "\n".join(problems)
    x = compute_dtype(dtype)
    want = cost.attention_bytes(method, 2, 16, 32, 8, 4, x.itemsize, arith_dtype(x).itemsize)
    for run in runs:
        assert run.step_bytes[-1]["fwd"] == (2 * want["forward"],) * 2
        assert run.step_bytes[-1]["bwd"] == (2 * want["backward"],) * 2
