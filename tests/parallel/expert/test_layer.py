"""The expert-parallel MoE layer vs emulator/moe.py on the gathered routing groups (float64):
outputs, aux, dm, every parameter gradient, and the ledger's bytes vs parallel/expert/cost.py."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator import moe
from parallel.expert.layer import ep_moe_backward, ep_moe_forward, local_experts
from tests.emulator.fd_helpers import assert_close
from tests.parallel.expert.helpers import TOL, check, check_bytes, params, run

MODES = ("exact", "padded")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("cf", [0.5, 1.0, 8.0])  # 8 = E: C >= N, nothing can drop
def test_matches_reference(mode, K, cf):
    ref, out = run(4, 8, K, cf, mode=mode, seed=K)
    check(ref, out, 4)
    check_bytes(ref, out, mode)
    routes = [r for rs in ref[4] for r in rs]
    dropped = sum(int((~r["keep"]).sum()) for r in routes)
    assert (dropped == 0) == (cf == 8.0)  # the cases do (not) drop, as named


@pytest.mark.parametrize("mode", MODES)
def test_everything_dropped(mode):
    ref, out = run(2, 4, 2, 0.0, mode=mode)
    check(ref, out, 2)
    check_bytes(ref, out, mode)
    assert np.all(np.concatenate([o[0] for o in out]) == 0)  # no expert contributes
    assert all(o[4]["fwd/dispatch"] == (0, 0) for o in out)


@pytest.mark.parametrize("mode", MODES)
def test_expert_without_tokens_and_one_hot_expert(mode):
    ref, out = run(4, 8, 2, 1.0, mode=mode, hot=5, cold=2, positive=True, seed=3)
    check(ref, out, 4)
    check_bytes(ref, out, mode)
    routes = [r for rs in ref[4] for r in rs]
    first = np.concatenate([r["topi"][:, 0] for r in routes])
    assert np.all(first == 5)  # every token's first choice is expert 5 ...
    assert not any(np.any(r["expert"] == 2) for r in routes)  # ... and nobody picks expert 2
    assert any(np.any(~r["keep"]) for r in routes)  # expert 5 overflows: choices dropped
    if mode == "exact":
        assert all(int(o[5][:, 0].sum()) == 0 for o in out[1:2])  # rank 1 owns expert 2: no rows


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("P,E", [(4, 4), (2, 4), (3, 6), (1, 3)])
def test_e_equals_ep_and_two_ep(mode, P, E):
    ref, out = run(P, E, min(2, E), 1.0, mode=mode, seed=P + E)
    check(ref, out, P)
    check_bytes(ref, out, mode)


@pytest.mark.parametrize("mode", MODES)
def test_several_routing_groups_per_rank(mode):
    ref, out = run(2, 4, 2, 0.75, mode=mode, B=2, S=4, n_groups=2, seed=7)
    check(ref, out, 2)
    check_bytes(ref, out, mode)


@settings(max_examples=12, deadline=None)
@given(
    P=st.integers(1, 4),
    per=st.integers(1, 2),
    K=st.integers(1, 3),
    cf=st.sampled_from([0.0, 0.4, 1.0, 1.5, 4.0]),
    B=st.integers(1, 2),
    S=st.integers(1, 4),
    mode=st.sampled_from(MODES),
    seed=st.integers(0, 99),
    n_groups=st.integers(1, 2),
)
def test_property(P, per, K, cf, B, S, mode, seed, n_groups):
    E, n_groups = P * per, min(n_groups, B * S)
    ref, out = run(P, E, min(K, E), cf, B=B, S=S, mode=mode, seed=seed, n_groups=n_groups)
    check(ref, out, P)
    check_bytes(ref, out, mode)


def test_exact_mode_uneven_batches_per_rank():
    """Ranks with different token counts (so different capacities): exact mode still equals the
    reference on the same groups (padded mode refuses: test_errors.py)."""
    rng, Bs, S, H = np.random.default_rng(5), [3, 1], 2, 4
    mp, M = params(rng, H, 5, 4), rng.normal(size=(sum(Bs), S, H))
    dY = rng.normal(size=M.shape)
    groups = [np.arange(0, 6), np.arange(6, 8)]
    y, aux, c = moe.moe_forward(mp, M, groups, top_k=2, capacity_factor=0.75)
    dm, g = moe.moe_backward(dY, c, 0.2)

    def fn(comm):
        sl = slice(0, 3) if comm.rank == 0 else slice(3, 4)
        kw = {"top_k": 2, "capacity_factor": 0.75}
        yr, a, cache = ep_moe_forward(comm, local_experts(mp, comm.rank, 2), M[sl], None, **kw)
        return (yr, a, *ep_moe_backward(dY[sl], cache, 0.1))

    out = emulator.spawn(fn, 2)
    assert_close("y", np.concatenate([o[0] for o in out]), y, **TOL)
    assert_close("dm", np.concatenate([o[2] for o in out]), dm, **TOL)
    assert_close("w1", np.concatenate([o[3]["w1"] for o in out]), g["w1"], **TOL)
    assert_close("router", out[0][3]["router"] + out[1][3]["router"], g["router"], **TOL)
    assert abs((out[0][1] + out[1][1]) / 2 - aux) < 1e-12
