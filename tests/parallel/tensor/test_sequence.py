"""Sequence parallelism (Korthikanti et al. 2022, section 4.2.2): the same training as the
reference, the same boundary bytes as tensor parallelism alone, and less activation memory."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from collectives.reference import all_reduce as ref_all_reduce
from emulator.model import ModelConfig
from parallel.check.tensor import compare_tp
from parallel.tensor import cost as tp_cost
from parallel.tensor.sequence import (
    gather_seq,
    partial_grad_names,
    reduce_scatter_seq,
    scatter_seq,
    seq_slice,
)
from tests.parallel.tensor.test_block import assert_bytes, assert_matches, run


@settings(max_examples=25, deadline=None)
@given(
    t=st.sampled_from([2, 3, 4]),
    heads_per_rank=st.integers(1, 2),
    head_dim=st.integers(2, 3),
    ff_per_rank=st.integers(1, 4),
    vocab_per_rank=st.integers(1, 3),
    seq_per_rank=st.integers(1, 3),
    b=st.integers(1, 2),
    k=st.integers(1, 3),
    regather=st.booleans(),
    moe=st.booleans(),
)
def test_sp_training_equals_reference_with_tp_bytes(t, heads_per_rank, head_dim, ff_per_rank, vocab_per_rank, seq_per_rank, b, k, regather, moe):  # fmt: skip
    A, S = heads_per_rank * t, seq_per_rank * t
    cfg = ModelConfig(vocab_size=vocab_per_rank * t, max_seq_len=12, d_model=head_dim * A,
                      n_heads=A, n_layers=2, d_ff=ff_per_rank * t, n_experts=3 if moe else 0,
                      moe_top_k=2)  # fmt: skip
    runs, ref, *routing = run(cfg, t, b * k, S, sp=True, regather=regather, microbatches=k,
                              routing=moe)  # fmt: skip
    _, problems, _ = compare_tp(runs[0], ref, "float64", routing[0] if moe else None, 2)
    assert not problems, "\n".join(problems)  # float64: routing identical, 1e-12
    H = cfg.d_model
    for r in runs:
        sp = tp_cost.layer_bytes(cfg, b, S, t, sp=True, regather=regather, rank=r.rank)
        no_sp = tp_cost.layer_bytes(cfg, b, S, t, rank=r.rank)
        extra = (1 if moe else 2) * (t - 1) * b * S * H * 8 // t if regather else 0
        assert sp == no_sp + extra  # the boundaries move exactly what the four all-reduces did
        assert r.layer_bytes == [(k * sp, k * sp)] * 2
        assert r.tag_bytes["sp/grads"] > 0
        act = tp_cost.block_activation_bytes(cfg, b, S, t, sp=True, regather=regather)
        assert r.act_bytes == {f"mb{k - 1}.blocks.{i}": act for i in range(2)}
    assert_bytes(runs, cfg, b, S, t, k, sp=True, regather=regather)


def test_sp_saves_activation_memory_exactly_by_formula():
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=16, n_heads=4, n_layers=1)
    B, S, t = 2, 8, 4
    got = {}
    for sp, rg in ((False, True), (True, True), (True, False)):
        runs, ref = run(cfg, t, B, S, sp=sp, regather=rg, microbatches=2)
        assert_matches(runs, ref, 1e-12)
        got[sp, rg] = runs[0].act_bytes["mb1.blocks.0"]
    full = tp_cost.block_activation_bytes(cfg, B // 2, S, 1)
    assert got[True, True] * t == full  # with regather every term is divided by t
    assert got[False, True] > got[True, False] > got[True, True]
    assert got[False, True] == tp_cost.block_activation_bytes(cfg, B // 2, S, t)


def test_gather_and_reduce_scatter_along_the_sequence():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(2, 6, 3)) for _ in range(3)]

    def fn(comm):
        mine = scatter_seq(xs[0], 3, comm.rank)
        return gather_seq(comm, mine), reduce_scatter_seq(comm, xs[comm.rank])

    total = ref_all_reduce(xs, "sum")[0]
    for r, (g, rs) in enumerate(emulator.spawn(fn, 3, timeout=30)):
        assert np.array_equal(g, xs[0])
        assert np.allclose(rs, total[:, seq_slice(6, 3, r)], rtol=1e-14)


def test_partial_gradients_and_bad_sequence_length():
    names = ["embed.pos", "blocks.0.ln1.gain", "blocks.0.attn.bo", "blocks.0.attn.wo",
             "blocks.0.mlp.b2", "blocks.0.moe.b2", "blocks.0.moe.router", "final_ln.bias"]  # fmt: skip
    assert partial_grad_names(names) == [
        "embed.pos", "blocks.0.ln1.gain", "blocks.0.attn.bo", "blocks.0.mlp.b2", "final_ln.bias"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="S=6 is not divisible by 4"):
        seq_slice(6, 4, 0)


@pytest.mark.parametrize("moe", [False, True])
def test_backward_reads_its_cache_and_never_writes_it(moe):
    """tp_block_backward re-gathers into local variables: the forward's cache (its keys, the
    objects under them, and the dropped (None, ...) inputs) is the same after the backward."""
    from emulator.model import block_params, init_params
    from parallel.tensor.block import megatron_plan, tp_block_backward, tp_block_forward
    from parallel.tensor.shard import shard

    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=1,
                      n_experts=3 if moe else 0, moe_top_k=2)  # fmt: skip
    x = np.random.default_rng(1).normal(size=(2, 4, 8))

    def fn(comm):
        p = shard(init_params(cfg, 0), megatron_plan(cfg), comm.rank, 2)
        mine = scatter_seq(x, 2, comm.rank)
        y, c = tp_block_forward(comm, block_params(p, 0), mine, cfg, sp=True, regather=True)
        before = {k: (v, *v) if isinstance(v, tuple) else v for k, v in c.items()}
        tp_block_backward(comm, np.ones_like(y), c)
        after = {k: (v, *v) if isinstance(v, tuple) else v for k, v in c.items()}
        same = before.keys() == after.keys() and all(
            all(u is w for u, w in zip(before[k], after[k])) if isinstance(before[k], tuple)
            else before[k] is after[k] for k in before
        )  # fmt: skip
        return same, c["q"][0] is None

    assert emulator.spawn(fn, 2, timeout=30) == [(True, True)] * 2


@settings(max_examples=20, deadline=None)
@given(
    t=st.sampled_from([1, 2, 3, 4, 8]),
    heads_per_rank=st.integers(1, 3),
    head_dim=st.integers(1, 4),
    b=st.integers(1, 3),
    seq_per_rank=st.integers(1, 4),
)
def test_16bit_closed_forms_and_megatron_differ_by_dropout_only(t, heads_per_rank, head_dim, b, seq_per_rank):  # fmt: skip
    """block_activation_bytes of a mixed (16-bit) dense block with F = 4h is the closed form in
    Megatron's letters; Megatron's eqs. 2/4 add exactly the dropout masks and outputs (2 sbh and
    3 as^2b, sharded as the paper shards them) and keep no LayerNorm statistics (8 bs)."""
    a, s = heads_per_rank * t, seq_per_rank * t
    h = a * head_dim
    cfg = ModelConfig(vocab_size=t, max_seq_len=s, d_model=h, n_heads=a, n_layers=1, dtype="mixed")
    for sp, rg in ((False, True), (True, True), (True, False)):
        ours = tp_cost.closed_form_16bit(b, s, h, a, t, sp=sp, regather=rg)
        assert ours == tp_cost.block_activation_bytes(cfg, b, s, t, sp=sp, regather=rg)
        mega = tp_cost.megatron_activation_bytes(b, s, h, a, t, sp=sp, regather=rg)
        dropout = (2 * s * b * h if not sp else 2 * s * b * h // t) + 3 * a * s * s * b // t
        assert mega - ours == dropout - (8 * b * s if not sp else 8 * b * s // t)
