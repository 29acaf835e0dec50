"""Expert parallelism inside parallel.train (parallel/expert/nd.py): dp x ep and dp x ep x pp,
both dispatch modes, K = 1 and 2, a capacity factor that drops, weight decay and clipping.
Every rank against reference_train on the same global batch and routing groups (float64 1e-12):
losses, the gathered full-shape gradients and params, and the rank's own local tensors (its
stage, its E/ep experts). Bytes by axis against closed forms: each MoE layer's all-to-alls per
micro-batch and phase = parallel/expert/cost.py's formula from the ep group's routing counts,
dp + edp = DDP's bucket formula on the replicated / expert tensors, the norm's ring all-reduces.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import emulator
import parallel
from collectives import cost as ccost
from emulator.check import compare, compare_losses, compare_run
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import Layout
from parallel.context.layout import table
from parallel.context.train import routing_groups
from parallel.expert import nd as nd_ep
from parallel.expert.cost import PHASES
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard

HYPER = {"weight_decay": 0.1, "betas": (0.8, 0.9), "eps": 1e-7, "lr": 3e-3}
RTOL = 1e-12


def _cfg(E=4, K=2, cf=0.75, L=2):
    return ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=L,
                       n_experts=E, moe_top_k=K, capacity_factor=cf)  # fmt: skip


def _run(layout, cfg, B, S, steps, groups_fn=None):
    """-> (runs, reference, per rank {(step, tag): sent} of its ep/ and edp/ records)."""
    batches = lambda s: synthetic_batch(11, s, B, S, cfg.vocab_size)
    ref_groups = groups_fn
    if layout.cp > 1:  # each cp rank's tokens of a micro-batch: one routing group
        tab = table(S, layout.cp, layout.cp_balance)
        ref_groups = lambda step, j, b, s: routing_groups(b, s, tab)
    ref = reference_train(cfg, 0, batches, steps, microbatches=layout.dp * layout.microbatches,
                          max_norm=0.3, groups_fn=ref_groups, recompute=layout.recompute,
                          **HYPER)  # fmt: skip

    def main(comm):
        mark = comm.ledger.mark()
        run = parallel.train(comm, layout, cfg, batches, steps, max_norm=0.3,
                             groups_fn=groups_fn, **HYPER)  # fmt: skip
        sent: dict = {}
        for r in comm.ledger.since(mark):
            if r.direction == "send" and r.tag.startswith("ep/"):
                sent[(r.step, r.tag)] = sent.get((r.step, r.tag), 0) + r.nbytes
        return run, sent

    out = emulator.spawn(main, layout.world, timeout=180)
    return [o[0] for o in out], ref, [o[1] for o in out]


def check_ep(layout, cfg, *, B=8, S=4, steps=2, groups_fn=None, rerun=False):
    """rerun: recompute="full" reruns each block's forward, all-to-alls included, in the
    backward, so the three fwd phases move twice the formula's bytes."""
    runs, ref, sent = _run(layout, cfg, B, S, steps, groups_fn)
    P, El, itemsize = layout.ep, cfg.n_experts // layout.ep, 8
    dropped, plan = 0, nd_ep.expert_plan(megatron_plan(cfg))
    for run, tags in zip(runs, sent):
        where = f"rank at {run.coords}"
        assert not compare_run(run, ref, RTOL)[1], (where, compare_run(run, ref, RTOL)[1][:4])
        # the ONE global norm (before clipping) = the reference's, every step, every rank
        np.testing.assert_allclose(run.grad_norms, ref.grad_norms, rtol=RTOL, err_msg=where)
        e, t, tr = run.coords["ep"], layout.tp, run.coords["tp"]
        for mine, full, kind in ((run.local_params, ref.params, "param"),
                                 (run.local_grads, ref.grads, "grad")):  # fmt: skip
            want = shard(nd_ep.shard_experts({n: full[n] for n in mine}, e, El), plan, tr, t)
            assert not compare(mine, want, RTOL, kind)[1], where
        assert run.replica_mismatch == [], (where, run.replica_mismatch)
        # the ep group: same edp, pp coordinates, in ep order
        group = sorted((q for q in runs if all(q.coords[a] == run.coords[a] for a in
                        ("edp", "pp", "cp", "tp"))), key=lambda q: q.coords["ep"])  # fmt: skip
        assert [q.coords["ep"] for q in group] == list(range(P))
        shapes = nd_ep.local_shapes(cfg, layout, run.coords["pp"])  # from the config alone
        assert shapes == {n: a.shape for n, a in run.local_params.items()}, where
        for step in range(steps):
            keys = run.ep_counts[step]
            assert keys, where  # every stage has MoE blocks
            total = 0
            for layer, mb in keys:
                kept = np.stack([q.ep_counts[step][(layer, mb)][0] for q in group])
                C = run.ep_counts[step][(layer, mb)][1]
                N = B // (layout.dp * layout.microbatches) * S // layout.cp  # this rank's tokens
                dropped += cfg.moe_top_k * N - int(kept[e].sum())
                f = nd_ep.ep_layer_bytes(layout.dispatch, kept, C, cfg.d_model, itemsize, e)
                for ph in PHASES:  # the ledger per layer, micro-batch and phase
                    fwd, name = ph.split("/")
                    got = tags.get((step, f"ep/{layer}/mb{mb}/{fwd}/{name}"), 0)
                    assert got == f[ph][0] * (2 if rerun and fwd == "fwd" else 1), (
                        where,
                        step,
                        layer,
                        mb,
                        ph,
                        got,
                        f[ph],
                    )
                    total += got
            assert run.step_bytes[step]["ep"] == total
            counts = [q.ep_counts[step] for q in group]
            assert total == nd_ep.ep_step_bytes(layout.dispatch, counts, e, cfg.d_model, 8, rerun)
            want = nd_ep.rank_bytes(cfg, layout, B, S, run.coords, shapes)
            assert {k: run.step_bytes[step][k] for k in want} == want, (where, run.step_bytes)
            assert want["dp"] + want["edp"] == nd_ep.dp_bytes(cfg, layout, shapes)
            # the norm: over ep (DDP: replicas over edp) or dp x cp (ZeRO: distinct shards)
            C, d, c = layout.cp, run.coords["dp"], run.coords["cp"]
            first = (P, e) if layout.zero == 0 else (layout.dp * C, d * C + c)
            clip = sum(ccost.ring_all_reduce(1, n, 8, k)[0] for n, k in (first,
                       (layout.tp, run.coords["tp"]), (layout.pp, run.coords["pp"])) if n > 1)  # fmt: skip
            assert clip == nd_ep.clip_bytes(layout, run.coords), where
            assert run.step_bytes[step]["clip"] == clip, where
            tp = nd_ep.tp_bytes(cfg, layout, B, S, run.coords)
            assert run.step_bytes[step]["tp"] == tp, (where, run.step_bytes[step], tp)
            assert "untagged" not in run.step_bytes[step]
        assert run.losses == runs[0].losses
        static = nd_ep.static_memory(cfg, layout, shapes)
        assert {k: run.memory["current"][k] for k in static} == static, (where, run.memory)
        peak = nd_ep.peak_memory(cfg, layout, shapes, run.coords["pp"])
        assert {k: run.memory["peak"][k] for k in peak} == peak, (where, run.memory, peak)
    return runs, dropped


@pytest.mark.parametrize("dispatch", ["exact", "padded"])
@pytest.mark.parametrize("K", [1, 2])
@pytest.mark.parametrize("dp,ep", [(4, 2), (4, 4)])
def test_dp_x_ep(dp, ep, K, dispatch):
    layout = Layout(dp=dp, ep=ep, microbatches=2, dispatch=dispatch)
    _, dropped = check_ep(layout, _cfg(E=4, K=K, cf=0.75), B=8, S=4)
    assert dropped > 0  # the capacity factor drops tokens: the check covers dropping


@pytest.mark.parametrize("dispatch", ["exact", "padded"])
def test_dp_x_ep_x_pp(dispatch):
    """ep inside pipeline stages: each stage's MoE blocks over the ep group of that stage."""
    layout = Layout(dp=4, ep=2, pp=2, microbatches=2, schedule="1f1b", dispatch=dispatch)
    check_ep(layout, _cfg(E=4, K=2, cf=0.75, L=4), B=8, S=4)


@pytest.mark.parametrize("dispatch", ["exact", "padded"])
@pytest.mark.parametrize("sp", [False, True])
def test_dp_x_ep_x_tp(sp, dispatch):
    """Non-expert layers tensor-parallel (Megatron, SP on/off), experts cut over ep and
    replicated over tp: each tp rank runs its ep group's all-to-alls on the full m."""
    layout = Layout(dp=2, ep=2, tp=2, microbatches=2, sequence_parallel=sp, dispatch=dispatch)
    check_ep(layout, _cfg(E=4, K=2, cf=0.75), B=8, S=4)


def test_dp_x_ep_x_tp_x_pp_on_8_ranks():
    layout = Layout(dp=2, ep=2, tp=2, pp=2, microbatches=2, sequence_parallel=True)
    check_ep(layout, _cfg(E=2, K=1, cf=0.75, L=4), B=8, S=4)


def test_dp_x_ep_x_pp_interleaved_selective_e_equals_ep():
    layout = Layout(dp=2, ep=2, pp=2, chunks=2, microbatches=2, schedule="interleaved",
                    recompute="selective")  # fmt: skip
    check_ep(layout, _cfg(E=2, K=1, cf=1.0, L=4), B=8, S=4)


def test_two_routing_groups_per_microbatch_and_full_recompute():
    """groups_fn: each micro-batch routed as two groups (capacity per group), handed to the
    reference the same way; recompute="full" reruns the all-to-alls in the backward."""

    def groups_fn(step, g, b, S):
        n = b * S
        return [np.arange(n // 2), np.arange(n // 2, n)]

    layout = Layout(dp=4, ep=2, microbatches=2, recompute="full")
    check_ep(layout, _cfg(E=4, K=2, cf=0.75), groups_fn=groups_fn, rerun=True)


@settings(max_examples=10, deadline=None)
@given(ep=st.sampled_from([2, 4]), edp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
       tp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]), per=st.sampled_from([1, 2]),
       K=st.integers(1, 3), cf=st.sampled_from([0.0, 0.5, 1.0, 2.0]), m=st.sampled_from([1, 2]),
       b=st.sampled_from([1, 2]), sp=st.booleans(), dispatch=st.sampled_from(["exact", "padded"]),
       zero=st.sampled_from([0, 1, 2, 3]),
       balance=st.sampled_from(["zigzag", "contiguous"]))  # fmt: skip
def test_property_layouts_with_ep(ep, edp, pp, tp, cp, per, K, cf, m, b, sp, dispatch, zero,
                                  balance):  # fmt: skip
    """Drawn: ep, edp, pp, tp, cp with world <= 8, E = ep or 2 ep, K <= E, cf 0 (everything
    dropped) .. 2, micro-batches, SP (with cp too), DDP or ZeRO-1/2/3, the cp balance: every rank
    vs the reference and every byte and static memory formula."""
    assume(ep * edp * pp * tp * cp <= 8)
    E = per * ep
    layout = Layout(dp=ep * edp, ep=ep, pp=pp, tp=tp, cp=cp, microbatches=m, dispatch=dispatch,
                    sequence_parallel=sp and tp > 1, zero=zero,
                    cp_balance=balance)  # fmt: skip
    check_ep(layout, _cfg(E=E, K=min(K, E), cf=cf, L=2 * pp), B=ep * edp * m * b, S=4, steps=1)


@pytest.mark.parametrize(
    "tp,dispatch,zero", [(1, "exact", 0), (2, "padded", 0), (1, "exact", 2), (1, "padded", 3)]
)
def test_mixed_precision_losses_and_bitwise_reproducible(tp, dispatch, zero):
    """bf16 compute: the losses within test_train.py's MoE bound (4e-4 relative; measured
    1.8e-5 here), and the same layout twice gives the same bits (fixed reduction order);
    ZeRO: bf16 params / grads on the wire and fp32 master shards - the ledger bytes and the
    static memory (compute copy + master) equal nd.dp_bytes / nd.static_memory."""
    layout = Layout(dp=4 // tp, ep=2, tp=tp, microbatches=2 if tp == 1 else 1, dtype="mixed",
                    dispatch=dispatch, zero=zero)  # fmt: skip
    cfg = dataclasses.replace(_cfg(E=4, K=2, cf=2.0), dtype="mixed")
    batches = lambda s: synthetic_batch(11, s, 8, 4, cfg.vocab_size)

    def main(comm):
        return parallel.train(comm, layout, cfg, batches, 2, max_norm=0.3, **HYPER)

    a, b = (emulator.spawn(main, 4, timeout=180) for _ in range(2))
    ref = reference_train(cfg, 0, batches, 2, microbatches=layout.dp * layout.microbatches,
                          max_norm=0.3, **HYPER)  # fmt: skip
    for x, y in zip(a, b):
        assert not compare_losses(x.losses, ref.losses, 4e-4)[1], (x.losses, ref.losses)
        assert x.losses == y.losses
        assert all(np.array_equal(x.local_params[n], y.local_params[n]) for n in x.local_params)
        shapes = nd_ep.local_shapes(cfg, layout, x.coords["pp"])
        assert x.step_bytes[0]["dp"] + x.step_bytes[0]["edp"] == nd_ep.dp_bytes(cfg, layout, shapes)
        static = nd_ep.static_memory(cfg, layout, shapes)
        assert {k: x.memory["current"][k] for k in static} == static, x.memory


def test_planted_bug_replicated_norm_counted_ep_times_fails(monkeypatch):
    real = nd_ep.DataAxis

    def planted(*a, norm_weights, **kw):  # DDP: the dense tensors, replicated over ep, weigh 1
        return real(*a, norm_weights={n: 1.0 for n in norm_weights}, **kw)

    monkeypatch.setattr(nd_ep, "DataAxis", planted)
    runs, ref, _ = _run(Layout(dp=2, ep=2), _cfg(), 4, 4, 1)
    assert not np.isclose(runs[0].grad_norms[0], ref.grad_norms[0], rtol=1e-6)


@pytest.mark.parametrize(
    "kw,cfg,fragment",
    [
        ({"dp": 4, "ep": 3}, _cfg(E=6), "ep=3 must divide dp=4"),
        ({"dp": 4, "ep": 4}, _cfg(E=6), "ep=4 does not divide n_experts=6"),
        ({"dp": 2, "ep": 2, "schedule": "zb-h1"}, _cfg(), "ep > 1 with zb-h1"),
        ({"dp": 4, "ep": 2}, dataclasses.replace(_cfg(E=0, K=1), n_experts=0), "needs an MoE model"),
        ({"dp": 4, "ep": 2, "dispatch": "dense"}, _cfg(), "dispatch='dense'"),
    ],
)  # fmt: skip
def test_ep_refusals_say_why(kw, cfg, fragment):
    layout = Layout(**kw)
    with pytest.raises(ValueError, match="cannot run") as e:
        layout.validate(layout.world, cfg, (8, 4))
    assert fragment in str(e.value), str(e.value)
