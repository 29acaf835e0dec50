"""Checks that must be able to fail: each test plants the bug its check exists for and shows
the check rejecting it (and, where it matters, the former check accepting it)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import emulator
from collectives import cost
from emulator.check import compare_replicas
from emulator.guards import NonFiniteError
from emulator.model import init_params, n_params
from emulator.optim import adamw_update
from emulator.rank import current_state
from parallel.check.data import compare_dp
from parallel.data import common as dp_common
from parallel.data import train as dp_train
from parallel.data import zero as zero_mod
from parallel.data.cost import init_broadcast_bytes
from parallel.data.ddp import DDP
from parallel.data.replica import BucketAdamW
from parallel.data.train import train_data_parallel

from .helpers import OPT, assert_matches, run_both, tiny


def test_a_ddp_rank_that_skips_its_last_step_fails_the_replica_check(monkeypatch):
    """Rank 1 of 4 skips its last AdamW step. Rank 0's run still equals the reference (the
    former check, compare_dp on runs[0] only, passed); the replica check names rank 1."""

    class SkipLast(BucketAdamW):  # DDP's AdamW (per bucket: parallel/data/replica.py)
        def step(self, grad_flats):
            if current_state().rank == 1 and self.step_count == 2:  # the 3rd and last step
                self.step_count += 1
                return
            super().step(grad_flats)

    monkeypatch.setattr(dp_train, "BucketAdamW", SkipLast)
    cfg = tiny()
    runs, ref = run_both(cfg, 4, stage="ddp", microbatches=2, steps=3)
    assert not compare_dp(runs[0], ref, "float64")[1]  # rank 0 alone looks right
    with pytest.raises(AssertionError, match="replicas differ: rank 1's params"):
        assert_matches(runs, ref)


def test_zero_ignoring_weight_decay_fails_with_the_layout_tests_settings(monkeypatch):
    """ZeRO's shard update drops weight decay. With AdamW's defaults on both sides (decay 0,
    what the layout tests used) it passes; with the tests' OPT settings (decay 0.1) it fails."""

    def no_decay(p, g, m, v, step, **hyper):
        adamw_update(p, g, m, v, step, **(hyper | {"weight_decay": 0.0}))

    monkeypatch.setattr(zero_mod, "adamw_update", no_decay)
    cfg = tiny()
    defaults = {"weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-8}
    runs, ref = run_both(cfg, 2, stage="1", steps=2, **defaults)
    assert_matches(runs, ref)  # the bug is invisible at weight_decay = 0
    runs, ref = run_both(cfg, 2, stage="1", steps=2)  # OPT: weight_decay 0.1
    assert OPT["weight_decay"] > 0
    with pytest.raises(AssertionError, match="param .* max rel diff"):
        assert_matches(runs, ref)


def test_ddp_broadcasts_rank_0s_initial_parameters_counted_under_its_tag():
    """Replicas built from different seeds (seed = rank) train as the reference from rank 0's
    seed; the one broadcast moves exactly the binomial tree's bytes, under ddp/init_broadcast,
    and no byte of it falls into a step (step bytes still equal their formulas)."""
    cfg = tiny()
    D, steps = 3, 2
    from emulator.data import synthetic_batch
    from emulator.reference import reference_train

    batches = lambda s: synthetic_batch(3, s, 6, 6, cfg.vocab_size)
    ref = reference_train(cfg, 0, batches, steps, microbatches=D, **OPT)

    def body(comm):
        run = train_data_parallel(comm, cfg, comm.rank, batches, steps, **OPT)
        L = comm.ledger
        return run, (L.sent(tag="ddp/init_broadcast"), L.received(tag="ddp/init_broadcast"))

    out = emulator.spawn(body, D, timeout=30)
    assert_matches([r for r, _ in out], ref)
    psi = n_params(cfg)
    for rank, (_, got) in enumerate(out):
        # tree broadcast from 0 over 3 ranks: rank 0 sends to 1 and 2 (2 Psi 8 B), they receive
        assert got == init_broadcast_bytes(psi, D, 8, rank) == cost.tree_broadcast(psi, D, 8, rank)
    assert [g for _, g in out] == [(2 * psi * 8, 0), (0, psi * 8), (0, psi * 8)]


def test_without_the_broadcast_different_seeds_diverge_and_the_replica_check_says_so():
    cfg = tiny()

    def body(comm):
        params = init_params(cfg, comm.rank)
        DDP(comm, params, broadcast_init=False)  # the bug: no initial broadcast
        return {"params": params}

    problems = compare_replicas(emulator.spawn(body, 2, timeout=30), ("params",))
    assert problems and problems[0].startswith("replicas differ: rank 1's params")

    def fixed(comm):
        params = init_params(cfg, comm.rank)
        DDP(comm, params)
        return {"params": params}

    out = emulator.spawn(fixed, 2, timeout=30)
    assert not compare_replicas(out, ("params",))
    want = init_params(cfg, 0)
    assert all(np.array_equal(out[1]["params"][n], want[n]) for n in want)


def _zero_optimizer_bytes(monkeypatch, moment_dtype=None):
    """ZeRO-1, mixed, D = 4: this rank's ledger 'optimizer' bytes and Psi_pad."""
    if moment_dtype is not None:  # the bug: Adam moments kept in bf16, not the fp32 master's
        original = zero_mod.ZeroOptimizer._account

        def account(self):
            self.m = {i: a.astype(moment_dtype) for i, a in self.m.items()}
            self.v = {i: a.astype(moment_dtype) for i, a in self.v.items()}
            original(self)

        monkeypatch.setattr(zero_mod.ZeroOptimizer, "_account", account)
    params = init_params(tiny("mixed"), 0)

    def body(comm):
        opt = zero_mod.ZeroOptimizer(comm, params, 1, dtype="mixed", mem=comm.memory)
        got = comm.memory.current("optimizer")
        opt.close()
        return got, sum(lay.padded for lay in opt.layouts)

    return emulator.spawn(body, 4, timeout=30)


def test_ledger_charges_the_bytes_held_so_a_bf16_adam_moment_shows(monkeypatch):
    """The paper's K = 12 per parameter in mixed precision: fp32 master (4, counted under
    params) + fp32 m and v (8) - so the optimizer entry is 2 x 4 x Psi_pad / D, written here
    from the paper, not from the products the implementation charges."""
    for got, pad in _zero_optimizer_bytes(monkeypatch):
        assert got == 2 * 4 * pad // 4
    for got, pad in _zero_optimizer_bytes(monkeypatch, ml_dtypes.bfloat16):
        assert got == 2 * 2 * pad // 4 != 2 * 4 * pad // 4  # the ledger shows the halved state


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN arithmetic in the poisoned run
def test_a_backward_reading_the_forwards_freed_gather_fails_when_freed_units_are_poisoned(
    monkeypatch,
):
    """The bug: the backward computes with the arrays the forward's gather bound into its
    caches (no rebind to the backward's own gather). The freed buffer still holds the right
    values, so without poisoning the run passes; with poison_freed=True (passed explicitly,
    what run_both does) it reads NaN and stops."""
    monkeypatch.setattr(dp_common, "rebind", lambda obj, table: obj)
    cfg = tiny()
    runs, ref = run_both(cfg, 2, stage="3", steps=2, poison_freed=False)
    assert_matches(runs, ref)  # invisible without the poison
    with pytest.raises(NonFiniteError, match="step 0"):
        run_both(cfg, 2, stage="3", steps=2, poison_freed=True)
