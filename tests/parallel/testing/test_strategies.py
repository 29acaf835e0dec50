"""The kit's strategies draw what they promise: edge cases, valid meshes, partitions, and
pipeline schedules that validate and train as the single-rank reference does."""

import numpy as np
from hypothesis import find, given, settings
from hypothesis import strategies as st

import emulator
from collectives import all_gather
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.moe import check_groups
from emulator.reference import reference_train
from parallel.pipeline.schedules import validate
from parallel.pipeline.train import pipeline_train
from parallel.testing import assert_matches_reference
from parallel.testing import strategies as dst


def test_lengths_and_parts_reach_every_edge_case():
    for name, cond in {
        "n = 0": lambda x: x[0] == 0 and x[1] > 1,
        "n = 1": lambda x: x[0] == 1 and x[1] > 1,
        "p > n > 0": lambda x: 0 < x[0] < x[1],
        "p does not divide n, n > p": lambda x: x[0] > x[1] > 1 and x[0] % x[1],
    }.items():
        assert find(dst.lengths_and_parts(), cond), name


@settings(max_examples=25, deadline=None)
@given(dst.lengths_and_parts(max_parts=6, max_length=20))
def test_all_gather_of_drawn_uneven_chunks_is_the_whole(np_):
    """The use the strategy is for: chunking as np.array_split, p not dividing n included."""
    n, p = np_
    whole = np.arange(n, dtype=np.float64)
    mine = lambda c: np.array_split(whole, p)[c.rank]
    sizes = [len(a) for a in np.array_split(whole, p)]
    for got in emulator.spawn(lambda c: all_gather(c, mine(c), sizes=sizes), p, timeout=20):
        np.testing.assert_array_equal(got, whole)


@settings(max_examples=25, deadline=None)
@given(dst.meshes(max_ranks=8, axes=("dp", "pp", "tp")))
def test_meshes_multiply_to_their_world(dims):
    n = int(np.prod(list(dims.values())))
    assert 1 <= n <= 8 and list(dims) == ["dp", "pp", "tp"]
    emulator.spawn(lambda c: emulator.Mesh(c, **dims).ranks("tp"), n, timeout=20)


@settings(max_examples=25, deadline=None)
@given(dst.model_configs(divisible_by=2), st.data())
def test_configs_split_by_their_degree_and_batches_fit(cfg, data):
    assert cfg.n_heads % 2 == 0 and cfg.vocab_size % 2 == 0 and cfg.d_ff % 2 == 0
    tokens, targets = data.draw(dst.batches(cfg, batch_multiple=2))
    assert tokens.shape == targets.shape and tokens.shape[0] % 2 == 0
    assert tokens.max() < cfg.vocab_size and tokens.shape[1] <= cfg.max_seq_len


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(st.just(n), dst.routing_groups(n))))
def test_routing_groups_partition_the_tokens(n_groups):
    n, groups = n_groups
    check_groups(groups, n)  # the MoE block's own validation


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_random_schedules_validate_and_train_as_the_reference(p, m, data):
    sched = data.draw(dst.random_schedule(p, m, split=data.draw(st.booleans())))
    validate(sched)
    cfg = ModelConfig(vocab_size=8, max_seq_len=4, d_model=4, n_heads=2, n_layers=3)
    batches = lambda s: synthetic_batch(2, s, 2 * m, 4, cfg.vocab_size)
    ref = reference_train(cfg, 0, batches, 1, microbatches=m)
    runs = emulator.spawn(lambda c: pipeline_train(c, cfg, 0, batches, 1, schedule=sched), p)
    for rank, run in enumerate(runs):  # backwards in another order add in another order
        assert_matches_reference(run, ref, rtol=1e-12, rank=rank)
