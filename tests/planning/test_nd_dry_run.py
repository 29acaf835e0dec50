"""A dry run of the one N-D program (parallel.train) records exactly what a real run records: on
every rank of every layout drawn (dp x pp x tp, ZeRO 0-3, SP, every schedule, recompute, dtype,
dense and MoE) the bytes per (tag, op, algorithm, direction, peer, group), per axis, and the
memory ledger's current and peak bytes per category (after the run and NDRun.memory before it
frees) equal the real run's on virtual ranks; and every rank is its representative's twin."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emulator.config import ModelConfig
from parallel.layout import Layout
from planning.nd_dryrun import (
    dry_nd,
    real_nd,
    representative,
    representatives,
    role_figures,
    stands_for,
)


def cfg_of(experts=0):
    return ModelConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=4, n_layers=4,
                       n_experts=experts, moe_top_k=min(2, max(experts, 1)))  # fmt: skip


def assert_dry_equals_real(cfg, lay, B, S=8):
    real = real_nd(cfg, lay, B, S)
    dry = dry_nd(cfg, lay, B, S, ranks=range(lay.world))
    for r in range(lay.world):
        got = dry[r]["figures"]
        for k in ("bytes", "axes", "memory", "run_memory"):
            assert got[k] == real[r][k], f"rank {r} {k}"
        assert sum(got["bytes"].values()) > 0 or lay.world == 1
    return real


@st.composite
def nd_layouts(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4) if (world // tp) % d == 0]))
    zero = draw(st.integers(0, 3))
    names = ["gpipe", "1f1b"] + ["interleaved"] * (pp == 2) + ["zb-h1"] * (tp == 1 and zero < 3)
    sched = draw(st.sampled_from(names))
    m = pp * draw(st.integers(1, 2)) if sched == "interleaved" else draw(st.integers(1, 3))
    rcs = ["none", "selective"] + ["full"] * (tp == 1 and sched != "zb-h1")
    return Layout(dp=world // (tp * pp), pp=pp, tp=tp, zero=zero, schedule=sched,
                  microbatches=m, chunks=2 if sched == "interleaved" else 1,
                  recompute=draw(st.sampled_from(rcs)),
                  sequence_parallel=tp > 1 and draw(st.booleans()),
                  dtype=draw(st.sampled_from(["float64", "float32", "mixed"])),
                  prefetch=draw(st.booleans()), reshard_after_forward=draw(st.booleans()))  # fmt: skip


@settings(max_examples=10, deadline=None)
@given(lay=nd_layouts(), moe=st.booleans(), rows=st.integers(1, 2))
def test_nd_dry_run_equals_the_real_run_on_every_rank(lay, moe, rows):
    assert_dry_equals_real(cfg_of(4 if moe else 0), lay, B=lay.dp * lay.microbatches * rows)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(dp=2, pp=2, tp=2, zero=1, sequence_parallel=True, microbatches=2, dtype="mixed"),
        Layout(dp=2, pp=2, tp=2, zero=3, microbatches=3, schedule="gpipe"),
        Layout(dp=2, pp=4, zero=2, microbatches=4, dtype="mixed"),
    ],
    ids=str,
)
def test_every_rank_is_its_representatives_twin(lay):
    real = assert_dry_equals_real(cfg_of(), lay, B=lay.dp * lay.microbatches * 2)
    reps = representatives(lay)
    assert len(reps) == lay.pp  # one per stage; cp = 1
    # the representatives partition the world
    assert sorted(r for rep in reps for r in stands_for(lay, rep)) == list(range(lay.world))
    for r in range(lay.world):
        rep = representative(lay, r)
        assert rep in reps
        assert role_figures(real[r]) == role_figures(real[rep]), f"rank {r} vs {rep}"


def test_representatives_are_stage_and_mesh_coordinates():
    # the mesh parallel.train builds (Layout.mesh) places each rank; a representative is its
    # own stage at dp = tp = 0
    import emulator

    lay = Layout(dp=2, pp=2, tp=2)
    coords = emulator.spawn(lambda c: dict(lay.mesh(c).coords), lay.world, timeout=60)
    for r, co in enumerate(coords):
        rep = coords[representative(lay, r)]
        assert (rep["pp"], rep["cp"], rep["dp"], rep["tp"]) == (co["pp"], co["cp"], 0, 0), r
    assert representatives(Layout(pp=3, tp=4, dp=2)).keys() == {0, 4, 8}


def test_a_layout_that_does_not_fit_is_refused_by_name():
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=4"):
        dry_nd(cfg_of(), Layout(tp=3), 2, 8)
    with pytest.raises(ValueError, match="virtual stages but the model has only 4 blocks"):
        dry_nd(cfg_of(), Layout(pp=8), 8, 8)


@pytest.mark.parametrize(
    "lay",
    [
        Layout(dp=2, cp=2, tp=2, dtype="mixed"),
        Layout(cp=2, pp=2, microbatches=2, zero=1, dtype="mixed"),
        Layout(dp=2, cp=2, cp_method="ulysses", cp_balance="contiguous", zero=2),
    ],
    ids=str,
)
def test_context_parallel_layouts_of_parallel_train(lay):
    # one representative per (stage, cp rank): cp ranks hold different parts of the sequence
    real = assert_dry_equals_real(cfg_of(), lay, B=lay.dp * lay.microbatches * 2)
    assert len(representatives(lay)) == lay.pp * lay.cp
    for r in range(lay.world):
        assert role_figures(real[r]) == role_figures(real[representative(lay, r)]), r


def test_dry_comm_errors_are_named():
    from emulator.dry import DryComm

    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        DryComm(4, 4)
    with pytest.raises(ValueError, match="shape= and dtype="):
        DryComm(2, 0).recv(1)
