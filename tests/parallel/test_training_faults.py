"""Training faults end in a named error, in the reference and in every layout: invalid
hyper-parameters and counts up front (ValueError naming the argument), a non-finite loss at the
step it happens (NonFiniteError naming step and rank)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import emulator
from emulator.data import synthetic_batch
from emulator.guards import NonFiniteError, check_finite, check_hyper
from emulator.model import ModelConfig, init_params
from emulator.optim import AdamW
from emulator.reference import reference_train
from parallel.context.train import cp_train
from parallel.data.train import train_data_parallel
from parallel.data.zero import ZeroOptimizer
from parallel.expert.train import ep_train
from parallel.pipeline.train import pipeline_train
from parallel.tensor.train import tp_train

CFG = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2)
MOE = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, n_experts=4)
BATCHES = lambda s: synthetic_batch(3, s, 8, 6, 16)

BAD_HYPER = [  # (keyword, value, the argument the message must name)
    ("lr", math.inf, "lr=inf"),
    ("lr", math.nan, "lr=nan"),
    ("lr", -1e-3, "lr=-0.001"),
    ("eps", 0.0, "eps=0.0"),
    ("eps", -1e-8, "eps=-1e-08"),
    ("eps", math.inf, "eps=inf"),
    ("betas", (0.9, 1.0), "betas=(0.9, 1.0)"),
    ("betas", (-0.1, 0.9), "betas=(-0.1, 0.9)"),
    ("betas", (math.nan, 0.9), "betas=(nan, 0.9)"),
    ("weight_decay", math.inf, "weight_decay=inf"),
    ("weight_decay", math.nan, "weight_decay=nan"),
    ("weight_decay", -0.1, "weight_decay=-0.1"),
    ("max_norm", math.nan, "max_norm=nan"),
    ("max_norm", -1.0, "max_norm=-1.0"),
]


def _spawn(train, **kw):
    """train(comm, steps, **kw) on 2 virtual ranks; steps popped once, before any rank starts."""
    steps = kw.pop("steps", 2)
    return emulator.spawn(lambda c: train(c, steps, **kw), 2, timeout=30)


# every trainer, called with keyword overrides (steps default 2) on the ranks it needs
TRAINERS = {
    "reference": lambda steps=2, **kw: reference_train(CFG, 1, BATCHES, steps, **kw),
    "ddp": lambda **kw: _spawn(lambda c, n, **a: train_data_parallel(c, CFG, 1, BATCHES, n, **a),
                               **kw),
    "zero3": lambda **kw: _spawn(
        lambda c, n, **a: train_data_parallel(c, CFG, 1, BATCHES, n, stage=3, **a), **kw),
    "tp": lambda **kw: _spawn(lambda c, n, **a: tp_train(c, CFG, 1, BATCHES, n, **a), **kw),
    "pp": lambda **kw: _spawn(lambda c, n, **a: pipeline_train(c, CFG, 1, BATCHES, n, **a),
                              **({"microbatches": 2} | kw)),
    "cp": lambda **kw: _spawn(lambda c, n, **a: cp_train(c, CFG, 1, BATCHES, n, cp=2, balance="contiguous", **a), **kw),
    "ep": lambda **kw: _spawn(lambda c, n, **a: ep_train(c, MOE, 1, BATCHES, n, ep=2, **a), **kw),
}  # fmt: skip


@pytest.mark.parametrize(("key", "value", "named"), BAD_HYPER)
def test_bad_hyper_parameter_is_named(key, value, named):
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0} | {key: value}
    with pytest.raises(ValueError, match="^where: " + re.escape(named)):
        check_hyper(**hyper, where="where")
    if key != "max_norm":
        with pytest.raises(ValueError, match="AdamW: " + key):
            AdamW({"w": np.zeros(2)}, **{key: value})
        with pytest.raises(ValueError, match="ZeroOptimizer: " + key):
            emulator.spawn(lambda c: ZeroOptimizer(c, {"w": np.zeros(4)}, 1, **{key: value}), 2,
                           timeout=30)  # fmt: skip


@pytest.mark.parametrize("trainer", sorted(TRAINERS))
@pytest.mark.parametrize(("key", "value"), [("lr", math.inf), ("eps", 0.0), ("max_norm", -1.0),
                                            ("weight_decay", math.nan), ("steps", 0),
                                            ("steps", -2), ("microbatches", 0)])  # fmt: skip
def test_every_trainer_refuses_bad_arguments_up_front(trainer, key, value):
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r}")):
        TRAINERS[trainer](**{key: value})


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow this test provokes
@pytest.mark.parametrize("trainer", sorted(TRAINERS))
def test_first_non_finite_loss_stops_with_step_and_rank(trainer):
    """lr = 1e300 is a valid, finite number: the first update sends the parameters to ~1e300
    and the step-1 forward overflows. Without the check the run finished with NaN losses."""
    with pytest.raises(NonFiniteError, match=r"^step 1: .* rank \d"):
        TRAINERS[trainer](lr=1e300, steps=3)


def test_check_finite_names_the_first_bad_rank_and_the_norm():
    with pytest.raises(NonFiniteError, match="step 4: non-finite loss share nan on rank 2"):
        check_finite(4, rank=0, losses=[1.0, 2.0, math.nan, math.inf])
    with pytest.raises(NonFiniteError, match="step 0: non-finite gradient norm inf on rank 3"):
        check_finite(0, rank=3, loss=1.0, grad_norm=math.inf)
    check_finite(0, rank=0, loss=1.0, grad_norm=2.0, losses=[0.5, 0.5])  # finite: no error


def test_adamw_rejects_what_used_to_slip_through():
    """Before: AdamW accepted lr=inf and eps=0 (its check was lr >= 0, eps >= 0); eps = 0
    turns a zero gradient entry into 0/0 at step 1."""
    p = init_params(CFG, 0)
    for bad in ({"lr": math.inf}, {"eps": 0.0}, {"weight_decay": math.inf}):
        with pytest.raises(ValueError):
            AdamW(p, **bad)
