"""MoE routing decisions vs the reference's (parallel/check/routing.py): the rule for lower precision,
the spec's capacity fill order, and a layout that fills slots in another order (a mutant)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.moe import route
from emulator.reference import reference_train
from parallel.check.routing import (
    NEAR_TIE,
    Route,
    compare_routes,
    decisions,
    fill,
    reference_routes,
)
from parallel.check.tensor import compare_tp
from parallel.tensor.train import tp_train


def _group(u, router, K, cf=1.25):
    r = route(u, router, K, cf)
    return [(np.arange(u.shape[0]), r)], r["probs"]


def _kept(topi, E):
    kept = np.zeros((topi.shape[0], E), bool)
    np.put_along_axis(kept, topi, True, axis=1)
    return kept


def _token_major(topi, E, C):
    """The WRONG fill order: each token's K choices, then the next token's (i = t K + k)."""
    N, K = topi.shape
    tm = topi.reshape(-1)  # (N K,) token-major
    before = np.cumsum(tm[:, None] == np.arange(E), axis=0)[np.arange(N * K), tm] - 1
    return before.reshape(N, K).T.reshape(-1)  # slot positions, choice-major (i = k N + t)


def test_decisions_are_the_ranked_choices_and_kept_experts_of_each_token():
    rng = np.random.default_rng(0)
    u, router = rng.normal(size=(6, 4)), rng.normal(size=(4, 3))
    groups, probs = _group(u, router, K=2, cf=10.0)  # capacity for every choice: all kept
    ((topi, kept, C, _, _),) = decisions(groups)
    assert np.array_equal(topi, np.argsort(-probs, axis=1)[:, :2]) and C == 40
    assert np.array_equal(kept, _kept(topi, 3))
    ((_, tight, C, _, _),) = decisions(_group(u, router, K=2, cf=0.5)[0])  # C = 2: choices dropped
    assert C == 2 and tight.sum() < kept.sum() and not (tight & ~kept).any()


def test_fill_by_hand():
    topi = np.array([[0, 1], [0, 1], [1, 0]])  # N = 3, K = 2, E = 2, C = 2
    # choice order: 1st choices of tokens 0, 1, 2 (experts 0, 0, 1), then the 2nd (1, 1, 0):
    # expert 0 takes tokens 0, 1; expert 1 takes 2, 0 and is full for token 1's 2nd choice.
    assert np.array_equal(fill(topi, 2, 2), [[1, 1], [1, 0], [0, 1]])
    # token-major (t0: 0, 1; t1: 0, 1; t2: 1, 0) keeps token 1's 2nd choice, drops token 2's 1st
    assert np.array_equal(_token_major(topi, 2, 2), [0, 1, 2, 0, 1, 2])  # choice-major slots


@settings(max_examples=30, deadline=None)
@given(N=st.integers(1, 12), E=st.integers(1, 5), data=st.data(), cf=st.floats(0.1, 2.0))
def test_fill_equals_route_the_spec_fill_order(N, E, data, cf):
    K = data.draw(st.integers(1, E))
    rng = np.random.default_rng(N * 100 + E * 10 + K)
    groups, _ = _group(rng.normal(size=(N, 4)), rng.normal(size=(4, E)), K, cf)
    ((topi, kept, C, _, _),) = decisions(groups)
    assert np.array_equal(fill(topi, E, C), kept)


def _one(topi, kept, C=10):
    return [[[Route(np.array(topi), np.array(kept, bool), C)]]]


def test_a_flip_is_found_at_its_step_and_measured_against_the_kth_choice():
    probs = np.array([[0.5, 0.3, 0.2], [0.40, 0.399, 0.201]])  # token 1: experts 0, 1 nearly tie
    ref = _one([[0], [0]], [[1, 0, 0], [1, 0, 0]])  # K = 1
    want = [[[([r], [probs]) for r in ref[0][0]]]] * 2  # 2 steps, 1 micro-batch, 1 block
    same = compare_routes([ref] * 2, want, 1)
    assert same.first_flip is None and same.tokens == 4 and "identical" in same.describe()
    rc = compare_routes([ref, _one([[0], [1]], [[1, 0, 0], [0, 1, 0]])], want, 1)
    assert (rc.first_flip, rc.flipped, rc.tokens) == (1, 1, 2)
    assert np.isclose(rc.worst_gap, (0.40 - 0.399) / 0.40) and rc.near_ties
    rc = compare_routes([_one([[0], [2]], [[1, 0, 0], [0, 0, 1]])] * 2, want, 1)
    assert rc.first_flip == 0 and rc.worst_gap > NEAR_TIE and not rc.near_ties  # p 0.201
    assert "NOT near ties" in rc.describe()


def test_a_capacity_drop_difference_is_accepted_only_from_near_tie_choices_and_spec_fill():
    """N = 2 tokens, E = 3, K = 2, C = 1. Token 0's two choices nearly tie (0.400 vs 0.399): bf16
    may rank them the other way, and the spec's fill then keeps other experts for both tokens.
    A layout with the reference's own choices but a token-major fill keeps the SAME experts:
    kept sets alone cannot tell the two apart, the ranked choices can."""
    probs = np.array([[0.400, 0.399, 0.201], [0.3, 0.5, 0.2]])
    r_topi = np.array([[0, 1], [1, 0]])
    assert np.array_equal(fill(r_topi, 3, 1), [[1, 0, 0], [0, 1, 0]])  # both 1st choices
    want = [[[([Route(r_topi, fill(r_topi, 3, 1), 1)], [probs])]]]
    l_topi = np.array([[1, 0], [1, 0]])  # token 0's choices swapped: 1st choices collide
    kept = fill(l_topi, 3, 1)
    assert np.array_equal(kept, [[1, 1, 0], [0, 0, 0]])
    near = compare_routes([_one(l_topi, kept, 1)], want, 2)
    assert near.first_flip == 0 and near.flipped == 2 and near.near_ties, near.describe()
    assert not near.misfilled and np.isclose(near.worst_gap, 0.001 / 0.399)  # 2nd: 0.400 vs 0.399
    pos = _token_major(r_topi, 3, 1)  # the mutant: reference's choices, token-major slots
    bad = np.zeros((2, 3), bool)
    bad[np.tile(np.arange(2), 2)[pos < 1], r_topi.T.reshape(-1)[pos < 1]] = True
    assert np.array_equal(bad, kept)
    rc = compare_routes([_one(r_topi, bad, 1)], want, 2)
    assert rc.first_flip == 0 and rc.worst_gap == 0.0 and rc.misfilled == 2
    assert not rc.near_ties and "CAPACITY FILL" in rc.describe()


def test_decisions_downstream_of_an_earlier_blocks_flip_are_not_judged():
    """One sequence of S = 2 tokens, 2 blocks, K = 1. Block 0 flips a near tie; in block 1 a
    token at or after that position has another input (causal attention), so its decision may
    differ by anything; a token BEFORE it has the same input and is judged."""
    E, C, tok = 3, 10, np.arange(2)
    p0 = np.array([[0.40, 0.399, 0.201], [0.5, 0.3, 0.2]])
    p1 = np.array([[0.6, 0.3, 0.1], [0.6, 0.3, 0.1]])

    def block(topi, S=2):
        topi = np.array(topi)
        return Route(topi, fill(topi, E, C), C, tok, S)

    want = [[[([block([[0], [0]])], [p0]), ([block([[0], [0]])], [p1])]]]
    got = [[[[block([[1], [0]])], [block([[2], [0]])]]]]  # block 0 token 0 near tie; then far
    rc = compare_routes(got, want, 1)
    assert rc.near_ties and rc.flipped == 2 and rc.downstream == 1, rc.describe()
    assert "1 downstream" in rc.describe()
    p0 = p0[::-1].copy()  # now token 1 (position 1) holds the near tie
    want = [[[([block([[0], [0]])], [p0]), ([block([[0], [0]])], [p1])]]]
    got = [[[[block([[0], [1]])], [block([[2], [0]])]]]]  # token 0 precedes the flip: judged
    rc = compare_routes(got, want, 1)
    assert not rc.near_ties and rc.downstream == 0 and rc.worst_gap > 0.5


def _token_major_route(u, router, top_k, capacity_factor):
    """emulator.moe.route with its slots filled in the wrong (token-major) order: the mutant."""
    r = route(u, router, top_k, capacity_factor)
    pos = _token_major(r["topi"], r["E"], r["C"])
    return r | {"pos": pos, "keep": pos < r["C"]}


def test_a_layout_filling_slots_in_another_order_fails_in_mixed_precision(monkeypatch):
    """The old rule counted a kept expert the reference had chosen but dropped as gap <= 0, i.e.
    a near tie: this mutant passed in mixed precision (nothing compared after step 0)."""
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=16, n_heads=4, n_layers=1,
                      n_experts=4, moe_top_k=2, capacity_factor=0.5, dtype="mixed")  # fmt: skip
    batches = lambda s: synthetic_batch(3, s, 2, 8, cfg.vocab_size)
    ref = reference_train(cfg, 0, batches, 2)
    want = reference_routes(cfg, 0, batches, 2)
    fn = lambda comm: tp_train(comm, cfg, 0, batches, 2)
    _, problems, note = compare_tp(emulator.spawn(fn, 2, timeout=30)[0], ref, "mixed", want, 2)
    assert not problems, (note, problems)
    monkeypatch.setattr("parallel.tensor.moe.route", _token_major_route)
    _, problems, note = compare_tp(emulator.spawn(fn, 2, timeout=30)[0], ref, "mixed", want, 2)
    assert "CAPACITY FILL" in note and any("fill order" in p for p in problems), note


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
        assert rc.worst_gap == 0.0 and not rc.misfilled
        kept = sum(int(g.kept.sum()) for step in got for mb in step for block in mb for g in block)
        assert kept <= 3 * 4 * 2 * 2 * 3  # C = 1 per group of 2 tokens: <= 3 of its 4 choices
