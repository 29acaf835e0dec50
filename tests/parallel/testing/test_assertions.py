"""The kit's assertions pass on correct layouts and fail, naming rank and tensor, on planted
bugs: a replica that diverged on one rank, traffic nobody predicted, a wrong memory figure."""

import numpy as np
import pytest

import emulator
from collectives import all_reduce
from emulator.model import ModelConfig
from parallel.data.train import train_data_parallel
from parallel.testing import (
    assert_bytes,
    assert_memory,
    check_layout,
    on_virtual_ranks,
    run_on_virtual_ranks,
)

CFG = ModelConfig(vocab_size=16, max_seq_len=6, d_model=8, n_heads=2, n_layers=2)


def ddp(comm, cfg, seed, batches, steps, **optim):
    return train_data_parallel(comm, cfg, seed, batches, steps, stage="ddp", **optim)


def test_check_layout_passes_ddp_with_weight_decay():
    worst = check_layout(ddp, CFG, 4, steps=2, ref_microbatches=4, weight_decay=0.1, lr=3e-3)
    assert worst["param"] < 1e-12 and worst["grad"] < 1e-12


def test_check_layout_names_the_one_replica_that_diverged():
    def rank1_skips_last_update(comm, cfg, seed, batches, steps, **optim):
        run = ddp(comm, cfg, seed, batches, steps, **optim)
        if comm.rank == 1:  # as if rank 1 had run one step fewer
            run.params = ddp(comm.group([1]), cfg, seed, batches, steps - 1).params
        return run

    with pytest.raises(AssertionError) as err:
        check_layout(rank1_skips_last_update, CFG, 2, steps=2, ref_microbatches=2)
    assert str(err.value).startswith("rank 1: ") and "rank 0" not in str(err.value)
    assert "param embed.tok" in str(err.value)


def test_check_layout_refuses_a_run_of_no_steps():
    with pytest.raises(ValueError, match="steps=0"):
        check_layout(ddp, CFG, 2, steps=0)


def test_assert_bytes_exact_patterns_and_unpredicted_traffic():
    @on_virtual_ranks(4)
    def body(comm):
        with emulator.scope("a"):
            all_reduce(comm, np.ones(8), algorithm="ring")  # 2 (p-1)/p x 64 B = 96 B
        with emulator.scope("b"):
            all_reduce(comm, np.ones(4), algorithm="ring")  # 48 B
        assert_bytes(comm.ledger, {"a": 96, "b": 48})
        assert_bytes(comm.ledger, {"*": 144}, direction="recv")
        with pytest.raises(AssertionError, match="'a': 96 != expected 95"):
            assert_bytes(comm.ledger, {"a": 95, "b": 48})
        with pytest.raises(AssertionError, match="tags nothing expected: {'b': 48}"):
            assert_bytes(comm.ledger, {"a": 96})
        assert_bytes(comm.ledger, {"a": 96}, exhaustive=False)

    body()


def test_assert_memory_current_and_peak():
    mem = emulator.MemoryLedger()
    mem.alloc("params", "w", 100)
    mem.alloc("activations", "x", 40)
    mem.free("activations", "x")
    assert_memory(mem, {"params": 100, "activations": 40})
    assert_memory(mem, {"activations": 0}, which="current")
    with pytest.raises(AssertionError, match="peak activations bytes: 40 != expected 0"):
        assert_memory(mem, {"activations": 0})


def test_virtual_world_fixture_runs_every_rank_and_reraises_the_failing_one(virtual_world):
    assert virtual_world(3, lambda comm: comm.rank * 10) == [0, 10, 20]

    def fail_on_2(comm):
        if comm.rank == 2:
            raise KeyError("planted")
        comm.barrier()

    with pytest.raises(KeyError, match="planted") as err:
        run_on_virtual_ranks(3, fail_on_2, timeout=5)
    assert "virtual rank 2" in " ".join(getattr(err.value, "__notes__", []))
