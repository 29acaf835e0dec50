"""Context parallelism through parallel.train under MPI: cp x dp (2 processes: cp 2; 4: cp 2 x
tp 2, zigzag ring and ulysses; with sequence parallelism, 4 only: ring and all-gather) equals the
single-rank reference (float64 1e-12), sends nd_cost.rank_bytes on every process, and is bitwise
the run of the same layout on virtual ranks."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
import parallel
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import Layout, nd_cost

pytestmark = pytest.mark.mpi

HYPER = {"weight_decay": 0.1, "lr": 3e-3, "max_norm": 0.3}


@pytest.mark.parametrize("method,sp", [("ring", False), ("ulysses", False), ("ring", True),
                                       ("all-gather", True)])  # fmt: skip
def test_cp_train_under_mpi_equals_reference_and_virtual(comm, method, sp):
    n = comm.size
    if sp and n < 4:
        pytest.skip("sequence parallelism needs tp > 1: cp 2 x tp 2 (mpiexec -n 4)")
    layout = Layout(cp=2, tp=n // 2, cp_method=method, recompute="selective",
                    sequence_parallel=sp)  # fmt: skip
    cfg = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=4, n_layers=2, d_ff=16)
    batches = lambda s: synthetic_batch(7, s, 2, 8, cfg.vocab_size)
    run = parallel.train(comm, layout, cfg, batches, 2, **HYPER)
    virtual = emulator.spawn(lambda c: parallel.train(c, layout, cfg, batches, 2, **HYPER), n,
                             timeout=120)[comm.rank]  # fmt: skip
    ref = reference_train(cfg, 0, batches, 2, **HYPER)
    _, problems = compare_run(run, ref, 1e-12)
    assert not problems, problems[:4]
    assert run.step_bytes == [nd_cost.rank_bytes(cfg, layout, 2, 8, run.coords)] * 2
    assert run.losses == virtual.losses
    for name, p in run.local_params.items():
        assert np.array_equal(p, virtual.local_params[name]), name
