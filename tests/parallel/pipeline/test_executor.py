"""Pipelined training equals the single-rank reference; bytes, in-flight and memory by formula."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.check import compare_replicas, compare_run
from emulator.data import synthetic_batch
from emulator.flops import activation_bytes_per_block, head_activation_bytes
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel.pipeline.bubble import in_flight_formula
from parallel.pipeline.cost import (
    boundary_bytes,
    dp_bytes,
    peak_activation_bytes,
    peak_closed_form,
    stash_bytes_per_block,
    unit_bytes,
)
from parallel.pipeline.executor import split_layers, stage_param_names
from parallel.pipeline.schedules import Action, Schedule, gpipe, one_f_one_b
from parallel.pipeline.train import pipeline_train

S = 6


def _cfg(L=4, experts=0):
    return ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=L,
                       n_experts=experts, moe_top_k=1)  # fmt: skip


def _batches(cfg, B=8):
    return lambda step: synthetic_batch(7, step, B, S, cfg.vocab_size)


def _run(cfg, world, steps=2, mesh=None, B=8, **kw):
    def main(comm):
        where = emulator.Mesh(comm, **mesh) if mesh else comm
        return pipeline_train(where, cfg, 0, _batches(cfg, B), steps, **kw)

    return emulator.spawn(main, world, timeout=30)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]),
    p=st.integers(1, 4),
    k=st.integers(1, 2),
    experts=st.sampled_from([0, 0, 2]),
    clip=st.sampled_from([None, 0.5]),
    data=st.data(),
)
def test_every_schedule_trains_like_the_reference(name, p, k, experts, clip, data):
    v = data.draw(st.integers(2, 3)) if name == "interleaved" else 1
    # interleaving needs m a multiple of p; the others also run m < p (no steady state)
    m = p * k if name == "interleaved" else data.draw(st.integers(1, p + 2))
    L = data.draw(st.integers(p * v, p * v + 2))
    sizes = None
    if data.draw(st.booleans()) and L > p * v:  # an explicit uneven split: one fat stage
        sizes = [1] * (p * v)
        sizes[data.draw(st.integers(0, p * v - 1))] += L - p * v
    # full recompute too, except ZB-H1, whose B/W split needs the caches (a clear error)
    recompute = data.draw(
        st.sampled_from(["none", "selective", "full"][: 2 if name == "zb-h1" else 3])
    )
    cfg = _cfg(L, experts)
    ref = reference_train(cfg, 0, _batches(cfg, 2 * m), 2, microbatches=m, max_norm=clip)
    runs = _run(cfg, p, B=2 * m, schedule=name, microbatches=m, chunks=v, sizes=sizes,
                max_norm=clip, recompute=recompute)  # fmt: skip
    run = runs[0]
    worst, problems = compare_run(run, ref, rtol=1e-12)
    assert not problems + compare_replicas(runs), problems + compare_replicas(runs)
    if clip is None:  # same arithmetic in the same order: bitwise (the reported loss adds
        # the stages' MoE aux shares in another order: a last-bit difference at most)
        assert worst["grad"] == worst["param"] == 0.0 and worst["loss"] < 1e-15
    assert [r.losses for r in runs] == [runs[0].losses] * p
    # bytes cross only between different ranks: with p = 1 every chunk's messages stay local
    msg = boundary_bytes(run.schedule, 2 * S * cfg.d_model * 8)
    assert run.p2p == [{"sent": x, "recv": x} for x in msg]
    assert run.in_flight == in_flight_formula(run.schedule)
    if not experts:  # the ledger's peak = per-chunk in-flight units x closed-form unit bytes
        unit = unit_bytes(cfg, run.schedule, run.split, 2, S, recompute)
        assert run.act_peak == peak_activation_bytes(run.schedule, unit)


def test_one_stage_with_chunks_sends_nothing():
    # p = 1, v = 3: the chunks pass activations to themselves; the run is the reference's
    cfg = _cfg(6)
    ref = reference_train(cfg, 0, _batches(cfg, 6), 2, microbatches=3)
    run = _run(cfg, 1, B=6, schedule="interleaved", microbatches=3, chunks=3)[0]
    worst, problems = compare_run(run, ref, rtol=0.0)
    assert not problems and worst == {"loss": 0.0, "grad": 0.0, "param": 0.0}
    assert run.p2p == [{"sent": 0, "recv": 0}] and boundary_bytes(run.schedule, 96) == [0]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_bytes_in_flight_and_activation_memory(name):
    p, m, cfg = 4, 8, _cfg(8)
    v = 2 if name == "interleaved" else 1
    run = _run(cfg, p, steps=1, schedule=name, microbatches=m, chunks=v)[0]
    b = 8 // m
    msg = b * S * cfg.d_model * 8  # one (b, S, H) float64 activation or gradient
    for s, got in enumerate(run.p2p):
        # every (micro-batch, chunk) sends its output on, except on the last virtual stage,
        # and its input gradient back, except on the first: v times 1F1B's crossings
        crossings, back = m * v - m * (s == p - 1), m * v - m * (s == 0)
        assert got == {"sent": (crossings + back) * msg, "recv": (crossings + back) * msg}
    assert run.in_flight == in_flight_formula(run.schedule)
    if name in ("gpipe", "1f1b"):  # peak bytes = peak units x bytes of one unit, exactly
        head = head_activation_bytes(cfg, b, S) - 8 * b * S
        for s in range(p):
            unit = len(run.split[s]) * activation_bytes_per_block(cfg, b, S)
            unit += 8 * b * S * (s == 0) + head * (s == p - 1)  # token ids; final LN, logits
            assert run.act_peak[s] == run.in_flight[s] * unit
    # every schedule: the per-chunk count of cached (and, ZB-H1, stashed) units x their bytes
    unit = unit_bytes(cfg, run.schedule, run.split, b, S)
    assert run.act_peak == peak_activation_bytes(run.schedule, unit)
    if name != "interleaved":
        assert run.act_peak == peak_closed_form(run.schedule, unit)
    if name == "gpipe":
        assert run.in_flight == [m] * p
    if name == "1f1b":
        assert run.in_flight == [p - s for s in range(p)]


def test_zb_h1_peak_is_1f1b_plus_the_w_stash_excess():
    # Qi et al. 2023, section 2.1: ZB-H1 keeps p micro-batches in flight on every stage, as
    # 1F1B's stage 0. In bytes: stage s holds (p-1-s) caches C, s stashes W and one more of the
    # larger: (p-1-s) C + s W + max(C, W). W - C per dense block = a b S (4 H - A S): the stash
    # keeps six output gradients but drops the probabilities, q, k, v and gelu's input.
    cfg, p, b = _cfg(4), 4, 1
    runs = {n: _run(cfg, p, steps=1, schedule=n, microbatches=8)[0] for n in ("1f1b", "zb-h1")}
    assert runs["zb-h1"].in_flight == [p] * p and runs["1f1b"].in_flight[0] == p
    block_excess = stash_bytes_per_block(cfg, b, S) - activation_bytes_per_block(cfg, b, S)
    assert block_excess == 8 * b * S * (4 * cfg.d_model - cfg.n_heads * S) == 960
    assert runs["zb-h1"].act_peak[0] == runs["1f1b"].act_peak[0] + 1 * block_excess
    one_f = runs["1f1b"].act_peak
    for s in range(1, p):  # 1F1B's p - s units become p: s of them as stashes
        c = one_f[s] // (p - s)  # one unit's cache on stage s
        w = stash_bytes_per_block(cfg, b, S)  # one block per stage, no ids after stage 0
        assert runs["zb-h1"].act_peak[s] == (p - 1 - s) * c + s * w + max(c, w)


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_dp_x_pp_mesh(mode, name):
    cfg = _cfg(4)
    opt = {"weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-6}  # not AdamW's defaults
    ref = reference_train(cfg, 0, _batches(cfg), 2, microbatches=4, max_norm=0.5, **opt)
    runs = _run(cfg, 4, mesh={"dp": 2, "pp": 2}, schedule=name, microbatches=2, dp_mode=mode,
                max_norm=0.5, **opt)  # fmt: skip
    stage_names = [stage_param_names(cfg, runs[0].split, s, 2) for s in range(2)]
    for r in runs:
        worst, problems = compare_run(r, ref, rtol=1e-12)
        assert not problems, problems
        assert worst["grad"] < 1e-14  # the dp sum adds in another order: not bitwise
        # every replica's stages move DDP's / ZeRO-1's bytes for their own parameters only
        assert r.dp_bytes == [dp_bytes(cfg, names, 2, mode) for names in stage_names]
    # independently: one bucket per stage (< 25 MB) of Psi_s parameters padded to a multiple of
    # D = 2; an all-reduce (DDP) or RS + AG (ZeRO-1) moves 2 (D-1)/D Psi_pad x 8 bytes
    for s, names in enumerate(stage_names):
        psi = sum(int(np.prod(runs[0].params[n].shape)) for n in names)
        assert runs[0].dp_bytes[s] == 2 * (-(-psi // 2) * 2) // 2 * 8 > 0


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="4 \\(virtual\\) stages but only L=2 blocks"):
        split_layers(2, 4)
    with pytest.raises(ValueError, match="covers 3 blocks, model has 4"):
        split_layers(4, 2, [1, 2])
    with pytest.raises(ValueError, match="each an int >= 1"):
        split_layers(4, 2, [0, 4])
    assert split_layers(5, 2) == [[0, 1, 2], [3, 4]]
    cfg = _cfg(4)
    with pytest.raises(ValueError, match="multiple of the stage count p=2"):
        _run(cfg, 2, schedule="interleaved", microbatches=1, chunks=2)
    with pytest.raises(ValueError, match="needs a Mesh with a 'dp' axis"):
        _run(cfg, 2, dp_mode="ddp")


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
@pytest.mark.parametrize("name", ["interleaved", "zb-h1"])
def test_lower_precision_is_bitwise_too(dtype, name):
    # bf16 activations cross the boundaries as bf16 (2 bytes); the arithmetic is the reference's
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=4, dtype=dtype)
    ref = reference_train(cfg, 0, _batches(cfg), 2, microbatches=4)
    run = _run(cfg, 2, schedule=name, microbatches=4, chunks=2 if name == "interleaved" else 1)[0]
    worst, problems = compare_run(run, ref, rtol=0.0)
    assert not problems and worst == {"loss": 0.0, "grad": 0.0, "param": 0.0}
    item = 2 if dtype == "mixed" else 4
    v = run.schedule.v  # stage 0 of 2: every chunk's output goes on, chunk 0's gradient does not
    assert run.p2p[0]["sent"] == (4 * v + 4 * v - 4) * (2 * S * 8 * item)


def _groups(step, mb, b, S):  # two routing groups per micro-batch: the two halves of its tokens
    n = b * S
    return [np.arange(n // 2), np.arange(n // 2, n)] if mb % 2 else None


@pytest.mark.parametrize("mesh", [None, {"dp": 2, "pp": 2}])
def test_moe_routing_groups(mesh):
    # groups_fn as reference_train's: a micro-batch's aux weight is its share of the step's groups
    cfg = _cfg(4, experts=2)
    ref = reference_train(cfg, 0, _batches(cfg), 2, microbatches=4, groups_fn=_groups)
    kw = {"dp_mode": "ddp", "microbatches": 2} if mesh else {"microbatches": 4}
    runs = _run(cfg, 4 if mesh else 2, mesh=mesh, schedule="zb-h1", groups_fn=_groups, **kw)
    worst, problems = compare_run(runs[0], ref, rtol=1e-12)
    assert not problems, problems
    if mesh is None:  # the reference's arithmetic, in its order
        assert worst["grad"] == worst["param"] == 0.0


def test_a_user_built_schedule_runs_after_validation():
    cfg = _cfg(4)
    ref = reference_train(cfg, 0, _batches(cfg), 2, microbatches=4)
    # stage 0 runs GPipe's order, stage 1 1F1B's: a valid mix nobody ships
    mine = Schedule("mine", 2, 4, 1, False, [gpipe(2, 4).stages[0], one_f_one_b(2, 4).stages[1]])
    run = _run(cfg, 2, schedule=mine)[0]
    _, problems = compare_run(run, ref, rtol=0.0)  # bitwise
    assert not problems and run.schedule.stages == mine.stages
    assert run.in_flight == [4, 1]
    bad = Schedule("bad", 2, 4, 1, False, [list(mine.stages[0]), list(mine.stages[1])])
    bad.stages[1][0], bad.stages[1][1] = Action("B", 0), Action("F", 0)
    with pytest.raises(ValueError, match="bad: stage 1 action #0 B0 runs before F0"):
        _run(cfg, 2, schedule=bad)
    with pytest.raises(ValueError, match="built for p=2 stages but the pipeline group has 4"):
        _run(cfg, 4, schedule=mine)
    with pytest.raises(ValueError, match="microbatches=8 but the given schedule 'mine' has 4"):
        _run(cfg, 2, schedule=mine, microbatches=8)
    with pytest.raises(TypeError, match="give a name in"):
        _run(cfg, 2, schedule=3)
    with pytest.raises(ValueError, match="B/W split needs the blocks' caches"):
        _run(cfg, 2, schedule="zb-h1", recompute="full")
