"""LayerContext: the single-rank context is the reference's pieces, bitwise; attention and MoE
drop-ins (how context / expert parallelism plug in) are called by every block path."""

from __future__ import annotations

import numpy as np

import emulator
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, init_params, model_backward, model_forward
from emulator.moe import moe_backward, moe_forward
from emulator.ops import attention_backward, attention_forward
from parallel.layer import LayerContext
from parallel.pipeline.executor import OneStage, run_schedule
from parallel.pipeline.schedules import make_schedule
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard

CFG = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, n_experts=2,
                  moe_top_k=2, capacity_factor=2.0)  # fmt: skip


def _counted(calls):
    """Drop-ins with emulator's signatures that count their calls and delegate."""

    def wrap(key, fn):
        def f(*a, **k):
            calls[key] = calls.get(key, 0) + 1
            return fn(*a, **k)

        return f

    return {"attention": (wrap("af", attention_forward), wrap("ab", attention_backward)),
            "moe": (wrap("mf", moe_forward), wrap("mb", moe_backward))}  # fmt: skip


def _drive(ctx, params, tokens, targets, schedule="1f1b"):
    sched = make_schedule(schedule, 1, 1)
    grads, loss, _, _ = run_schedule(OneStage(), sched, [[0, 1]], params, [(tokens, targets)],
                                     CFG, ce_denom=tokens.size, aux_scales=[1.0], ctx=ctx)  # fmt: skip
    return grads, loss


def test_single_rank_context_and_drop_ins_are_bitwise_the_reference():
    params = init_params(CFG, 0)
    tokens, targets = synthetic_batch(1, 0, 2, 6, CFG.vocab_size)
    loss, cache = model_forward(params, tokens, targets, CFG)
    want = model_backward(cache)
    for schedule in ("1f1b", "zb-h1"):  # the B/W split path calls the drop-ins too
        calls = {}
        for ctx in (LayerContext(), LayerContext(**_counted(calls))):
            grads, got = _drive(ctx, params, tokens, targets, schedule)
            assert abs(got - loss) < 1e-15
            assert all(np.array_equal(grads[n], want[n]) for n in want), schedule
        assert calls == {"af": 2, "ab": 2, "mf": 2, "mb": 2}, (schedule, calls)


def test_tp_blocks_call_the_attention_drop_in():
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2)
    tokens, targets = synthetic_batch(1, 0, 2, 6, cfg.vocab_size)

    def main(comm):
        calls = {}
        drop = _counted(calls)["attention"]
        p = shard(init_params(cfg, 0), megatron_plan(cfg), comm.rank, 2)
        out = []
        for ctx in (LayerContext(tp=comm), LayerContext(tp=comm, attention=drop)):
            sched = make_schedule("1f1b", 1, 1)
            g, _, _, _ = run_schedule(OneStage(), sched, [[0, 1]], p, [(tokens, targets)], cfg,
                                      ce_denom=tokens.size, aux_scales=[1.0], ctx=ctx)  # fmt: skip
            out.append(g)
        same = all(np.array_equal(out[0][n], out[1][n]) for n in out[0])
        return same, calls

    for same, calls in emulator.spawn(main, 2):
        assert same and calls == {"af": 2, "ab": 2}
