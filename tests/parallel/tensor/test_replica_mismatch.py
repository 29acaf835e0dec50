"""replica_mismatch and unshard_once split over a tp group on virtual ranks: the same findings
(in the same order) and the same full arrays as one rank doing all the work."""

import numpy as np

import emulator
from emulator.config import init_params
from emulator.model import ModelConfig
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard, unshard, unshard_each, unshard_once
from parallel.tensor.train import replica_mismatch

CFG = ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=4, n_layers=2)


def _every(R: int, corrupt: dict) -> list:
    """Every rank's (params, grads) shards; corrupt: {(rank, 0 params | 1 grads): names}."""
    plan, full = megatron_plan(CFG), init_params(CFG, 0)
    every = []
    for r in range(R):
        p = shard(full, plan, r, R)
        g = {n: x * 0.5 for n, x in p.items()}
        for i, d in enumerate((p, g)):
            for n in corrupt.get((r, i), ()):
                d[n] = d[n].copy()
                d[n].flat[0] += 1.0
        every.append((p, g))
    return every


def test_split_check_finds_what_one_rank_finds_in_its_order():
    plan = megatron_plan(CFG)
    corrupt = {(2, 0): ["blocks.1.ln2.gain", "embed.pos"], (3, 1): ["final_ln.bias"],
               (1, 1): ["blocks.0.attn.bo"], (1, 0): ["embed.pos"]}  # fmt: skip
    every = _every(4, corrupt)
    want = replica_mismatch(every, plan)  # one rank, every tensor
    assert want == ["param embed.pos", "param blocks.1.ln2.gain", "grad blocks.0.attn.bo",
                    "grad final_ln.bias"]  # fmt: skip
    got = emulator.spawn(lambda c: replica_mismatch(every, plan, c), 4)
    assert got == [want] * 4
    assert emulator.spawn(lambda c: replica_mismatch(_every(4, {}), plan, c), 4) == [[]] * 4


def test_unshard_once_equals_unshard_on_every_rank():
    plan, every = megatron_plan(CFG), _every(4, {})
    want = unshard([e[0] for e in every], plan)
    for got in emulator.spawn(lambda c: unshard_once(c, [e[0] for e in every], plan), 4):
        assert list(got) == list(want)
        for n, x in want.items():
            assert got[n].shape == x.shape and np.array_equal(got[n], x), n


def test_unshard_each_is_unshard_of_each_list_in_one_exchange():
    plan, every = megatron_plan(CFG), _every(4, {})
    lists = [[e[0] for e in every], [e[1] for e in every], [{} for _ in every]]
    want = [unshard(shards, plan) for shards in lists]
    assert want[2] == {}
    for got in emulator.spawn(lambda c: unshard_each(c, lists, plan), 4):
        assert [list(d) for d in got] == [list(d) for d in want]
        for g, w in zip(got, want, strict=True):
            for n, x in w.items():
                assert g[n].shape == x.shape and np.array_equal(g[n], x), n
