"""parallel/clip.py: the one global-norm clipping of every layout vs the single-rank clip."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from emulator.optim import clip_grad_norm
from parallel.clip import clip_, global_grad_norm, local_norm_sq


def test_norm_over_dp_then_tp_with_replicated_weights_equals_single_rank():
    """A 2 (dp) x 2 (tp) mesh: "w" is sharded over tp and split over dp (as ZeRO shards it),
    "gain" is replicated over tp (weight 1/2) and split over dp. The norm is the whole gradient's, identical in
    every bit on every rank, and the clipped grads are the reference's."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(4, 6))  # the whole model's gradient
    gain = rng.normal(size=5)
    want_grads = {"w": w.copy(), "gain": gain.copy()}
    want_norm = clip_grad_norm(want_grads, 0.5)

    def body(comm):
        mesh = emulator.Mesh(comm, dp=2, tp=2)
        d, t = mesh.coord("dp"), mesh.coord("tp")
        # w: rows by tp, columns by dp; gain: whole on every tp rank, split over dp
        mine = {
            "w": w[2 * t : 2 * t + 2, 3 * d : 3 * d + 3].copy(),
            "gain": gain[3 * d : 3 * d + 3].copy(),
        }
        norm, coef = clip_(mine, 0.5, (mesh["dp"], mesh["tp"]), weights={"gain": 0.5})
        return d, t, norm, coef, mine

    out = emulator.spawn(body, 4, timeout=30)
    assert len({(n, c) for *_, n, c, _ in out}) == 1  # one norm, bitwise, on all ranks
    norm = out[0][2]
    assert abs(norm - want_norm) <= 1e-15 * want_norm  # summation order only
    assert out[0][3] < 1.0  # the clip is active, so the scaled values below are checked
    for d, t, _, _, g in out:
        want_w = want_grads["w"][2 * t : 2 * t + 2, 3 * d : 3 * d + 3]
        np.testing.assert_allclose(g["w"], want_w, rtol=1e-15)
        # the replicated gain: each tp copy is clipped by the same coefficient, not 1/2 of it
        np.testing.assert_allclose(g["gain"], want_grads["gain"][3 * d : 3 * d + 3], rtol=1e-15)


def test_no_groups_no_clip_and_bad_max_norm():
    g = {"a": np.array([3.0, 4.0])}
    assert local_norm_sq(g) == 25.0 and local_norm_sq([g["a"]]) == 25.0
    assert global_grad_norm(25.0) == (5.0, 1.0)  # max_norm None: coef 1
    assert global_grad_norm(g, max_norm=1.0)[1] == pytest.approx(1 / (5 + 1e-6), rel=1e-15)
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        global_grad_norm(g, max_norm=0.0)
