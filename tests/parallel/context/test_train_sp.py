"""Context parallelism with Megatron sequence parallelism (Korthikanti et al. 2022) through the
one N-D program: cp x tp (+ SP) x dp (x pp) equals the single-rank reference on every rank -
losses, every gradient, the parameters after k steps, float64 ~1e-12 - and every rank's bytes
per axis and block activations equal nd_cost / context/cost.py (tests/parallel/test_train_cp.py's
check_cp). Which positions a (cp, tp) rank holds: context/layout.sp_table, checked against its
definition and against the single-rank embedding's rows. Planted bugs: position rows of tp rank
0's slice on every tp rank; the SP-partial gradients not summed over tp."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
import parallel
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, embed_forward, init_params
from emulator.reference import reference_train
from parallel import Layout
from parallel.context.layout import sp_table, table
from parallel.layer import LayerContext
from parallel.tensor import vocab
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard
from parallel.testing import check_layout
from tests.parallel.test_train_cp import HYPER, RTOL, STEPS, _cfg, check_cp


def _cfg6(experts=0, L=2):
    """6 heads: ulysses on cp 3 x tp 2 (3 heads per tp rank) and cp 2 x tp 3 (2 per tp rank)."""
    return ModelConfig(vocab_size=24, max_seq_len=24, d_model=12, n_heads=6, n_layers=L,
                       d_ff=24, n_experts=experts, moe_top_k=max(experts, 1),
                       capacity_factor=2.0)  # fmt: skip


def test_sp_table_is_each_cp_ranks_local_axis_cut_into_tp_slices():
    for S, C, t, bal in [(8, 2, 2, "zigzag"), (12, 3, 2, "zigzag"), (12, 2, 3, "zigzag"),
                         (6, 3, 2, "contiguous"), (24, 2, 4, "zigzag")]:  # fmt: skip
        got, rows, n = sp_table(S, C, t, bal), table(S, C, bal), S // (C * t)
        assert got.shape == (C, t, n)
        for c in range(C):
            for j in range(t):  # local columns [j S_local/t, (j+1) S_local/t) of cp rank c
                assert list(got[c, j]) == list(rows[c][j * n : (j + 1) * n]), (S, C, t, c, j)
        assert sorted(got.reshape(-1)) == list(range(S))  # every position on one rank
    z = sp_table(16, 2, 2, "zigzag")  # zigzag, t = 2: tp rank 0 the early chunk, 1 its mirror
    assert [list(z[c, j]) for c in (0, 1) for j in (0, 1)] == [
        list(range(4)), list(range(12, 16)), list(range(4, 8)), list(range(8, 12))]  # fmt: skip


@pytest.mark.parametrize("C,t,bal", [(2, 2, "zigzag"), (3, 2, "contiguous"), (2, 3, "zigzag")])
def test_embedding_rows_of_each_cp_tp_rank_are_the_reference_rows(C, t, bal):
    """Rank (c, j)'s embedding output = the single-rank embedding of the whole sequence at the
    positions sp_table[c, j] (token and position rows)."""
    cfg, S, B = _cfg6(), 12, 2
    p = init_params(cfg, 0)
    tokens = np.random.default_rng(3).integers(0, cfg.vocab_size, (B, S))
    want, _ = embed_forward(p, tokens)  # (B, S, H), positions 0..S-1
    tab, sp = table(S, C, bal), sp_table(S, C, t, bal)
    plan = megatron_plan(cfg)

    def fn(comm):
        mesh = Layout(cp=C, tp=t, sequence_parallel=True).mesh(comm)
        ctx = LayerContext(tp=mesh["tp"], sp=True, cp=mesh["cp"])
        ctx.set_positions(tab)
        mine = shard({n: p[n] for n in ("embed.tok", "embed.pos")}, plan, mesh["tp"].rank, t)
        x, _ = ctx.embed_forward(mine, tokens[:, tab[mesh["cp"].rank]])
        return mesh.coord("cp"), mesh.coord("tp"), x

    for c, j, x in emulator.spawn(fn, C * t, timeout=60):
        np.testing.assert_array_equal(x, want[:, sp[c, j]], err_msg=f"rank (cp {c}, tp {j})")


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_cp2_tp2_sp_dp2(method, balance):
    check_cp(Layout(dp=2, cp=2, tp=2, sequence_parallel=True, cp_method=method,
                    cp_balance=balance, recompute="selective"))  # fmt: skip


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_cp3_tp2_sp(method, balance):
    check_cp(Layout(cp=3, tp=2, sequence_parallel=True, cp_method=method, cp_balance=balance),
             _cfg6(), B=2, S=12)  # fmt: skip


@pytest.mark.parametrize("recompute", ["none", "selective"])
@pytest.mark.parametrize("method", ["ring", "ulysses"])
def test_cp2_tp2_sp_moe(recompute, method):
    """MoE: the SP all-gather gives the router the cp rank's tokens back, one routing group."""
    check_cp(Layout(cp=2, tp=2, sequence_parallel=True, cp_method=method, recompute=recompute,
                    microbatches=2), _cfg(4), B=2)  # fmt: skip


@pytest.mark.parametrize("method", ["ring", "all-gather"])
def test_cp2_tp2_sp_pp2(method):
    """The pipeline boundary carries b S/(C t) H per micro-batch (nd_cost's pp bytes)."""
    check_cp(Layout(pp=2, cp=2, tp=2, sequence_parallel=True, cp_method=method,
                    microbatches=2, zero=1), _cfg(L=4), B=2)  # fmt: skip


def test_cp3_tp2_sp_dp2_pp2_zero2_no_regather():
    check_cp(Layout(dp=2, pp=2, cp=3, tp=2, sequence_parallel=True, regather=False, zero=2,
                    cp_balance="contiguous", microbatches=2), _cfg6(L=2), B=4, S=6)  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(
    cp=st.sampled_from([2, 3]),
    tp=st.sampled_from([2, 3]),
    data=st.data(),
    method=st.sampled_from(["ring", "all-gather", "ulysses"]),
    balance=st.sampled_from(["zigzag", "contiguous"]),
    recompute=st.sampled_from(["none", "selective"]),
    moe=st.booleans(),
)
def test_cp_sp_drawn_from_small_shapes(cp, tp, data, method, balance, recompute, moe):
    """cp, tp, dp, S (any multiple of lcm(cp tp, 2 cp zigzag)), B drawn; 6 heads."""
    if method == "ulysses" and (6 // tp) % cp:
        method = "ring"  # ulysses needs cp | A / tp (its refusal: test_refusals)
    dp = data.draw(st.sampled_from([1, 2] if cp * tp <= 6 else [1]), "dp")
    parts = np.lcm(2 * cp if balance == "zigzag" else cp, cp * tp)
    S = int(parts) * data.draw(st.integers(1, max(1, 24 // int(parts))), "S multiple")
    B = dp * data.draw(st.integers(1, 2), "B per dp")
    layout = Layout(dp=dp, cp=cp, tp=tp, sequence_parallel=True, cp_method=method,
                    cp_balance=balance, recompute=recompute)  # fmt: skip
    check_cp(layout, _cfg6(4 if moe else 0), B=B, S=S)


def test_the_kit_check_layout_takes_a_cp_sp_layout():
    """parallel.testing.check_layout, as a user calls it, on cp 2 x tp 2 + SP x dp 2."""
    worst = check_layout(Layout(dp=2, cp=2, tp=2, sequence_parallel=True, cp_method="ulysses"),
                         _cfg(), batch=4, seq=8, steps=2, **HYPER)  # fmt: skip
    assert max(worst.values()) < RTOL, worst


def _fails(layout, cfg, B, S) -> list:
    """parallel.train on virtual ranks vs the reference: rank 0's problems (none = passes)."""
    batches = lambda s: synthetic_batch(7, s, B, S, cfg.vocab_size)
    runs = emulator.spawn(lambda c: parallel.train(c, layout, cfg, batches, STEPS, **HYPER),
                          layout.world, timeout=120)  # fmt: skip
    ref = reference_train(cfg, 0, batches, STEPS, microbatches=layout.dp * layout.microbatches,
                          **HYPER)  # fmt: skip
    return [p for run in runs for p in compare_run(run, ref, RTOL)[1]]


SP = Layout(cp=2, tp=2, sequence_parallel=True)
ND = importlib.import_module("parallel.train")  # the module (parallel.train is the function)


def test_planted_position_rows_of_tp_rank_0_on_every_tp_rank_fail(monkeypatch):
    real = vocab.seq_slice
    assert not _fails(SP, _cfg(), 2, 8)
    monkeypatch.setattr(vocab, "seq_slice", lambda S, R, rank: real(S, R, 0))
    assert any("embed.pos" in p for p in _fails(SP, _cfg(), 2, 8))


def test_planted_sp_partial_grads_not_summed_over_tp_fail(monkeypatch):
    monkeypatch.setattr(ND, "_sp_partial", lambda tp: lambda layer, mb, grads: grads)
    bad = _fails(SP, _cfg(), 2, 8)
    assert any("ln1.gain" in p for p in bad) and any("embed.pos" in p for p in bad), bad[:4]


def test_refusals():
    """S that does not cut into cp x tp (zigzag: also 2 cp) slices: one error naming the
    degrees, before any rank starts; ulysses's head rule counts the heads per tp rank."""
    cfg = _cfg6()
    msg = "\n".join(Layout(cp=2, tp=2, sequence_parallel=True, cp_balance="contiguous")
                    .problems(4, cfg, (2, 6)))  # fmt: skip
    assert msg.count("S=") == 1 and "cp=2 ranks' S/cp positions cut into tp=2" in msg, msg
    assert "multiple of cp*tp = 4: use S divisible by 4" in msg
    msg = "\n".join(Layout(cp=2, tp=3, sequence_parallel=True).problems(6, cfg, (2, 6)))
    assert "multiple of cp*tp = 6 and of 2 cp = 4 (zigzag chunks): use S divisible by 12" in msg
    assert Layout(cp=2, tp=3, sequence_parallel=True).problems(6, cfg, (2, 12)) == []
    assert Layout(cp=2, tp=2, sequence_parallel=True).problems(4, cfg, (2, 4)) == []  # 1 each
    uly = Layout(cp=2, tp=2, sequence_parallel=True, cp_method="ulysses")
    assert any("n_heads=3 is not divisible by cp=2 (the heads per tp rank: n_heads=6 / tp=2)"
               in p for p in uly.problems(4, cfg, (2, 8)))  # fmt: skip
    batches = lambda s: synthetic_batch(7, s, 2, 6, cfg.vocab_size)
    with pytest.raises(ValueError, match="use S divisible by 12"):
        emulator.spawn(lambda c: parallel.train(c, Layout(cp=2, tp=3, sequence_parallel=True),
                                                cfg, batches, 1), 6, timeout=30)  # fmt: skip


def test_dry_run_of_cp_tp_sp_records_what_the_real_run_records():
    """planning/nd_dryrun (shape-only parallel.train) on cp 2 x tp 2 + SP x dp 2: every rank's
    bytes per (tag, op, peer, ...), per axis and memory equal the real run's."""
    from tests.planning.test_nd_dry_run import assert_dry_equals_real, cfg_of

    assert_dry_equals_real(cfg_of(), Layout(dp=2, cp=2, tp=2, sequence_parallel=True), 2, 8)
