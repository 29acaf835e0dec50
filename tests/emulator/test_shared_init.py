"""shared_init_params: one read-only init_params per virtual world, bitwise a fresh init.

Checked against init_params itself (a fresh draw) and against the trainers: after DDP, ZeRO-3,
a pipeline and the 3-D layout trained in a world, the world's shared copy is still bitwise a
fresh init (no rank wrote into it) and every trainer's final parameters are those of the same
run with every rank drawing its own writable arrays (init_params, as before the sharing).
"""

from unittest import mock

import pytest

import emulator
import parallel
from emulator import shared_init
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, init_params
from emulator.shared_init import shared_init_params
from parallel.data.train import train_data_parallel
from parallel.layout import Layout
from parallel.pipeline.train import pipeline_train

CFG = ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=4)


def batches(step):
    return synthetic_batch(0, step, 8, CFG.max_seq_len, CFG.vocab_size)


def same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
        for x, y in zip(a.values(), b.values())
    )


@pytest.mark.parametrize("dtype", ["float64", "float32", "mixed"])
def test_equals_a_fresh_init_bitwise_and_is_read_only(dtype):
    cfg = ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, dtype=dtype)

    def prog(comm):
        p = shared_init_params(comm, cfg, 7)
        assert same(p, init_params(cfg, 7))
        with pytest.raises(ValueError, match="read-only"):
            p["embed.tok"][0, 0] = 1.0
        return {n: id(a) for n, a in p.items()}

    ids = emulator.spawn(prog, 3)
    assert ids[0] == ids[1] == ids[2]  # one copy for the world


def test_one_draw_per_world_and_per_key():
    with mock.patch.object(shared_init, "init_params", wraps=init_params) as draw:
        emulator.spawn(lambda c: shared_init_params(c, CFG, 0), 4)
        assert draw.call_count == 1
        emulator.spawn(lambda c: (shared_init_params(c, CFG, 0), shared_init_params(c, CFG, 1)), 4)
        assert draw.call_count == 3  # a new world draws again; another seed is another key


def test_not_shared_off_virtual_ranks_or_without_an_int_seed():
    p = shared_init_params(object(), CFG, 0)  # not a virtual comm (MPI): init_params itself
    assert p["embed.tok"].flags.writeable and same(p, init_params(CFG, 0))
    with mock.patch.object(shared_init, "init_params", wraps=init_params) as draw:
        emulator.spawn(lambda c: shared_init_params(c, CFG, None), 3)  # fresh entropy per rank
        assert draw.call_count == 3


def test_a_drawing_rank_that_holds_the_slot_times_out_the_others():
    def prog(comm):
        if comm.rank == 0:
            slot = shared_init._worlds.setdefault(comm.world, shared_init._Slot())
            slot.lock.acquire()  # a stuck draw
        comm.barrier()
        if comm.rank == 1:
            with pytest.raises(TimeoutError, match="shared_init_params: another rank held"):
                shared_init_params(comm, CFG, 0)

    emulator.spawn(prog, 2, timeout=1.0)


def _fresh(comm, cfg, seed):  # the trainers as before: every rank draws its own arrays
    return init_params(cfg, seed)


LAYOUT = Layout(dp=2, pp=2, tp=2, zero=3, microbatches=2)
TRAINERS = {  # name: (module whose shared_init_params is replaced, ranks, one run)
    "ddp": ("parallel.data.train", 2, lambda c: train_data_parallel(c, CFG, 0, batches, 2)),
    "zero3": ("parallel.data.train", 2,
              lambda c: train_data_parallel(c, CFG, 0, batches, 2, stage=3)),
    "pp2": ("parallel.pipeline.train", 2,
            lambda c: pipeline_train(c, CFG, 0, batches, 2, microbatches=2)),
    "3d": ("parallel.train", 8, lambda c: parallel.train(c, LAYOUT, CFG, batches, 2, seed=0)),
}  # fmt: skip


@pytest.mark.parametrize("name", TRAINERS)
def test_trainers_leave_the_shared_copy_untouched_and_match_fresh_arrays(name):
    module, ranks, run = TRAINERS[name]
    handed = []  # every dict the trainer got from shared_init_params

    def recorded(comm, cfg, seed):
        handed.append(shared_init_params(comm, cfg, seed))
        return handed[-1]

    with mock.patch(f"{module}.shared_init_params", recorded):
        shared = emulator.spawn(lambda c: run(c).params, ranks, timeout=300)
    with mock.patch(f"{module}.shared_init_params", _fresh):
        fresh = emulator.spawn(lambda c: run(c).params, ranks, timeout=300)
    assert len(handed) == ranks and all(h["embed.tok"] is handed[0]["embed.tok"] for h in handed)
    # the world's shared copy after training: still a fresh init, bitwise (no rank wrote in it)
    assert same(handed[0], init_params(CFG, 0))
    assert all(same(a, b) for a, b in zip(shared, fresh))


def test_the_slot_lets_go_once_every_rank_took_its_copy():
    def prog(comm):
        first = shared_init_params(comm, CFG, 0)
        comm.barrier()  # every rank took one: the slot holds nothing now
        assert not shared_init._worlds[comm.world].params
        comm.barrier()
        again = shared_init_params(comm, CFG, 0)  # a second round draws again, shared again
        return first["embed.tok"] is not again["embed.tok"], id(again["embed.tok"])

    out = emulator.spawn(prog, 3)
    assert all(fresh for fresh, _ in out) and len({i for _, i in out}) == 1
