"""Shared by test_ddp.py and test_zero.py: run a data-parallel layout and its reference."""

from __future__ import annotations

import emulator
from emulator.check import compare_replicas
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, n_params
from emulator.reference import reference_train
from parallel.check.data import compare_dp
from parallel.check.routing import reference_routes
from parallel.data.cost import peak_memory, static_memory, step_bytes
from parallel.data.train import train_data_parallel


def tiny(dtype="float64", **kw):
    base = {"vocab_size": 16, "max_seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": 2}
    base["dtype"] = dtype
    return ModelConfig(**(base | kw))


# Not AdamW's defaults (weight decay 0, betas (0.9, 0.95), eps 1e-8): a layout that ignored
# weight decay or hard-coded a beta would pass a test run with the defaults on both sides.
OPT = {"weight_decay": 0.1, "betas": (0.8, 0.99), "eps": 1e-6}


def run_both(cfg, D, *, stage, B=8, S=6, steps=2, microbatches=1, max_norm=0.3, **kw):
    """(every rank's DPRun, the reference); MoE: ref.routes = the reference's routing. Both
    train with the non-default optimizer settings OPT (override them through kw)."""
    batches = lambda s: synthetic_batch(3, s, B, S, cfg.vocab_size)
    groups_fn = kw.pop("groups_fn", None)
    opt = {k: kw.pop(k, v) for k, v in (OPT | {"recompute": "none"}).items()}
    kw.setdefault("poison_freed", True)  # ZeRO-3: a read of a freed gather becomes NaN
    ref = reference_train(cfg, 1, batches, steps, microbatches=D * microbatches,
                          max_norm=max_norm, groups_fn=groups_fn, **opt)  # fmt: skip
    if cfg.is_moe:
        ref.routes = reference_routes(cfg, 1, batches, steps, microbatches=D * microbatches,
                                      max_norm=max_norm, groups_fn=groups_fn, **opt)  # fmt: skip
    runs = emulator.spawn(
        lambda c: train_data_parallel(c, cfg, 1, batches, steps, stage=stage,
                                      microbatches=microbatches, max_norm=max_norm,
                                      groups_fn=groups_fn, **opt, **kw),
        D, timeout=30,
    )  # fmt: skip
    return runs, ref


def assert_matches(runs, ref, dtype="float64", top_k=1) -> str:
    """parallel.check.data.compare_dp: losses, grads, params (mixed: updates), Adam m and v at
    the dtype's measured tolerance (float64 1e-12, float32 1e-4, mixed: see dp_compare); MoE:
    routing first - for rank 0's run, and every other rank's replica of losses, gradients,
    parameters and Adam state bitwise equal to rank 0's (emulator.check.compare_replicas).
    ``runs``: every rank's DPRun (or one run). -> what was compared."""
    runs = runs if isinstance(runs, list) else [runs]
    _, problems, note = compare_dp(runs[0], ref, dtype, getattr(ref, "routes", None), top_k)
    states = [{"losses": r.losses, "grads": r.grads, "params": r.params,
               "adam m": r.opt_state["m"], "adam v": r.opt_state["v"]} for r in runs]  # fmt: skip
    problems += compare_replicas(states, ("losses", "grads", "params", "adam m", "adam v"))
    assert not problems, "\n".join(problems)
    assert all(r.opt_state["step"] == ref.opt_state["step"] for r in runs)
    return note


def check_formulas(runs, cfg, stage, k=1, reshard=True, prefetch=False, B=8, S=6,
                   recompute="none"):  # fmt: skip
    """Every rank, every step: bytes sent == received == formula; static memory and the peak
    of params, grads and activations == parallel.data.cost's closed forms."""
    want = step_bytes(stage, runs[0].layouts, cfg.dtype, k, reshard)
    D = runs[0].layouts[0].D
    for r in runs:
        for sb in r.step_bytes:
            assert sb["grads"] == (want["grads"],) * 2, (sb, want)
            assert sb["params"] == (want["params"],) * 2, (sb, want)
        mem = static_memory(stage, r.layouts, n_params(cfg), cfg.dtype)
        assert {c: r.memory["current"][c] for c in mem} == mem
        peak = peak_memory(stage, r.layouts, n_params(cfg), cfg, B // (D * k), S,
                           reshard_after_forward=reshard, prefetch=prefetch,
                           recompute=recompute)  # fmt: skip
        assert {c: r.memory["peak"][c] for c in peak} == peak, (stage, r.memory["peak"], peak)
