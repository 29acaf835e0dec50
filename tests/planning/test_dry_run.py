"""A dry run records exactly what a real run records: for every rank of every supported layout,
the bytes per (tag, op, algorithm, direction, peer, group) and the memory ledger's current and
peak bytes per category equal those of the same layout run for real on virtual ranks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.config import ModelConfig
from emulator.dry import DryComm
from planning.dryrun import (
    Layout,
    dry_layout,
    real_layout,
    representative,
    representatives,
    role_figures,
)


def cfg_of(dtype="mixed", L=3, H=12, A=3, V=30, T=8):
    return ModelConfig(vocab_size=V, max_seq_len=T, d_model=H, n_heads=A, n_layers=L, dtype=dtype)


def assert_equal_everywhere(cfg, lay, B, S):
    real = real_layout(cfg, lay, B, S)
    dry = dry_layout(cfg, lay, B, S, ranks=range(lay.size))
    for r in range(lay.size):
        got = dry[r]["figures"]
        assert got["bytes"] == real[r]["bytes"], f"rank {r} bytes"
        assert got["memory"] == real[r]["memory"], f"rank {r} memory"
        assert sum(got["bytes"].values()) > 0 or lay.size == 1


@settings(max_examples=12, deadline=None)
@given(
    D=st.integers(1, 4),
    zero=st.integers(0, 3),
    k=st.integers(1, 2),
    rc=st.sampled_from(["none", "selective", "full"]),
    dtype=st.sampled_from(["float64", "float32", "mixed"]),
    prefetch=st.booleans(),
    reshard=st.booleans(),
)
def test_data_parallel_dry_equals_real(D, zero, k, rc, dtype, prefetch, reshard):
    lay = Layout(dp=D, zero=zero, microbatches=k, recompute=rc, prefetch=prefetch,
                 reshard=reshard)  # fmt: skip
    assert_equal_everywhere(cfg_of(dtype), lay, B=2 * D * k, S=7)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(tp=2),
        Layout(tp=4, sp=True, recompute="selective"),
        Layout(dp=2, tp=2, sp=True, zero=1),
        Layout(pp=2, microbatches=4, schedule="gpipe"),
        Layout(pp=3, microbatches=3, schedule="1f1b", recompute="full"),
        Layout(dp=2, pp=2, microbatches=2, schedule="1f1b", zero=1),
        Layout(pp=2, microbatches=4, schedule="interleaved", chunks=2),
        Layout(pp=2, microbatches=4, schedule="zb-h1"),
    ],
    ids=str,
)
def test_tensor_and_pipeline_dry_equals_real(lay):
    cfg = cfg_of("mixed", L=4, H=16, A=4, V=32)
    B = lay.dp * lay.microbatches * 2
    assert_equal_everywhere(cfg, lay, B=B, S=8)


@st.composite
def model_parallel_layouts(draw):
    dp, zero = draw(st.integers(1, 2)), draw(st.integers(0, 1))
    rc = draw(st.sampled_from(["none", "selective", "full"]))
    if draw(st.booleans()):
        rc = "selective" if rc == "full" else rc  # the tp code recomputes none or selective
        return Layout(dp=dp, tp=draw(st.sampled_from([2, 4])), zero=zero, recompute=rc,
                      sp=draw(st.booleans()), microbatches=draw(st.integers(1, 2)))  # fmt: skip
    sched = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    pp = draw(st.integers(2, 3 if sched != "interleaved" else 2))
    m = pp * draw(st.integers(1, 2)) if sched == "interleaved" else draw(st.integers(1, 4))
    rc = "none" if sched == "zb-h1" and rc == "full" else rc
    return Layout(dp=dp, pp=pp, zero=zero, microbatches=m, schedule=sched, recompute=rc,
                  chunks=2 if sched == "interleaved" else None)  # fmt: skip


@settings(max_examples=8, deadline=None)
@given(lay=model_parallel_layouts())
def test_model_parallel_dry_equals_real_hypothesis(lay):
    cfg = cfg_of("mixed", L=4, H=16, A=4, V=32)
    assert_equal_everywhere(cfg, lay, B=lay.dp * lay.microbatches * 2, S=8)


@pytest.mark.parametrize(
    "lay, B",
    [
        (Layout(dp=5, zero=3, microbatches=2), 20),
        (Layout(dp=3, tp=2, sp=True), 6),
        (Layout(dp=2, pp=4, microbatches=4), 16),
        (Layout(dp=4, zero=1), 8),
    ],
    ids=str,
)
def test_each_rank_is_its_representatives_twin(lay, B):
    real = real_layout(cfg_of("mixed", L=4, H=16, A=4, V=32), lay, B, 8)
    for r, fig in enumerate(real):
        rep = representative(lay, r)
        assert rep in representatives(lay)
        assert role_figures(fig) == role_figures(real[rep]), f"rank {r} vs {rep}"


def test_bad_layouts_and_comm_errors():
    with pytest.raises(ValueError, match="tp x pp"):
        Layout(tp=2, pp=2).check()
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        DryComm(4, 4)
    with pytest.raises(ValueError, match="shape= and dtype="):
        DryComm(2, 0).recv(1)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(dp=2, zero=0),
        Layout(dp=2, zero=2, microbatches=2),
        Layout(dp=3, zero=3),
        Layout(tp=2, sp=True),
        Layout(pp=2, microbatches=2),
    ],
    ids=str,
)
def test_moe_dry_equals_real(lay):
    # every MoE buffer is capacity-sized (E x C slots, filled or not), so sizes do not depend on
    # the routing; a dry run's routing reads as zeros and steers no size
    cfg = ModelConfig(vocab_size=30, max_seq_len=8, d_model=12, n_heads=2, n_layers=2,
                      n_experts=4, moe_top_k=2, dtype="mixed")  # fmt: skip
    assert_equal_everywhere(cfg, lay, B=lay.dp * lay.microbatches * 2, S=8)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(cp=2),
        Layout(dp=2, cp=2, cp_method="all-gather", cp_balance="contiguous"),
        Layout(cp=2, cp_method="ulysses", recompute="selective", microbatches=2),
    ],
    ids=str,
)
def test_context_parallel_dry_equals_real(lay):
    cfg = cfg_of("mixed", L=2, H=12, A=2, V=30)
    assert_equal_everywhere(cfg, lay, B=lay.dp * lay.microbatches * 2, S=8)


def test_context_parallel_ranks_are_their_representatives_twins():
    lay = Layout(dp=2, cp=2, cp_balance="contiguous")
    real = real_layout(cfg_of("mixed", L=2, H=12, A=2, V=30), lay, 4, 8)
    assert sorted(representatives(lay)) == [0, 1]
    for r, fig in enumerate(real):
        assert role_figures(fig) == role_figures(real[representative(lay, r)]), r
