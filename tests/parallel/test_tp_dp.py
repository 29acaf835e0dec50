"""dp x tp: DDP and ZeRO-1 (parallel/ddp.py, zero.py, unchanged) on the dp axis of a 2-D mesh
over tensor-parallel shards, against the reference run with D k micro-batches."""

import numpy as np
import pytest

import emulator
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import tp_cost
from parallel.dp_check import step_bytes
from parallel.flat import make_buckets
from parallel.shard import local_shape
from parallel.tensor import megatron_plan
from parallel.tp_train import tp_train


@pytest.mark.parametrize(
    "stage,sp,moe",
    [("ddp", False, False), ("ddp", True, True), ("1", True, False), ("1", False, True)],
)
def test_dp_x_tp_equals_reference(stage, sp, moe):
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=2,
                      n_experts=3 if moe else 0, moe_top_k=2)  # fmt: skip
    B, S, D, T, k = 8, 4, 2, 2, 2
    batches = lambda s: synthetic_batch(5, s, B, S, cfg.vocab_size)
    ref = reference_train(cfg, 2, batches, 3, microbatches=D * k, max_norm=0.2)

    def fn(comm):
        mesh = emulator.Mesh(comm, dp=D, tp=T)
        r = tp_train(mesh, cfg, 2, batches, 3, microbatches=k, sequence_parallel=sp,
                     max_norm=0.2, dp_stage=stage)  # fmt: skip
        L = comm.ledger
        r.dp_bytes = L.sent(L.select(tag="dp/grads*", step=2)) + L.sent(
            L.select(tag="dp/params*", step=2)
        )
        r.layer = L.sent(L.select(tag="blocks.0/*", step=2))
        r.tp_rank = mesh.coord("tp")
        return r

    runs = emulator.spawn(fn, D * T, timeout=30)
    plan = megatron_plan(cfg)
    for r in runs:
        _, problems = compare_run(r, ref, 1e-12)
        assert not problems, "\n".join(problems)
        assert np.allclose(r.grad_norms, ref.grad_norms, rtol=1e-12, atol=0)
        # dp traffic is DDP's / ZeRO-1's formula on this rank's TP shard; tp traffic is unchanged
        shapes = {n: local_shape(s.shape, plan[n], T, n) for n, s in ref.params.items()}
        layouts = make_buckets(shapes, D, 25.0, 8)
        assert r.dp_bytes == sum(step_bytes(stage, layouts, cfg.dtype, k).values())
        assert r.layer == k * tp_cost.layer_bytes(cfg, B // (D * k), S, T, sp=sp, rank=r.tp_rank)


def test_unknown_dp_stage_is_refused():
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=1)
    with pytest.raises(ValueError, match="composes with"):
        emulator.spawn(
            lambda c: tp_train(emulator.Mesh(c, dp=1, tp=2), cfg, 0, [], 0, dp_stage="3"),
            2,
            timeout=30,
        )
