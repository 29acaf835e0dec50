"""parallel.train with ep > 1 under MPI: == the reference (1e-12) and bitwise == the same
layout on virtual ranks (the reduction order is fixed), both dispatch modes, ZeRO x ep and
cp x ep (4 ranks: dp 2 x cp 2)."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
import parallel
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import Layout
from parallel.context.layout import table
from parallel.context.train import routing_groups

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(
    "dispatch,zero,cp", [("exact", 0, 1), ("padded", 0, 1), ("exact", 2, 1), ("padded", 3, 1),
                         ("exact", 1, 2), ("padded", 0, 2)]
)  # fmt: skip
def test_ep_in_parallel_train_under_mpi(comm, dispatch, zero, cp):
    if comm.size % (2 * cp):
        pytest.skip(f"cp={cp} x ep=2 needs dp >= ep = 2: {2 * cp} ranks")
    P = comm.size // cp  # -n 2: dp2 x ep2; -n 4: dp4 x ep2 (edp 2), or dp2 x ep2 x cp2
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2,
                      n_experts=4, moe_top_k=2, capacity_factor=0.75)  # fmt: skip
    layout = Layout(dp=P, ep=2, cp=cp, zero=zero, microbatches=2, dispatch=dispatch)
    S = 4 * cp
    batches = lambda s: synthetic_batch(11, s, 2 * P, S, cfg.vocab_size)
    hyper = {"weight_decay": 0.1, "lr": 3e-3, "max_norm": 0.3}
    tab = table(S, cp, layout.cp_balance)  # cp: each cp rank's tokens one routing group
    groups_fn = (lambda step, j, b, s: routing_groups(b, s, tab)) if cp > 1 else None

    def fn(c):
        return parallel.train(c, layout, cfg, batches, 2, **hyper)

    mark = comm.ledger.mark()
    try:
        mine = fn(comm)
    finally:  # the session's ledger is shared: other tests read it whole
        del comm.ledger.records[mark:]
    local = emulator.spawn(fn, comm.size, timeout=60)[comm.rank]
    ref = reference_train(cfg, 0, batches, 2, microbatches=2 * P, groups_fn=groups_fn, **hyper)
    assert not compare_run(mine, ref, 1e-12)[1]
    assert mine.replica_mismatch == [] and local.replica_mismatch == []
    assert mine.losses == local.losses and mine.step_bytes == local.step_bytes
    for n in mine.local_params:
        assert np.asarray(mine.local_params[n]).tobytes() == local.local_params[n].tobytes(), n
