"""Tensor parallelism vs the single-rank reference: losses, every gradient, parameters after
several steps, bytes per layer and activation bytes against their formulas (parallel/tp_cost.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import tp_cost
from parallel.tensor import check_tp, f_backward, f_forward, g_backward, g_forward
from parallel.tp_train import tp_train

STEPS = 3


def run(cfg, t, B, S, *, sp=False, regather=True, microbatches=1, max_norm=None, recompute="none"):
    """tp_train on t virtual ranks beside reference_train; -> (runs, ref, ledger figures)."""
    batches = lambda s: synthetic_batch(7, s, B, S, cfg.vocab_size)
    kw = {"microbatches": microbatches, "max_norm": max_norm, "recompute": recompute}
    ref = reference_train(cfg, 3, batches, STEPS, **kw)

    def fn(comm):
        r = tp_train(comm, cfg, 3, batches, STEPS, sequence_parallel=sp, regather=regather, **kw)
        L = comm.ledger
        layer = [L.select(tag=f"blocks.{i}/*", step=STEPS - 1) for i in range(cfg.n_layers)]
        r.layer_bytes = [(L.sent(x), L.received(x)) for x in layer]
        r.tag_bytes = {
            tag: L.sent(L.select(tag=tag, step=STEPS - 1))
            for tag in ("embed/*", "head/*", "sp/grads", "clip")
        }
        r.total = L.sent(L.select(step=STEPS - 1))
        r.rank = comm.rank
        return r

    return emulator.spawn(fn, t, timeout=30), ref


def assert_matches(runs, ref, rtol):
    worst, problems = compare_run(runs[0], ref, rtol)
    assert not problems, "\n".join(problems)
    return worst


@settings(max_examples=6, deadline=None)
@given(
    t=st.sampled_from([1, 2, 4]),
    heads_per_rank=st.integers(1, 2),
    head_dim=st.integers(1, 3),
    ff_per_rank=st.integers(1, 5),
    vocab_per_rank=st.integers(1, 6),
    S=st.integers(1, 6),
    B=st.integers(1, 3),
    layers=st.integers(1, 2),
)
def test_tp_training_equals_reference(t, heads_per_rank, head_dim, ff_per_rank, vocab_per_rank, S, B, layers):  # fmt: skip
    A = heads_per_rank * t
    cfg = ModelConfig(vocab_size=vocab_per_rank * t, max_seq_len=8, d_model=A * head_dim,
                      n_heads=A, n_layers=layers, d_ff=ff_per_rank * t)  # fmt: skip
    runs, ref = run(cfg, t, B, S)
    assert_matches(runs, ref, 1e-12)
    for r in runs:  # four all-reduces of (B, S, H) per layer, exactly; the rest by its formula
        want = tp_cost.layer_bytes(cfg, B, S, t)
        assert want == 8 * (t - 1) * B * S * cfg.d_model * 8 // t
        assert r.layer_bytes == [(want, want)] * layers
        rows = tp_cost.step_bytes(cfg, B, S, t, rank=r.rank)
        assert r.tag_bytes["embed/*"] == rows["embed"] and r.tag_bytes["head/*"] == rows["head"]
        assert r.total == rows["total"]


def test_tp_with_microbatches_clipping_and_memory_formula():
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=16, n_heads=4, n_layers=2)
    B, S, t, M = 4, 6, 4, 2
    runs, ref = run(cfg, t, B, S, microbatches=M, max_norm=0.3)
    assert_matches(runs, ref, 1e-12)
    assert np.allclose(runs[0].grad_norms, ref.grad_norms, rtol=1e-12, atol=0)
    act = tp_cost.block_activation_bytes(cfg, B // M, S, t)
    for r in runs:
        assert r.act_bytes == {f"mb{M - 1}.blocks.{i}": act for i in range(2)}
        assert r.total == tp_cost.step_bytes(cfg, B, S, t, microbatches=M, rank=r.rank)["total"]
    # at t = 1 the formula is the single-rank model's (emulator/flops.py)
    from emulator.flops import activation_bytes_per_block

    assert tp_cost.block_activation_bytes(cfg, 2, S, 1) == activation_bytes_per_block(cfg, 2, S)


def test_selective_recompute_drops_only_the_probabilities():
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=1)
    runs, ref = run(cfg, 2, 2, 4, recompute="selective")
    assert_matches(runs, ref, 1e-12)
    want = tp_cost.block_activation_bytes(cfg, 2, 4, 2, recompute="selective")
    assert runs[0].act_bytes == {"mb0.blocks.0": want}


def test_moe_experts_split_like_the_dense_mlp():
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=2,
                      n_experts=3, moe_top_k=2, d_ff=12)  # fmt: skip
    B, S, t = 2, 4, 2
    runs, ref = run(cfg, t, B, S)
    assert_matches(runs, ref, 1e-12)
    for r in runs:  # + the all-reduce of the gate gradients, by its own formula
        want = tp_cost.layer_bytes(cfg, B, S, t, rank=r.rank)
        assert r.layer_bytes == [(want, want)] * 2
        assert r.act_bytes["mb0.blocks.0"] == tp_cost.block_activation_bytes(cfg, B, S, t)


@pytest.mark.parametrize("dtype,rtol", [("float32", 2e-5), ("mixed", 0.1)])
def test_lower_precision_within_tolerance(dtype, rtol):
    """Not bitwise: tp sums partial products in another order (and rounds them to bf16 in mixed
    mode before the all-reduce), so only a tolerance holds. The loss is the tight check."""
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, dtype=dtype)
    runs, ref = run(cfg, 2, 2, 4)
    assert np.allclose(runs[0].losses, ref.losses, rtol=rtol / 10 if dtype == "float32" else 1e-2)
    _, problems = compare_run(runs[0], ref, rtol, param_atol=2e-3 * STEPS)
    assert not problems, "\n".join(problems)


def test_replicated_gradients_are_bitwise_identical_across_ranks():
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=1)
    runs, _ = run(cfg, 2, 2, 4)
    for n in (
        "blocks.0.ln1.gain",
        "blocks.0.attn.bo",
        "blocks.0.mlp.b2",
        "embed.pos",
        "final_ln.bias",
    ):
        assert np.array_equal(runs[0].local_grads[n], runs[1].local_grads[n]), n


def test_conjugates_f_and_g():
    """f: identity forward, all-reduce backward; g: all-reduce forward, identity backward."""

    def fn(comm):
        x = np.full(3, comm.rank + 1.0)
        return (
            f_forward(comm, x) is x,
            f_backward(comm, x),
            g_forward(comm, x),
            g_backward(comm, x) is x,
        )

    for same, fb, gf, same2 in emulator.spawn(fn, 3, timeout=30):
        assert same and same2 and np.array_equal(fb, [6.0] * 3) and np.array_equal(gf, [6.0] * 3)


def test_bad_input_is_refused_clearly():
    base = {"vocab_size": 8, "max_seq_len": 8, "d_model": 12, "n_heads": 6, "n_layers": 1}
    with pytest.raises(ValueError, match="n_heads=6 is not divisible by tp=4"):
        check_tp(ModelConfig(**base), 4)
    with pytest.raises(ValueError, match="mlp.w1.*not divisible by 2"):
        check_tp(ModelConfig(**{**base, "d_ff": 9}), 2)
    with pytest.raises(ValueError, match="embed.tok.*not divisible by 3"):
        check_tp(ModelConfig(**{**base, "vocab_size": 8}), 3)
    with pytest.raises(ValueError, match="S=5 is not divisible by 2"):
        check_tp(ModelConfig(**base), 2, S=5, sequence_parallel=True)
    cfg = ModelConfig(**base)
    with pytest.raises(ValueError, match="tp=3 = 3 ranks, but the world has 4"):
        emulator.spawn(lambda c: tp_train(emulator.Mesh(c, tp=3), cfg, 0, [], 0), 4, timeout=30)
