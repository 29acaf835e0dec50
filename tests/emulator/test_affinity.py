"""emulator/affinity.py: virtual ranks share one core while their work is small, and give the
cores back; MPI-like comms and disabled calls change nothing."""

import os
import sys

import pytest

import emulator
import parallel
from emulator.affinity import ONE_CORE_FLOPS, one_core, shares_memory
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from parallel.layout import Layout
from parallel.train import block_flops

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a platform that sets thread affinity and at least two allowed cores",
)


def test_ranks_share_one_core_inside_and_get_their_cores_back():
    def body(c):
        before = os.sched_getaffinity(0)
        with one_core(c) as pinned:
            inside = os.sched_getaffinity(0)
        return pinned, before, inside, os.sched_getaffinity(0)

    out = emulator.spawn(body, 4)
    cores = {frozenset(inside) for _, _, inside, _ in out}
    assert all(pinned for pinned, *_ in out)
    assert len(cores) == 1 and len(next(iter(cores))) == 1, f"ranks ran on {cores}"
    assert all(after == before for _, before, _, after in out), "a rank kept the pin"


def test_disabled_or_not_virtual_ranks_change_nothing():
    class ProcessRanks:  # an MPI-like comm: ranks are processes, nothing is shared
        rank, size = 0, 1

    before = os.sched_getaffinity(0)
    for comm, enabled in ((ProcessRanks(), True), (None, True)):
        assert not shares_memory(comm)
        with one_core(comm, enabled) as pinned:
            assert not pinned and os.sched_getaffinity(0) == before

    def body(c):
        with one_core(c, False) as pinned:
            return pinned, os.sched_getaffinity(0) == before

    assert emulator.spawn(body, 2) == [(False, True)] * 2


def test_train_pins_small_runs_only_and_restores(monkeypatch):
    small = ModelConfig(vocab_size=64, max_seq_len=8, d_model=16, n_heads=2, n_layers=1)
    big = ModelConfig(vocab_size=256, max_seq_len=64, d_model=256, n_heads=4, n_layers=4)
    lay = Layout(tp=2)
    assert block_flops(small, lay, (4, 8)) < ONE_CORE_FLOPS < block_flops(big, lay, (16, 64))
    batches = [synthetic_batch(0, 0, 4, 8, 64)]
    module = sys.modules["parallel.train"]
    real, seen = module._train, []

    def probe(*a, **k):  # the rank thread's cores while the run trains
        seen.append(len(os.sched_getaffinity(0)))
        return real(*a, **k)

    monkeypatch.setattr(module, "_train", probe)

    def body(c):
        before = os.sched_getaffinity(0)
        parallel.train(c, lay, small, batches, 1)
        parallel.train(c, lay, small, batches, 1, one_core=False)
        return os.sched_getaffinity(0) == before

    assert emulator.spawn(body, 2) == [True, True]
    assert sorted(seen) == [1, 1] + [len(os.sched_getaffinity(0))] * 2
