"""ZeRO-1/2/3 and context parallelism composed with expert parallelism in parallel.train
(parallel/expert/nd.py ep_axis, parallel/data/axis.py parts): every rank against reference_train
(float64 1e-12) and every axis's bytes and memory against the closed forms, by
tests/parallel/test_train_ep.py's check_ep; replicas compared bitwise; planted bugs failing.
"""

from __future__ import annotations

import numpy as np
import pytest

from emulator.check import compare_run
from parallel import Layout
from parallel.expert import nd as nd_ep
from parallel.expert.sync import is_expert
from parallel.testing import check_layout
from tests.parallel.test_train_ep import RTOL, _cfg, _run, check_ep


# ---- ZeRO-1/2/3 with ep > 1: dense tensors sharded over dp, experts over edp, one norm ----------
@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp,ep", [(4, 2), (2, 2)])
def test_zero_x_ep(zero, dp, ep):
    """Uneven bucket caps (several ZeRO-1 buckets of unequal size), clipping, weight decay, two
    micro-batches, a dropping capacity factor: every rank vs the reference, ledger bytes by
    axis vs nd.dp_bytes, the static memory categories vs nd.static_memory."""
    layout = Layout(dp=dp, ep=ep, zero=zero, microbatches=2, bucket_cap_mb=0.0007)
    runs, dropped = check_ep(layout, _cfg(E=4, K=2, cf=0.75), B=8, S=4)
    assert dropped > 0
    assert min(runs[0].grad_norms) > 0.3  # max_norm=0.3 clips every step: the coef is used
    if zero == 1:  # the cap splits both parts into several buckets
        assert len(runs[0].layouts) > 2, runs[0].layouts


@pytest.mark.parametrize(
    "zero,kw",
    [
        (3, {"prefetch": True, "pp": 2}),
        (3, {"reshard_after_forward": False, "tp": 2}),
        (2, {"recompute": "selective", "tp": 2, "sequence_parallel": True}),
        (3, {"recompute": "full", "pp": 2}),
    ],
)
def test_zero_x_ep_x_pp_or_tp_variants(zero, kw):
    """ZeRO-2/3 per-layer units (a block's dense and expert tensors in two engines, gathered
    together) with prefetch, without resharding, and recompute, inside pipeline stages or with
    tp (the experts replicated over tp weigh 1/t in the norm); edp = 2, so both parts move."""
    layout = Layout(dp=4, ep=2, zero=zero, microbatches=2, **kw)
    L = 4 if kw.get("pp") else 2
    check_ep(layout, _cfg(E=4, K=2, cf=0.75, L=L), B=8, S=4, rerun=kw.get("recompute") == "full")


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_planted_bug_experts_summed_over_dp_instead_of_edp_fails(monkeypatch, zero):
    """The expert part synchronised over the dp group: the ep ranks' different experts summed
    (DDP) or sharded together (ZeRO) - the expert gradients and params disagree."""
    real = nd_ep.DataAxis

    def planted(data, *a, parts, **kw):
        return real(data, *a, parts=[nd_ep.Part(data, p.names, p.label) for p in parts], **kw)

    monkeypatch.setattr(nd_ep, "DataAxis", planted)
    runs, ref, _ = _run(Layout(dp=4, ep=2, zero=zero, microbatches=2), _cfg(), 8, 4, 2)
    problems = compare_run(runs[0], ref, RTOL)[1]
    assert any(is_expert(p.split()[1].rstrip(":")) for p in problems if p.startswith("grad")), (
        problems[:4]
    )


def test_planted_bug_zero_norm_counted_twice_fails(monkeypatch):
    """ZeRO: the owned squares reduced over dp AND again over edp: the norm is off."""
    real = nd_ep.DataAxis

    def planted(data, *a, parts, norm_groups, **kw):
        return real(data, *a, parts=parts, norm_groups=(parts[1].group, *norm_groups), **kw)

    monkeypatch.setattr(nd_ep, "DataAxis", planted)
    runs, ref, _ = _run(Layout(dp=4, ep=2, zero=2), _cfg(), 8, 4, 1)
    assert not np.isclose(runs[0].grad_norms[0], ref.grad_norms[0], rtol=1e-6)


# ---- cp x ep: the ep group drawn from the dp ranks at the same cp coordinate ------------------
@pytest.mark.parametrize(
    "kw",
    [
        {"dp": 2, "ep": 2, "cp": 2},
        {"dp": 2, "ep": 2, "cp": 2, "zero": 1, "cp_method": "all-gather", "dispatch": "padded"},
        {"dp": 4, "ep": 2, "cp": 2, "zero": 2, "cp_method": "ulysses", "cp_balance": "contiguous"},
        {"dp": 4, "ep": 2, "cp": 2, "zero": 3, "recompute": "full"},
        {"dp": 4, "ep": 2, "cp": 2, "zero": 0, "microbatches": 1},
        {"dp": 2, "ep": 2, "cp": 2, "tp": 2, "zero": 3, "prefetch": True},
        {"dp": 2, "ep": 2, "cp": 2, "pp": 2, "zero": 2},
        {"dp": 2, "ep": 2, "cp": 2, "tp": 2, "sequence_parallel": True, "zero": 1},
        {"dp": 2, "ep": 2, "cp": 2, "tp": 2, "sequence_parallel": True, "cp_method": "all-gather"},
    ],
)
def test_cp_x_ep(kw):
    """Each cp rank's tokens of a micro-batch are one routing group (handed to the reference
    via parallel.context.train.routing_groups); dense gradients over dp x cp, expert gradients
    over edp x cp; every rank vs the reference, every axis's bytes vs nd.rank_bytes (cp: the
    attention formula), the all-to-alls per layer vs the routing counts, static memory."""
    kw = {"microbatches": 2, **kw}
    layout = Layout(**kw)
    L = 4 if layout.pp > 1 else 2
    _, dropped = check_ep(layout, _cfg(E=4, K=2, cf=0.75, L=L), B=8, S=8,
                          rerun=layout.recompute == "full")  # fmt: skip
    assert dropped > 0


def test_planted_bug_cp_experts_summed_over_edp_only_fails(monkeypatch):
    """cp x ep with the experts' group edp alone, not edp x cp: the cp ranks' expert gradients
    (of different tokens) are never summed - the expert gradients disagree."""

    class EdpOnly:  # the ep mesh, answering group("edp", "cp") with the edp group
        def __init__(self, mesh):
            self.mesh = mesh

        def group(self, *axes):
            return self.mesh.group("edp")

        def __getitem__(self, axis):
            return self.mesh[axis]

    real = nd_ep.ep_axis
    monkeypatch.setattr(
        nd_ep, "ep_axis", lambda data, mesh, *a, **kw: real(data, EdpOnly(mesh), *a, **kw)
    )
    runs, ref, _ = _run(Layout(dp=2, ep=2, cp=2, microbatches=2), _cfg(), 8, 8, 1)
    problems = compare_run(runs[0], ref, RTOL)[1]
    assert any(is_expert(p.split()[1].rstrip(":")) for p in problems if p.startswith("grad")), (
        problems[:4]
    )


# ---- bitwise replica checks: experts over edp, dense tensors over dp (ep) ----------------------
@pytest.mark.parametrize(
    "zero,label,name,cp",
    [(0, "edp", "blocks.1.moe.w1", 1), (0, "", "blocks.0.moe.router", 1),
     (1, "edp", "blocks.0.moe.b2", 1), (2, "", "head.w", 1), (0, "edp", "blocks.0.moe.w2", 2)],
)  # fmt: skip
def test_planted_replica_divergence_is_named(monkeypatch, zero, label, name, cp):
    """One replica's copy moved by one ulp after the last step (group rank 1 of the part's
    group: an edp (x cp) replica of the experts, a dp replica of a dense tensor): within the
    reference's 1e-12 everywhere, yet NDRun.replica_mismatch names the tensor on every rank
    of the group - and a clean run names nothing (the other tests)."""
    real = nd_ep.ep_axis

    def axis(*a, **kw):
        ax = real(*a, **kw)
        finish, k = ax.finish_step, [p.label for p in ax.parts].index(label)

        def planted():
            norm = finish()
            if ax.parts[k].group.rank == 1:
                held = ax.replicas()[0][name]  # DDP: the master; ZeRO-1/2: the compute copy
                held.flat[0] = np.nextafter(held.flat[0], np.inf)
            return norm

        ax.finish_step = planted
        return ax

    monkeypatch.setattr(nd_ep, "ep_axis", axis)
    layout = Layout(dp=4, ep=2, cp=cp, zero=zero, microbatches=2)
    runs, ref, _ = _run(layout, _cfg(), 8, 4 * cp, 1)
    where = "edp" if label else "dp"
    named = [r for r in runs if any(m.startswith(f"param {name} over {where} (group ranks [1]")
                                    for m in r.replica_mismatch)]  # fmt: skip
    # every group's rank 1 was moved, so every rank of the world sees it in its group
    assert len(named) == layout.world, [r.replica_mismatch for r in runs]
    assert all(not compare_run(r, ref, RTOL)[1] for r in runs)  # 1 ulp: the tolerance misses it


def test_check_layout_zero3_x_ep():
    """The public assertion (parallel.testing.check_layout) on a ZeRO-3 x ep layout: every
    rank's losses, gradients and params vs the reference, and its replicas bitwise."""
    worst = check_layout(Layout(dp=4, ep=2, zero=3, microbatches=2), _cfg(), steps=2, batch=8,
                         seq=4, weight_decay=0.1, max_norm=0.3)  # fmt: skip
    assert worst["param"] < RTOL, worst
