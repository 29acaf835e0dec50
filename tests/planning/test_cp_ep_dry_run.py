"""Context and expert parallelism in the dry run of parallel.train, and nd_cost's closed forms
for them: on every rank of cp and ep layouts (ZeRO 0-3, and cp x ep) drawn by hypothesis, the dry run's bytes (per tag
and per axis) and memory (current and peak per category) equal the real run's on virtual ranks,
and the real run's bytes per axis and peaks per category - activations included, by
nd_cost_cp_ep.peak_activations (cp: the cp rank's S/C tokens and its method's attention cache;
ep: the capacity-padded expert buffers) - equal the formulas exactly."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.config import ModelConfig
from parallel import nd_cost_cp_ep
from parallel.layout import Layout
from planning.nd_dryrun import dry_nd, real_nd, representative, representatives, role_figures
from planning.nd_report import differences, formulas


def cfg_of(experts=0, L=4, cf=1.25, K=2, dtype="float64"):
    return ModelConfig(vocab_size=32, max_seq_len=16, d_model=16, n_heads=4, n_layers=L,
                       n_experts=experts, moe_top_k=min(K, max(experts, 1)), capacity_factor=cf,
                       dtype=dtype)  # fmt: skip


def assert_all_equal(cfg, lay, B, S):
    """dry == real on every rank; real == nd_cost's formulas on every rank; -> real."""
    real = real_nd(cfg, lay, B, S)
    dry = dry_nd(cfg, lay, B, S, ranks=range(lay.world))
    cfg = dataclasses.replace(cfg, dtype=lay.dtype)
    for r in range(lay.world):
        for k in ("bytes", "axes", "memory", "run_memory"):
            assert dry[r]["figures"][k] == real[r][k], f"rank {r} {k}"
        want = formulas(cfg, lay, B, S, r)
        assert "activations" in want["peak"]
        assert differences(real[r], want) == [], (r, real[r]["axes"], want)
        rep = representative(lay, r)
        assert rep in representatives(lay)
        assert role_figures(real[r]) == role_figures(real[rep]), f"rank {r} vs {rep}"
    return real


@st.composite
def cp_layouts(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    cp = draw(st.sampled_from([c for c in (2, 4) if world % c == 0]))
    tp = draw(st.sampled_from([t for t in (1, 2) if (world // cp) % t == 0]))
    pp = draw(st.sampled_from([p for p in (1, 2) if (world // (cp * tp)) % p == 0]))
    method = draw(st.sampled_from(["ring", "all-gather", "ulysses"]))
    if method == "ulysses" and (4 // tp) % cp:
        method = "ring"  # 4 heads: ulysses needs cp | 4 / tp
    sched = draw(st.sampled_from(["gpipe", "1f1b"] + ["interleaved"] * (pp == 2)))
    m = pp * draw(st.integers(1, 2)) if sched == "interleaved" else draw(st.integers(1, 2))
    rcs = ["none", "selective"] + ["full"] * (tp == 1)
    return Layout(dp=world // (cp * tp * pp), pp=pp, tp=tp, cp=cp, cp_method=method,
                  cp_balance=draw(st.sampled_from(["zigzag", "contiguous"])),
                  zero=draw(st.integers(0, 3)), schedule=sched, microbatches=m,
                  chunks=2 if sched == "interleaved" else 1, recompute=draw(st.sampled_from(rcs)),
                  dtype=draw(st.sampled_from(["float64", "mixed"])))  # fmt: skip


@settings(max_examples=8, deadline=None)
@given(lay=cp_layouts(), moe=st.booleans(), rows=st.integers(1, 2))
def test_cp_layouts_dry_real_and_formulas(lay, moe, rows):
    S = 8 * rows  # 2 cp chunks of a zigzag over 4 ranks: S divisible by 8
    assert_all_equal(cfg_of(4 if moe else 0), lay, B=lay.dp * lay.microbatches, S=S)


@st.composite
def ep_layouts(draw):
    world = draw(st.sampled_from([2, 4, 8]))
    tp = draw(st.sampled_from([t for t in (1, 2) if world % t == 0 and world // t >= 2]))
    pp = draw(
        st.sampled_from([p for p in (1, 2) if (world // tp) % p == 0 and world // (tp * p) >= 2])
    )
    dp = world // (tp * pp)
    ep = draw(st.sampled_from([e for e in (2, 4) if dp % e == 0]))
    sched = draw(st.sampled_from(["gpipe", "1f1b"] + ["interleaved"] * (pp == 2)))
    m = pp * draw(st.integers(1, 2)) if sched == "interleaved" else draw(st.integers(1, 2))
    rcs = ["none", "selective"] + ["full"] * (tp == 1)
    return Layout(dp=dp, pp=pp, tp=tp, ep=ep, dispatch="padded", schedule=sched, microbatches=m,
                  chunks=2 if sched == "interleaved" else 1, recompute=draw(st.sampled_from(rcs)),
                  zero=draw(st.integers(0, 3)),
                  sequence_parallel=tp > 1 and draw(st.booleans()),
                  dtype=draw(st.sampled_from(["float64", "mixed"])))  # fmt: skip


@settings(max_examples=8, deadline=None)
@given(lay=ep_layouts(), K=st.integers(1, 2), cf=st.sampled_from([0.75, 1.0, 2.0]))
def test_ep_layouts_padded_to_capacity_dry_real_and_formulas(lay, K, cf):
    assert_all_equal(cfg_of(4, K=K, cf=cf), lay, B=lay.dp * lay.microbatches * 2, S=4)


CP_EP = {"dp": 2, "cp": 2, "ep": 2, "dispatch": "padded"}
CP_EP_ZERO3 = Layout(**CP_EP, zero=3, cp_method="all-gather", cp_balance="contiguous",
                     recompute="full")  # fmt: skip
CP_EP_TP_SP = Layout(**CP_EP, tp=2, zero=1, cp_method="ulysses", sequence_parallel=True,
                     dtype="mixed")  # fmt: skip


@pytest.mark.parametrize(
    "lay, experts, S",
    [
        (Layout(dp=2, cp=2, tp=2, cp_method="ring", dtype="mixed"), 0, 16),
        (Layout(cp=2, pp=2, microbatches=2, cp_method="ulysses", cp_balance="contiguous"), 0, 8),
        (Layout(cp=4, recompute="full", cp_method="all-gather"), 0, 8),
        (Layout(dp=4, ep=2, pp=2, microbatches=2, dispatch="padded", recompute="full"), 4, 4),
        (Layout(dp=2, ep=2, tp=2, microbatches=2, dispatch="padded", sequence_parallel=True), 4, 4),
        (Layout(dp=4, ep=2, zero=3, prefetch=True, dispatch="padded"), 4, 4),
        (Layout(dp=2, ep=2, pp=2, zero=2, microbatches=2, dispatch="padded"), 4, 4),
        (Layout(dp=2, cp=2, ep=2, dispatch="padded", cp_method="ring"), 4, 8),
        (CP_EP_ZERO3, 4, 8),
        (CP_EP_TP_SP, 4, 8),
    ],
    ids=str,
)
def test_cp_and_ep_examples(lay, experts, S):
    real = assert_all_equal(cfg_of(experts, cf=0.75), lay, B=lay.dp * lay.microbatches * 2, S=S)
    for axis in ("cp",) * (lay.cp > 1) + ("ep",) * (lay.ep > 1):
        assert all(fig["axes"][axis] > 0 for fig in real)  # the axis's traffic ran, was priced


def test_ep_activation_formula_refuses_exact_dispatch_and_dry_run_too():
    lay = Layout(dp=2, ep=2, dispatch="exact")
    with pytest.raises(ValueError, match="a closed form needs dispatch='padded'"):
        nd_cost_cp_ep.peak_activations(cfg_of(4), lay, 4, 4, {"pp": 0, "cp": 0})
    with pytest.raises(ValueError, match="exact dispatch sends the routed rows themselves"):
        dry_nd(cfg_of(4), lay, 4, 4)
    both = Layout(dp=2, cp=2, ep=2, dispatch="exact")  # cp x ep: the same rule
    with pytest.raises(ValueError, match="a closed form needs dispatch='padded'"):
        nd_cost_cp_ep.peak_activations(cfg_of(4), both, 4, 8, {"pp": 0, "cp": 0})
