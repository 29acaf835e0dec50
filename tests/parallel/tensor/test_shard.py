"""Placement plans: shard / unshard round trips, validation messages, the printable table."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.model import ModelConfig, init_params, param_shapes
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import (
    REPLICATE,
    Placement,
    describe,
    local_shape,
    shard,
    unshard,
    validate,
)


@settings(max_examples=20, deadline=None)
@given(
    R=st.sampled_from([1, 2, 3, 4]),
    dims=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    axis=st.integers(-3, 2),
    kind=st.sampled_from(["col", "row", "vocab", "experts", "seq"]),
)
def test_round_trip_any_axis(R, dims, axis, kind):
    shape = tuple(d * R for d in dims)
    axis = axis % len(shape)
    x = np.arange(np.prod(shape), dtype=np.float64).reshape(shape)
    plan = {"x": Placement(kind, axis), "r": REPLICATE}
    params = {"x": x, "r": x + 1}
    parts = [shard(params, plan, r, R) for r in range(R)]
    assert parts[0]["x"].shape == local_shape(shape, plan["x"], R)
    assert all(p["x"].flags.c_contiguous for p in parts)
    back = unshard(parts, plan, check_replicas=True)
    assert np.array_equal(back["x"], x) and np.array_equal(back["r"], x + 1)


@pytest.mark.parametrize("t", [1, 2, 4])
def test_megatron_plan_round_trip(t):
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=16, n_heads=4, n_layers=2)
    params, plan = init_params(cfg, 0), megatron_plan(cfg)
    parts = [shard(params, plan, r, t) for r in range(t)]
    back = unshard(parts, plan)
    assert all(np.array_equal(back[n], params[n]) for n in params)
    # rank r owns whole heads: columns r*H/t .. of wq, rows of wo; vocabulary rows / columns
    assert parts[-1]["blocks.0.attn.wq"].shape == (16, 16 // t)
    assert parts[-1]["blocks.0.attn.wo"].shape == (16 // t, 16)
    assert parts[-1]["embed.tok"].shape == (16 // t, 16) and parts[-1]["head.w"].shape == (
        16,
        16 // t,
    )
    assert not plan["blocks.0.attn.bo"].sharded and not plan["blocks.1.ln2.gain"].sharded


def test_moe_plan_cuts_every_expert_like_the_dense_mlp():
    cfg = ModelConfig(vocab_size=8, max_seq_len=4, d_model=8, n_heads=2, n_layers=1, n_experts=3)
    plan = megatron_plan(cfg)
    shapes = param_shapes(cfg)
    assert local_shape(shapes["blocks.0.moe.w1"], plan["blocks.0.moe.w1"], 2) == (3, 8, 16)
    assert local_shape(shapes["blocks.0.moe.w2"], plan["blocks.0.moe.w2"], 2) == (3, 16, 8)
    assert not plan["blocks.0.moe.router"].sharded and not plan["blocks.0.moe.b2"].sharded


def test_validate_names_every_bad_tensor():
    shapes = {"a": (6, 4), "b": (5,), "c": (3,)}
    plan = {"a": Placement("col", -1), "b": Placement("row", 0), "c": REPLICATE}
    with pytest.raises(ValueError, match=r"b \(5,\).*not divisible by 2"):
        validate(plan, shapes, 2)
    with pytest.raises(ValueError, match="no placement"):
        validate({"a": REPLICATE}, shapes, 1)
    with pytest.raises(ValueError, match="axis 3"):
        validate({"a": Placement("col", 3), "b": REPLICATE, "c": REPLICATE}, shapes, 1)
    with pytest.raises(ValueError, match="group size"):
        validate(plan, shapes, 0)


def test_bad_placements_and_ranks():
    with pytest.raises(ValueError, match="unknown"):
        Placement("diagonal", 0)
    with pytest.raises(ValueError, match="needs one"):
        Placement("col")
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard({"a": np.zeros(4)}, {"a": REPLICATE}, 2, 2)
    with pytest.raises(ValueError, match="empty"):
        unshard([], {})


def test_unshard_catches_diverged_replicas():
    plan = {"r": REPLICATE}
    with pytest.raises(ValueError, match="replicas of r differ"):
        unshard([{"r": np.zeros(2)}, {"r": np.ones(2)}], plan, check_replicas=True)


def test_describe_prints_the_plan():
    cfg = ModelConfig(vocab_size=8, max_seq_len=4, d_model=8, n_heads=2, n_layers=1)
    text = describe(megatron_plan(cfg), param_shapes(cfg), 2)
    assert "blocks.0.attn.wq" in text and "col(axis=-1)" in text and "(8, 4)" in text
    assert "vocab(axis=0)" in text and "replicate" in text


def test_megatron_plan_is_a_new_dict_each_call():
    # the plan is computed once per config (every rank of a run asks): a caller's edit of the
    # dict it got (parallel/expert/nd.py builds its own from one) must not reach the next caller
    cfg = ModelConfig(vocab_size=8, max_seq_len=4, d_model=8, n_heads=2, n_layers=1)
    first = megatron_plan(cfg)
    first["blocks.0.attn.wq"] = REPLICATE
    del first["head.w"]
    again = megatron_plan(cfg)
    assert again["blocks.0.attn.wq"] == Placement("col", -1) and "head.w" in again
    assert list(again) == list(param_shapes(cfg))


def test_placement_sharded_is_not_part_of_its_identity():
    a, b = Placement("col", -1), Placement("col", -1)
    assert a == b and hash(a) == hash(b) and a.sharded and not REPLICATE.sharded
    assert repr(a) == "Placement(kind='col', axis=-1)" and str(a) == "col(axis=-1)"
