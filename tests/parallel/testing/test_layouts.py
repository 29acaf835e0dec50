"""The kit's layout strategies: drawn valid layouts are valid to the N-D program and train as
the reference does; drawn invalid ones are refused naming what is wrong; check_layout with a
Layout compares every rank (a planted divergence on one rank is named)."""

import dataclasses

import pytest
from hypothesis import given, settings

import parallel.testing.assertions as kit
from emulator.model import ModelConfig
from parallel.layout import Layout
from parallel.testing import check_layout
from parallel.testing.layouts import invalid_layouts, layouts

CFG = ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=4, n_layers=4, d_ff=16)
B, S = 8, 4


@settings(max_examples=30, deadline=None)
@given(layouts(world=8, cfg=CFG, batch=(B, S)))
def test_drawn_layouts_are_valid_for_the_program(layout):
    assert layout.world == 8
    assert layout.problems(8, CFG, (B, S)) == []


@settings(max_examples=6, deadline=None)
@given(layouts(world=4, cfg=CFG, batch=(B, S)))
def test_drawn_layouts_train_as_the_reference(layout):
    worst = check_layout(layout, CFG, batch=B, seq=S, steps=2, weight_decay=0.1, max_norm=0.5)
    assert max(worst.values()) < 1e-12


@settings(max_examples=30, deadline=None)
@given(invalid_layouts(world=8, cfg=CFG, batch=(B, S)))
def test_drawn_invalid_layouts_are_refused_naming_the_problem(case):
    layout, fragment = case
    with pytest.raises(ValueError, match="cannot run") as err:
        layout.validate(8, CFG, (B, S))
    assert fragment in str(err.value)


def test_check_layout_with_a_layout_names_the_rank_that_diverged(monkeypatch):
    real = kit.train

    def rank3_perturbed(comm, layout, cfg, batches, steps, seed, **optim):
        run = real(comm, layout, cfg, batches, steps, seed, **optim)
        if comm.rank == 3:  # the planted bug: one rank's copy of the model is off
            run.params = {n: p * (1 + 1e-9) for n, p in run.params.items()}
        return run

    monkeypatch.setattr(kit, "train", rank3_perturbed)
    with pytest.raises(AssertionError) as err:
        check_layout(Layout(dp=2, tp=2, zero=1), CFG, batch=B, seq=S)
    assert str(err.value).startswith("rank 3: ") and "param embed.tok" in str(err.value)


def test_check_layout_refuses_a_wrong_world_and_an_unstated_tolerance():
    with pytest.raises(ValueError, match="needs 4 ranks"):
        check_layout(Layout(dp=4), CFG, world_size=2)
    with pytest.raises(ValueError, match="float32 needs its own tolerance"):
        check_layout(dataclasses.replace(Layout(dp=2), dtype="float32"), CFG)
