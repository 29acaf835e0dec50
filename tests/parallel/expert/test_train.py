"""ep x dp training vs reference_train on the same batch and routing groups (float64): losses,
grad norms, the last step's gradients and the parameters after 3 steps, cut to each rank's
experts; the ep bytes of every layer and micro-batch against parallel/expert/cost.py."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.data import synthetic_batch
from emulator.flops import activation_bytes_per_block, head_activation_bytes
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel.check.data import compare_dp
from parallel.check.routing import reference_routes
from parallel.data.cost import step_bytes as ddp_step_bytes
from parallel.expert.cost import ep_block_activation_bytes, layer_bytes
from parallel.expert.train import assemble, ep_train, reference_slices
from tests.emulator.fd_helpers import assert_close

TOL = {"rtol": 1e-12, "atol": 1e-13}


def _cfg(E=8, K=2, cf=1.0):
    return ModelConfig(vocab_size=16, max_seq_len=6, d_model=8, n_heads=2, n_layers=2,
                       n_experts=E, moe_top_k=K, capacity_factor=cf, aux_loss_coef=0.1)  # fmt: skip


def _run(D, ep, mode, cfg, k=2, recompute="none", split=False, steps=3):
    B = 2 * D * k

    def batches(s):
        return synthetic_batch(0, s, B, 6, cfg.vocab_size)

    def groups_fn(step, mb, b, S):  # two interleaved routing groups per micro-batch
        return [np.arange(0, b * S, 2), np.arange(1, b * S, 2)] if split else None

    kw = {"max_norm": 0.5, "groups_fn": groups_fn}
    ref = reference_train(cfg, 0, batches, steps, microbatches=D * k, **kw)

    def fn(comm):
        run = ep_train(comm, cfg, 0, batches, steps, ep=ep, microbatches=k, dispatch=mode,
                       recompute=recompute, **kw)  # fmt: skip
        kept = [[[lay["kept"] for lay in mb] for mb in step] for step in run.moe]
        return run, comm.allgather_object(kept)

    out = emulator.spawn(fn, D, timeout=120)
    for r, (run, kept_all) in enumerate(out):
        assert_close("losses", run.losses, ref.losses, **TOL)
        assert_close("grad_norms", run.grad_norms, ref.grad_norms, **TOL)
        for what, got, want in (
            ("grads", run.grads, ref.grads),
            ("params", run.params, ref.params),
        ):
            want = reference_slices(want, run.ep_rank, run.n_local)
            assert set(got) == set(want)
            for n in want:
                assert_close(f"rank {r} {what} {n}", got[n], want[n], **TOL)
        if recompute == "full":  # fwd bytes twice: test_full_recompute_reruns_the_forward_...
            continue
        b, S = 2, 6  # each rank's micro-batch
        sizes = [len(range(0, b * S, 2)), len(range(1, b * S, 2))] if split else None
        if ep == 1:  # parallel.train's single-rank MoE block (no all-to-all, nothing logged)
            peak = cfg.n_layers * activation_bytes_per_block(cfg, b, S, recompute, sizes)
        else:
            peak = max(
                sum(ep_block_activation_bytes(cfg, b, S, int(lay["counts"].sum()), recompute,
                                              sizes) for lay in mb)
                for step in run.moe for mb in step
            )  # fmt: skip
        peak += head_activation_bytes(cfg, b, S)  # the N-D program charges ids + head cache
        assert run.memory["peak"]["activations"] == peak, (r, run.memory["peak"], peak)
        base = (r // ep) * ep  # the world ranks of this rank's ep group
        for s, step in enumerate(run.moe):
            for j, mb in enumerate(step):
                for i, layer in enumerate(mb):
                    kept = np.array([kept_all[base + q][s][j][i] for q in range(ep)])
                    C = layer["C"]
                    want = layer_bytes(mode, kept, C, cfg.d_model, 8, r % ep)
                    assert layer["bytes"] == want, (r, s, j, i, layer["bytes"], want)
    return out


@pytest.mark.parametrize("mode", ["exact", "padded"])
@pytest.mark.parametrize("D,ep", [(4, 4), (4, 2), (2, 1)])
def test_ep_dp_matches_reference(mode, D, ep):
    _run(D, ep, mode, _cfg())


def test_dropping_k3_two_groups_full_recompute():
    _run(2, 2, "exact", _cfg(E=4, K=3, cf=0.5), split=True, recompute="full")
    _run(2, 2, "padded", _cfg(E=2, K=1, cf=0.75), split=True, recompute="selective")


def test_ep_must_divide_the_data_parallel_ranks():
    def fn(comm):
        ep_train(comm, _cfg(), 0, lambda s: synthetic_batch(0, s, 6, 6, 16), 1, ep=4)

    with pytest.raises(ValueError, match=r"ep=4 must divide the 3 data-parallel ranks"):
        emulator.spawn(fn, 3, timeout=30)


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_lower_precision_with_the_routing_rule(dtype, mode):
    """float32 / mixed vs the same-dtype reference under parallel/check/data.py's measured
    tolerances; routing compared first (a flip must be a bf16 near tie, and never in float32)."""
    cfg = dataclasses.replace(_cfg(E=4, K=2, cf=1.0), dtype=dtype)
    D, ep, k, steps = 4, 2, 2, 3

    def batches(s):
        return synthetic_batch(0, s, 2 * D * k, 6, cfg.vocab_size)

    kw = {"max_norm": 0.5, "microbatches": k}
    ref = reference_train(cfg, 0, batches, steps, microbatches=D * k, max_norm=0.5)
    routes = reference_routes(cfg, 0, batches, steps, microbatches=D * k, max_norm=0.5)
    runs = emulator.spawn(
        lambda comm: ep_train(comm, cfg, 0, batches, steps, ep=ep, dispatch=mode, **kw), D
    )
    _, problems, note = compare_dp(assemble(runs, ep), ref, dtype, routes, cfg.moe_top_k)
    print(note)
    assert not problems, problems
    assert "routing identical" in note or dtype == "mixed"


@settings(max_examples=8, deadline=None)
@given(
    ep=st.integers(1, 2),
    edp=st.integers(1, 2),
    per=st.integers(1, 2),
    K=st.integers(1, 3),
    cf=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    b=st.integers(1, 2),
    S=st.integers(1, 4),
    mode=st.sampled_from(["exact", "padded"]),
)
def test_property_ep_dp(ep, edp, per, K, cf, b, S, mode):
    D, E = ep * edp, ep * per
    cfg = ModelConfig(vocab_size=8, max_seq_len=4, d_model=4, n_heads=1, n_layers=1, d_ff=6,
                      n_experts=E, moe_top_k=min(K, E), capacity_factor=cf)  # fmt: skip

    def batches(s):
        return synthetic_batch(1, s, b * D, S, cfg.vocab_size)

    ref = reference_train(cfg, 0, batches, 2, microbatches=D)
    for run in emulator.spawn(lambda c: ep_train(c, cfg, 0, batches, 2, ep=ep, dispatch=mode), D):
        assert_close("losses", run.losses, ref.losses, **TOL)
        for n, want in reference_slices(ref.params, run.ep_rank, run.n_local).items():
            assert_close(n, run.params[n], want, **TOL)


def test_full_recompute_reruns_the_forward_all_to_alls():
    """recompute="full" reruns each block's forward in its backward, all-to-alls included: the
    three forward phases move exactly twice the bytes of recompute="none", the backward the same
    (same routing: the recomputation is bitwise)."""
    cfg = _cfg(E=4, K=2, cf=0.75)

    def batches(s):
        return synthetic_batch(0, s, 8, 6, cfg.vocab_size)

    runs = {
        rc: emulator.spawn(
            lambda c, rc=rc: ep_train(c, cfg, 0, batches, 2, ep=2, microbatches=2, recompute=rc), 4
        )
        for rc in ("none", "full")
    }
    for a, b in zip(runs["none"], runs["full"]):
        assert a.losses == b.losses
        for sa, sb in zip(a.moe, b.moe):
            for ma, mb in zip(sa, sb):
                for la, lb in zip(ma, mb):
                    for ph, (sent, recv) in la["bytes"].items():
                        k = 2 if ph.startswith("fwd") else 1
                        assert lb["bytes"][ph] == (k * sent, k * recv), (ph, la, lb)
                    assert la["bytes"]["fwd/dispatch"][0] > 0


@pytest.mark.parametrize("mode", ["exact", "padded"])
def test_ddp_buckets_per_group(mode):
    """grad_sync="ddp": one DDP engine over the world for the replicated tensors, one over edp
    for the experts, no_sync for the first micro-batch; == the reference, and each group's bytes
    per step == parallel/data/cost.py's DDP formula for its buckets (2 (G-1)/G padded w)."""
    cfg, D, ep, k = _cfg(E=4, K=2, cf=1.0), 4, 2, 2

    def batches(s):
        return synthetic_batch(0, s, 2 * D * k, 6, cfg.vocab_size)

    ref = reference_train(cfg, 0, batches, 2, microbatches=D * k, max_norm=0.5)
    runs = emulator.spawn(lambda c: ep_train(c, cfg, 0, batches, 2, ep=ep, microbatches=k,
                                             dispatch=mode, max_norm=0.5, grad_sync="ddp",
                                             bucket_cap_mb=0.002), D)  # fmt: skip
    _, problems, _ = compare_dp(assemble(runs, ep), ref, "float64")
    assert not problems, problems
    for run in runs:
        assert len(run.layouts["dense"]) > 1 and len(run.layouts["experts"]) > 1
        dense = ddp_step_bytes("ddp", run.layouts["dense"], "float64", k)["grads"]
        experts = ddp_step_bytes("ddp", run.layouts["experts"], "float64", k)["grads"]
        assert all(b == {"dp": (dense,) * 2, "edp": (experts,) * 2} for b in run.step_bytes)
        pad = sum(lay.padded for lays in run.layouts.values() for lay in lays)
        assert run.memory["current"]["grads"] == 8 * pad  # both engines' bucket buffers
