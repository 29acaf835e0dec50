"""Shared by test_ddp.py and test_zero.py: run a data-parallel layout and its reference."""

from __future__ import annotations

import emulator
from emulator.check import compare
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel.dp_train import train_data_parallel

F64 = 1e-12  # float64: summation order differs (ring vs sequential), so ~1e-16 per add


def tiny(dtype="float64", **kw):
    base = {"vocab_size": 16, "max_seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": 2}
    base["dtype"] = dtype
    return ModelConfig(**(base | kw))


def run_both(cfg, D, *, stage, B=8, S=6, steps=2, microbatches=1, max_norm=0.3, **kw):
    batches = lambda s: synthetic_batch(3, s, B, S, cfg.vocab_size)
    groups_fn = kw.pop("groups_fn", None)
    ref = reference_train(cfg, 1, batches, steps, microbatches=D * microbatches,
                          max_norm=max_norm, groups_fn=groups_fn)  # fmt: skip
    runs = emulator.spawn(
        lambda c: train_data_parallel(c, cfg, 1, batches, steps, stage=stage,
                                      microbatches=microbatches, max_norm=max_norm,
                                      groups_fn=groups_fn, **kw),
        D, timeout=30,
    )  # fmt: skip
    return runs, ref


def assert_matches(run, ref, rtol=F64):
    for got, want, what in (
        (run.params, ref.params, "param"),
        (run.grads, ref.grads, "grad"),
        (run.opt_state["m"], ref.opt_state["m"], "adam m"),
        (run.opt_state["v"], ref.opt_state["v"], "adam v"),
    ):
        _, problems = compare(got, want, rtol, what)
        assert not problems, "\n".join(problems)
    for a, b in zip(run.losses, ref.losses, strict=True):
        assert abs(a - b) <= rtol * abs(b), (run.losses, ref.losses)
    assert run.opt_state["step"] == ref.opt_state["step"]
