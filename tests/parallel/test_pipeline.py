"""Pipelined training equals the single-rank reference; bytes, in-flight and memory by formula."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.flops import activation_bytes_per_block, head_activation_bytes
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel.bubble import in_flight_formula
from parallel.pipeline import split_layers
from parallel.pipeline_train import pipeline_train

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
    v, m = (2 if name == "interleaved" else 1), p * k
    L = data.draw(st.integers(p * v, p * v + 2))
    sizes = None
    if data.draw(st.booleans()) and L > p * v:  # an explicit uneven split: one fat stage
        sizes = [1] * (p * v)
        sizes[data.draw(st.integers(0, p * v - 1))] += L - p * v
    cfg = _cfg(L, experts)
    ref = reference_train(cfg, 0, _batches(cfg, 2 * m), 2, microbatches=m, max_norm=clip)
    runs = _run(cfg, p, B=2 * m, schedule=name, microbatches=m, chunks=v, sizes=sizes,
                max_norm=clip)  # fmt: skip
    worst, problems = compare_run(runs[0], ref, rtol=1e-12)
    assert not problems, problems
    if clip is None:  # same arithmetic in the same order: bitwise (the reported loss adds
        # the stages' MoE aux shares in another order: a last-bit difference at most)
        assert worst["grad"] == worst["param"] == 0.0 and worst["loss"] < 1e-15
    assert [r.losses for r in runs] == [runs[0].losses] * p


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
    if name == "gpipe":
        assert run.in_flight == [m] * p
    if name == "1f1b":
        assert run.in_flight == [p - s for s in range(p)]


def test_zb_h1_stage0_memory_is_about_1f1b():
    # Qi et al. 2023, section 2.1: ZB-H1 keeps stage 0 at 1F1B's p micro-batches in flight.
    # In bytes it is slightly above: while B walks down the stage, each block's W stash
    # (its linears' inputs and output gradients, dW = x^T dy) replaces its cache, and the
    # stash of a block (dy of q, k, v, w1 ...) is a little larger than the cache it frees.
    cfg = _cfg(4)
    runs = {n: _run(cfg, 4, steps=1, schedule=n, microbatches=8)[0] for n in ("1f1b", "zb-h1")}
    assert runs["zb-h1"].in_flight[0] == runs["1f1b"].in_flight[0] == 4
    assert runs["1f1b"].act_peak[0] <= runs["zb-h1"].act_peak[0] < 1.1 * runs["1f1b"].act_peak[0]


@pytest.mark.parametrize("mode", ["ddp", "zero1"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_dp_x_pp_mesh(mode, name):
    cfg = _cfg(4)
    ref = reference_train(cfg, 0, _batches(cfg), 2, microbatches=4, max_norm=0.5)
    runs = _run(cfg, 4, mesh={"dp": 2, "pp": 2}, schedule=name, microbatches=2, dp_mode=mode,
                max_norm=0.5)  # fmt: skip
    for r in runs:
        worst, problems = compare_run(r, ref, rtol=1e-12)
        assert not problems, problems
        assert worst["grad"] < 1e-14  # the dp sum adds in another order: not bitwise


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
