"""Context parallelism through the one N-D program: parallel.train with cp > 1 (alone, x dp,
x tp x dp, x pp) equals the single-rank reference on the same global batch - every step's loss,
every gradient and the parameters after k steps on EVERY rank (its TP shards and the gathered
model), float64 ~1e-12, with weight decay and clipping; every rank's bytes by axis equal
nd_cost.rank_bytes, and the new "cp" axis equals parallel/context/cost.attention_bytes times
blocks x micro-batches, computed here from the cost module directly; every block's activation
bytes equal context/cost.py's (block_activation_bytes, or tp_block_activation_bytes under tp).
cp x tp with sequence parallelism: tests/parallel/context/test_train_sp.py."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
import parallel
from emulator.check import compare, compare_run
from emulator.data import synthetic_batch
from emulator.mesh import Mesh
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import Layout, nd_cost
from parallel.context import cost
from parallel.context.layout import table
from parallel.context.train import routing_groups
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard

HYPER = {"weight_decay": 0.1, "betas": (0.8, 0.9), "eps": 1e-7, "lr": 3e-3, "max_norm": 0.3}
RTOL = 1e-12
STEPS = 2


def _cfg(experts=0, L=2, A=4):
    # K = E: every choice kept (capacity factor covers all), so routing has no discrete choice
    return ModelConfig(vocab_size=16, max_seq_len=16, d_model=8, n_heads=A, n_layers=L, d_ff=16,
                       n_experts=experts, moe_top_k=max(experts, 1),
                       capacity_factor=2.0)  # fmt: skip


def _run(layout, cfg, B, S):
    batches = lambda s: synthetic_batch(7, s, B, S, cfg.vocab_size)

    def main(comm):
        return parallel.train(comm, layout, cfg, batches, STEPS, **HYPER)

    return batches, emulator.spawn(main, layout.world, timeout=180)


def check_cp(layout, cfg=None, *, B=4, S=8):
    """Every rank vs reference_train; bytes by axis vs nd_cost and cost.py; -> worst errors."""
    cfg = dataclasses.replace(cfg or _cfg(), dtype=layout.dtype)
    tab = table(S, layout.cp, layout.cp_balance)
    groups_fn = (lambda step, j, b, s: routing_groups(b, s, tab)) if cfg.is_moe else None
    batches, runs = _run(layout, cfg, B, S)
    ref = reference_train(cfg, 0, batches, STEPS, microbatches=layout.dp * layout.microbatches,
                          recompute=layout.recompute, groups_fn=groups_fn, **HYPER)  # fmt: skip
    plan, t, C = megatron_plan(cfg), layout.tp, layout.cp
    x = 8  # float64: stored = arithmetic itemsize
    b = B // (layout.dp * layout.microbatches)
    per = cost.attention_bytes(layout.cp_method, b, S, cfg.d_model // t, cfg.n_heads // t, C, x)
    worst = {}
    for run in runs:
        where = f"rank at {run.coords}"
        w, problems = compare_run(run, ref, RTOL)
        assert not problems, (where, problems[:4])
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in w.items()}
        want_p = shard({n: ref.params[n] for n in run.local_params}, plan, run.coords["tp"], t)
        want_g = shard({n: ref.grads[n] for n in run.local_grads}, plan, run.coords["tp"], t)
        assert not compare(run.local_params, want_p, RTOL, "param")[1], where
        assert not compare(run.local_grads, want_g, RTOL, "grad")[1], where
        assert run.losses == runs[0].losses, where  # one global loss on every rank
        assert run.replica_mismatch == [], (where, run.replica_mismatch)
        assert (run.positions == tab).all(), where
        blocks = sum(1 for n in run.local_params if n.endswith(".ln1.gain"))
        fwd = per["forward"] * (2 if layout.recompute == "full" else 1)
        cp_bytes = blocks * layout.microbatches * (fwd + per["backward"])
        want = nd_cost.rank_bytes(cfg, layout, B, S, run.coords)
        assert want["cp"] == cp_bytes, (where, want, cp_bytes)
        assert run.step_bytes == [want] * STEPS, (where, run.step_bytes[-1], want)
        if t == 1:  # the single-rank block's cache with the cp attention's (context/cost.py)
            act = cost.block_activation_bytes(cfg, layout.cp_method, b, S, C, rank=run.coords["cp"],
                                              recompute=layout.recompute,
                                              balance=layout.cp_balance)  # fmt: skip
            assert set(run.act_bytes.values()) == {act}, (where, run.act_bytes, act)
        else:  # the TP block's cache (SP: its S_local/t slices) with the cp attention's
            act = cost.tp_block_activation_bytes(cfg, layout.cp_method, b, S, C, t,
                                                 sp=layout.sequence_parallel,
                                                 regather=layout.regather, rank=run.coords["cp"],
                                                 recompute=layout.recompute,
                                                 balance=layout.cp_balance)  # fmt: skip
            assert set(run.act_bytes.values()) == {act}, (where, run.act_bytes, act)
        static = nd_cost.rank_static_memory(cfg, layout, run.coords["pp"])  # ZeRO on dp x cp
        assert {k: run.memory["current"][k] for k in static} == static, where
        peak = nd_cost.rank_peak_memory(cfg, layout, run.coords["pp"])
        assert {k: run.memory["peak"][k] for k in peak} == peak, (where, run.memory["peak"], peak)
    return worst


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
def test_cp_times_dp(method, balance):
    check_cp(Layout(dp=2, cp=2, cp_method=method, cp_balance=balance))


@pytest.mark.parametrize("method", ["ring", "all-gather", "ulysses"])
def test_cp_tp_dp_on_8_ranks(method):
    """cp2 x tp2 x dp2: heads split over tp first, cp attention on each tp rank's 2 heads."""
    check_cp(Layout(dp=2, cp=2, tp=2, cp_method=method, recompute="selective"))


def test_cp_tp_dp_zero3_contiguous():
    check_cp(Layout(dp=2, cp=2, tp=2, zero=3, cp_balance="contiguous", cp_method="ring"))


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("interleaved", 2)])
def test_cp_times_pp(schedule, chunks):
    check_cp(Layout(pp=2, cp=2, schedule=schedule, chunks=chunks, microbatches=2),
             _cfg(L=4), B=2)  # fmt: skip


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_cp_recompute(recompute):
    check_cp(Layout(cp=4, cp_method="ring", recompute=recompute), B=2)


def test_cp_moe_routing_groups_are_cp_ranks_tokens():
    check_cp(Layout(dp=2, cp=2, zero=1, microbatches=2, cp_method="all-gather"), _cfg(4))


@settings(max_examples=12, deadline=None)
@given(
    world=st.sampled_from([2, 4, 8]),
    data=st.data(),
    method=st.sampled_from(["ring", "all-gather", "ulysses"]),
    balance=st.sampled_from(["zigzag", "contiguous"]),
    zero=st.integers(0, 3),
    recompute=st.sampled_from(["none", "selective"]),
    moe=st.booleans(),
)
def test_cp_layouts_drawn_from_the_space(world, data, method, balance, zero, recompute, moe):
    """cp x tp x pp x dp drawn over the 2..8-rank space, S over the lengths the balance allows."""
    cp = data.draw(st.sampled_from([c for c in (2, 4) if world % c == 0]), "cp")
    tp = data.draw(st.sampled_from([t for t in (1, 2) if (world // cp) % t == 0]), "tp")
    pp = data.draw(st.sampled_from([p for p in (1, 2) if (world // (cp * tp)) % p == 0]), "pp")
    dp, m = world // (cp * tp * pp), data.draw(st.integers(1, 2), "m")
    if method == "ulysses" and (4 // tp) % cp:
        method = "ring"  # 4 heads: ulysses needs cp | 4 / tp (its refusal: test_refusals)
    S = (2 * cp if balance == "zigzag" else cp) * data.draw(st.integers(1, 2), "S chunks")
    layout = Layout(dp=dp, pp=pp, tp=tp, cp=cp, cp_method=method, cp_balance=balance, zero=zero,
                    microbatches=m, recompute=recompute)  # fmt: skip
    check_cp(layout, _cfg(2 if moe else 0, L=2 * pp), B=dp * m, S=S)


def test_gradients_summed_over_dp_only_fail(monkeypatch):
    """Planted bug: the data axis on the dp group alone (the cp ranks' gradients not summed)."""
    real = Mesh.group
    monkeypatch.setattr(Mesh, "group", lambda self, *a: real(self, *a[:1]))
    layout, cfg = Layout(dp=2, cp=2), _cfg()
    batches, runs = _run(layout, cfg, 4, 8)
    ref = reference_train(cfg, 0, batches, STEPS, microbatches=2, **HYPER)
    assert compare_run(runs[0], ref, RTOL)[1]


def test_refusals():
    cfg = _cfg(A=2)
    bad = Layout(cp=2, tp=2, dp=2, cp_method="ulysses")  # with SP: tests/parallel/context/
    msg = "\n".join(bad.problems(8, cfg, (4, 6)))
    assert "S=6 does not split into 4 equal 2 cp chunks" in msg and "'contiguous'" in msg
    assert "n_heads=1 is not divisible by cp=2 (the heads per tp rank" in msg
    assert "cp_method='bogus'" in "".join(Layout(cp=2, cp_method="bogus").problems(2))
    assert "cp_balance='x'" in "".join(Layout(cp=2, cp_balance="x").problems(2))
    assert Layout(cp=2, cp_balance="contiguous").problems(2, cfg, (2, 6)) == []
    batches = lambda s: synthetic_batch(7, s, 2, 6, cfg.vocab_size)
    with pytest.raises(ValueError, match="S=6 does not split into 4 equal 2 cp chunks"):
        emulator.spawn(lambda c: parallel.train(c, Layout(cp=2), cfg, batches, 1), 2, timeout=30)
    with pytest.raises(ValueError, match="pass groups_fn only to the reference"):
        emulator.spawn(lambda c: parallel.train(c, Layout(cp=2, cp_balance="contiguous"), cfg,
                                                batches, 1, groups_fn=lambda *a: None), 2,
                       timeout=30)  # fmt: skip
