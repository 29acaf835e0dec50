"""MoE routing decisions vs the reference's (parallel/moe_routing.py): the rule for lower precision."""

import numpy as np

import emulator
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.moe import route
from parallel.moe_routing import NEAR_TIE, compare_routes, decisions, reference_routes
from parallel.tp_train import tp_train


def _group(u, router, K, cf=1.25):
    r = route(u, router, K, cf)
    return [(np.arange(u.shape[0]), r)], r["probs"]


def test_decisions_are_the_kept_experts_of_each_token():
    rng = np.random.default_rng(0)
    u, router = rng.normal(size=(6, 4)), rng.normal(size=(4, 3))
    groups, probs = _group(u, router, K=2, cf=10.0)  # capacity for every choice: all kept
    (kept,) = decisions(groups)
    top2 = np.argsort(-probs, axis=1)[:, :2]
    want = np.zeros((6, 3), bool)
    np.put_along_axis(want, top2, True, axis=1)
    assert np.array_equal(kept, want)
    (tight,) = decisions(_group(u, router, K=2, cf=0.5)[0])  # C = 2: some choices dropped
    assert tight.sum() < kept.sum() and not (tight & ~kept).any()


def test_a_flip_is_found_at_its_step_and_measured_against_the_kth_choice():
    probs = np.array([[0.5, 0.3, 0.2], [0.40, 0.399, 0.201]])  # token 1: experts 0, 1 nearly tie
    want_kept = np.array([[1, 0, 0], [1, 0, 0]], bool)  # K = 1
    got_kept = np.array([[1, 0, 0], [0, 1, 0]], bool)  # the layout chose expert 1 for token 1
    want = [[[([want_kept], [probs])]]] * 2  # 2 steps, 1 micro-batch, 1 block, 1 group
    same = compare_routes([[[[want_kept]]]] * 2, want, 1)
    assert same.first_flip is None and same.tokens == 4 and "identical" in same.describe()
    rc = compare_routes([[[[want_kept]]], [[[got_kept]]]], want, 1)
    assert (rc.first_flip, rc.flipped, rc.tokens) == (1, 1, 2)
    assert np.isclose(rc.worst_gap, (0.40 - 0.399) / 0.40) and rc.near_ties
    far = np.array([[1, 0, 0], [0, 0, 1]], bool)  # expert 2 (p = 0.201) is no near tie of 0.40
    rc = compare_routes([[[[far]]]] * 2, want, 1)
    assert rc.first_flip == 0 and rc.worst_gap > NEAR_TIE and not rc.near_ties
    assert "NOT near ties" in rc.describe()


def test_tp_routing_equals_the_reference_routing_in_float64():
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=2,
                      n_experts=3, moe_top_k=2, capacity_factor=0.5)  # fmt: skip
    batches = lambda s: synthetic_batch(4, s, 4, 4, cfg.vocab_size)
    groups_fn = lambda step, mb, B, S: [np.arange(0, B * S, 2), np.arange(1, B * S, 2)]
    want = reference_routes(cfg, 1, batches, 3, microbatches=4, groups_fn=groups_fn)

    def fn(comm):
        mesh = emulator.Mesh(comm, dp=2, tp=2)
        return tp_train(mesh, cfg, 1, batches, 3, microbatches=2, groups_fn=groups_fn).routing

    for got in emulator.spawn(fn, 4, timeout=30):
        rc = compare_routes(got, want, 2)
        assert rc.first_flip is None and rc.tokens == 3 * 4 * 2 * 4, rc.describe()
        kept = sum(int(k.sum()) for step in got for mb in step for block in mb for k in block)
        assert kept <= 3 * 4 * 2 * 2 * 3  # C = 1 per group of 2 tokens: <= 3 of its 4 choices
