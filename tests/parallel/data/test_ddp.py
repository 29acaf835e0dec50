"""DDP vs the single-rank reference: gradients, parameters, losses; buckets; bytes == formula."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from emulator.model import init_params
from parallel.data.ddp import DDP
from parallel.data.train import train_data_parallel

from .helpers import assert_matches, check_formulas, run_both, tiny


@pytest.mark.parametrize(("D", "k", "cap"), [(4, 2, 0.001), (2, 1, 25.0), (1, 2, 0.002)])
def test_ddp_equals_reference_and_formulas(D, k, cap):
    cfg = tiny()
    runs, ref = run_both(cfg, D, stage="ddp", microbatches=k, bucket_cap_mb=cap, steps=3)
    assert_matches(runs, ref)
    check_formulas(runs, cfg, "ddp", k=k)  # 2 Psi_pad (D-1)/D * 8 bytes each way; memory


def test_buckets_reverse_order_cap_and_padding():
    cfg = tiny(n_layers=3)
    params = init_params(cfg, 0)

    def body(comm):
        return DDP(comm, params, bucket_cap_mb=0.002).layouts

    lays = emulator.spawn(body, 3, timeout=30)[0]
    names = [n for lay in lays for n in lay.names]
    assert names == list(reversed(params))  # PyTorch: reverse registration order
    cap = 0.002 * 2**20
    for lay in lays[:-1]:  # every bucket but the last closed once it reached the cap
        assert lay.numel * 8 >= cap and (lay.numel - np.prod(lay.shapes[-1])) * 8 < cap
    assert all(lay.padded % 3 == 0 and 0 <= lay.padding < 3 for lay in lays)


def test_no_sync_one_all_reduce_per_bucket_per_step_in_backward_order():
    cfg = tiny()

    def body(comm):
        run = train_data_parallel(
            comm, cfg, 1, _batches(cfg), 1, stage="ddp", microbatches=4, bucket_cap_mb=0.001
        )
        calls = [c for c in comm.state.calls if c.op == "all_reduce"]
        tags = [r.tag for r in comm.ledger.records if r.tag.startswith("dp/grads")]
        return run, len(calls), list(dict.fromkeys(tags))

    run, n_calls, tags = emulator.spawn(body, 2, timeout=30)[0]
    assert n_calls == len(run.layouts)  # 4 micro-batches, still one all-reduce per bucket
    order = [int(t.split("bucket")[1].split("@")[0]) for t in tags]
    assert order == sorted(order)  # buckets fire in the order the backward fills them
    assert tags[0].endswith("@bwd:head") and tags[-1].endswith("@bwd:embed")


def _batches(cfg, B=8, S=6):
    from emulator.data import synthetic_batch

    return lambda s: synthetic_batch(5, s, B, S, cfg.vocab_size)


def test_ddp_on_any_local_dict_sums_over_dp():
    """The composition API: a rank-local dict (e.g. a TP shard), grads summed over dp."""
    rng = np.random.default_rng(0)
    shapes = {"a": (3, 5), "b": (7,), "c": (2, 2, 2)}

    def body(comm):
        params = {n: np.zeros(s) for n, s in shapes.items()}
        ddp = DDP(comm, params, bucket_cap_mb=1e-4)
        mine = [{n: rng_r.normal(size=s) for n, s in shapes.items()}
                for rng_r in [np.random.default_rng([comm.rank, i]) for i in range(2)]]  # fmt: skip
        with ddp.no_sync():
            for n in reversed(shapes):
                ddp.grad_ready(n, mine[0][n])
        with pytest.raises(RuntimeError, match="never all-reduced"):
            ddp.finish()
        for n in reversed(shapes):
            ddp.grad_ready(n, mine[1][n])
        return ddp.finish(), mine

    out = emulator.spawn(body, 3, timeout=30)
    del rng
    for n in shapes:
        want = sum(m[0][n] + m[1][n] for _, m in out)
        for got, _ in out:
            np.testing.assert_allclose(got[n], want, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    ("B", "k", "stage", "match"),
    [(6, 1, "ddp", "not divisible by the data-parallel degree"),
     (8, 3, "ddp", "must divide each rank's batch"),
     (8, 1, "4", "unknown ZeRO stage")],
)  # fmt: skip
def test_bad_input_is_a_clear_error(B, k, stage, match):
    cfg = tiny()
    with pytest.raises(ValueError, match=match):
        emulator.spawn(
            lambda c: train_data_parallel(c, cfg, 1, _batches(cfg, B=B), 1, stage=stage,
                                          microbatches=k), 4, timeout=30)  # fmt: skip
