"""emulator/check.py: every layout's verdict. Each test shows a check failing when it should."""

from types import SimpleNamespace

import numpy as np
import pytest

from emulator.check import (
    assert_close,
    compare,
    compare_abs,
    compare_replicas,
    compare_run,
    verdict,
)
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from emulator.reference import reference_train


def model(**extra):
    """The model's largest |value| is 2; "bk" is noise-level (1e-20 < 1e-6 x 2)."""
    base = {"w": np.array([[1.0, -2.0], [0.5, 0.25]]), "bk": np.array([1e-20, -3e-21])}
    return base | extra


def run(losses=(2.0, 1.5), grads=None, params=None):
    return SimpleNamespace(losses=list(losses), grads=grads or model(), params=params or model())


def test_identical_dicts_pass_with_worst_zero():
    assert compare(model(), model(), 0.0) == (0.0, [])
    assert compare({}, {}, 0.0) == (0.0, [])


def test_noise_level_tensor_passes_only_within_rtol_times_the_models_largest_value():
    rtol, top = 1e-12, 2.0
    ok = model(bk=np.array([1e-20 + 0.9 * rtol * top, -3e-21]))  # 1e8 x its own scale
    worst, problems = compare(ok, model(), rtol)
    assert problems == [] and worst == pytest.approx(0.9 * rtol, rel=1e-3)
    bad = model(bk=np.array([1e-20 + 1.1 * rtol * top, -3e-21]))
    worst, problems = compare(bad, model(), rtol, "grad")
    assert worst == pytest.approx(1.1 * rtol, rel=1e-3)
    assert len(problems) == 1 and problems[0].startswith(
        "grad bk (noise-level, relative to the model's largest |grad| 2.000e+00): max rel diff 1.100e-12"
    )
    # noise_floor=0: every tensor against its own max |want|, so noise fails by far
    _, problems = compare(ok, model(), rtol, noise_floor=0)
    assert len(problems) == 1 and "param bk: max rel diff" in problems[0]


def test_a_tensor_above_the_noise_floor_is_compared_with_itself():
    want = model(b=np.array([1e-5, 0.0]))  # 1e-5 >= 1e-6 x 2: not noise
    got = model(b=np.array([1e-5 + 1e-15, 0.0]))  # 1e-10 of its own scale, 5e-16 of the model's
    _, problems = compare(got, want, 1e-12)
    assert len(problems) == 1 and problems[0].startswith("param b: max rel diff 1.000e-10")
    assert compare(got, want, 1e-12, noise_floor=1e-4)[1] == []


def test_real_mismatch_is_reported_with_its_name_difference_and_entries():
    got = model(w=np.array([[1.0, -2.0], [0.5, 0.25 + 2e-9]]))
    worst, problems = compare(got, model(), 1e-12, "grad")
    assert worst == pytest.approx(1e-9, rel=1e-6)
    assert len(problems) == 1
    assert problems[0].startswith("grad w: max rel diff 1.000e-09 > 1.0e-12")
    assert "[3] 0.250000002 vs 0.25" in problems[0]
    with pytest.raises(AssertionError, match="grad w: max rel diff"):
        assert_close(got, model(), 1e-12, "grad")


def test_missing_and_extra_names():
    got = {"w": model()["w"], "extra": np.zeros(2)}
    _, problems = compare(got, model(), 1e-12, "grad")
    assert problems == [
        "grads missing from the run: ['bk']",
        "grads the reference does not have: ['extra']",
    ]


@pytest.mark.parametrize("name", ["w", "bk"])
def test_nan_fails_also_in_a_noise_level_tensor(name):
    got = model()
    got[name] = got[name].copy()
    got[name][0, ...] = np.nan
    worst, problems = compare(got, model(), 1e30)
    assert np.isnan(worst)
    assert len(problems) == 1 and problems[0].startswith(f"param {name}")
    assert "[0] nan vs" in problems[0]


def test_shape_mismatch_is_a_problem_not_an_exception():
    got = model(w=np.zeros((2, 3)))
    _, problems = compare(got, model(), 1e-12)
    assert problems == ["param w: shape (2, 3) does not match the reference's (2, 2)"]


def test_compare_abs():
    got = model(w=model()["w"] + 1e-3)
    assert compare_abs(got, model(), 2e-3) == (pytest.approx(1e-3), [])
    _, problems = compare_abs(got, model(), 5e-4)
    assert len(problems) == 1 and problems[0].startswith("param w: max |diff| 1.000e-03 > 5.0e-04")


def test_compare_run_passes_an_identical_run():
    assert compare_run(run(), run(), 0.0) == ({"loss": 0.0, "grad": 0.0, "param": 0.0}, [])


def test_compare_run_reports_losses():
    worst, problems = compare_run(run(losses=(2.0, 1.5 + 2e-9)), run(), 1e-12)
    assert worst["loss"] == pytest.approx(1e-9, rel=1e-6)
    assert len(problems) == 1 and problems[0].startswith("losses differ by 1.000e-09 > 1.0e-12")
    _, problems = compare_run(run(losses=(2.0,)), run(), 1e-12)
    assert problems == ["1 losses against the reference's 2"]
    worst, problems = compare_run(run(losses=(2.0, np.nan)), run(), 1e-12)
    assert np.isnan(worst["loss"]) and problems[0].startswith("losses differ by nan")


def test_compare_run_reports_grads_and_params_by_name():
    grads = model(w=model()["w"] * (1 + 1e-9))
    params = model(bk=np.array([1.0, 0.0]))
    worst, problems = compare_run(run(grads=grads, params=params), run(), 1e-12)
    assert worst["grad"] == pytest.approx(1e-9, rel=1e-6) and worst["param"] == 0.5
    assert [p.split(" ")[:2] for p in problems] == [["grad", "w:"], ["param", "bk"]]
    assert "(noise-level" in problems[1]


def test_compare_run_passes_noise_floor_on():
    noisy = model(bk=np.array([1e-20 + 1e-13, -3e-21]))  # 5e-14 of the model's largest value
    assert compare_run(run(grads=noisy, params=noisy), run(), 1e-12)[1] == []
    _, problems = compare_run(run(grads=noisy, params=noisy), run(), 1e-12, noise_floor=0)
    assert [p.split(":")[0] for p in problems] == ["grad bk", "param bk"]


def test_compare_run_param_atol_replaces_the_relative_parameter_test_only():
    params = model(w=model()["w"] + 1e-3)
    worst, problems = compare_run(run(params=params), run(), 1e-12, param_atol=2e-3)
    assert problems == [] and worst["param"] == pytest.approx(1e-3)
    _, problems = compare_run(run(params=params), run(), 1e-12, param_atol=5e-4)
    assert [p.split(":")[0] for p in problems] == ["param w"]
    grads = model(w=model()["w"] * (1 + 1e-9))  # gradients stay relative to rtol
    _, problems = compare_run(run(grads=grads), run(), 1e-12, param_atol=1.0)
    assert [p.split(":")[0] for p in problems] == ["grad w"]


def test_attn_bk_is_rounding_noise_that_only_the_noise_floor_lets_through():
    """Two correct float64 runs that sum micro-batches in another order: every tensor agrees
    to ~1e-16 except attn.bk, whose exact gradient is 0 (softmax ignores a per-query
    constant), so its gradient and the parameters AdamW makes of it are rounding noise."""
    cfg = ModelConfig(vocab_size=8, max_seq_len=8, d_model=8, n_heads=2, n_layers=2)
    batches = lambda s: synthetic_batch(7, s, 4, 4, cfg.vocab_size)
    one = reference_train(cfg, 3, batches, 2)
    two = reference_train(cfg, 3, batches, 2, microbatches=2)
    worst, problems = compare_run(two, one, 1e-12)
    assert problems == [] and max(worst.values()) < 1e-14
    for what in ("grad", "param"):
        got, want = getattr(two, what + "s"), getattr(one, what + "s")
        _, problems = compare(got, want, 1e-12, what, noise_floor=0)
        assert {p.split(":")[0] for p in problems} == {
            f"{what} blocks.{i}.attn.bk" for i in range(cfg.n_layers)
        }


def test_verdict_line():
    assert (
        verdict([], "3 steps, max rel diff 1e-16") == "VERDICT: PASS - 3 steps, max rel diff 1e-16"
    )
    _, problems = compare(model(w=np.zeros((2, 2))), model(), 1e-12, "grad")
    line = verdict([*problems, "rank 1 bytes 8 != 16"], "unused")
    assert line == "VERDICT: FAIL - grad w: max rel diff 1.000e+00 > 1.0e-12; rank 1 bytes 8 != 16"
    line = verdict([f"rank {r}: bytes" for r in range(6)], "unused")
    assert (
        line
        == "VERDICT: FAIL - rank 0: bytes; rank 1: bytes; rank 2: bytes; rank 3: bytes; 2 more above"
    )


def test_compare_replicas_names_the_rank_field_and_tensor_bitwise():
    a = {"losses": [1.0, 2.0], "params": {"w": np.ones(3), "b": np.zeros(2)}}
    same = {"losses": [1.0, 2.0], "params": {"w": np.ones(3), "b": np.zeros(2)}}
    off = {
        "losses": [1.0, 2.0],
        "params": {"w": np.array([1.0, 1.0, 1.0 + 2**-52]), "b": np.zeros(2)},
    }
    assert compare_replicas([a, same], ("losses", "params")) == []
    assert compare_replicas([a, same, off], ("losses", "params")) == [
        "replicas differ: rank 2's params w != rank 0's"
    ]
    late = {"losses": [1.0, 2.5], "params": {"w": np.ones(3)}}  # a missing tensor counts too
    assert compare_replicas([a, late], ("losses", "params")) == [
        "replicas differ: rank 1's losses (all) != rank 0's",
        "replicas differ: rank 1's params b != rank 0's",
    ]


def test_verdict_skip_is_not_a_pass_and_a_failure_wins():
    assert verdict([], "x", skipped="nothing comparable") == "VERDICT: SKIP - nothing comparable; x"
    assert verdict(["bad"], "x", skipped="nothing").startswith("VERDICT: FAIL - bad")
    assert verdict([], "x") == "VERDICT: PASS - x"
