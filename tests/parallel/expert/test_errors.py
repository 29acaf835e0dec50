"""Bad input to the expert-parallel layer: a clear named error on every path, never a hang."""

import numpy as np
import pytest

import emulator
from parallel.expert import dispatch as dx
from parallel.expert.layer import check_ep, ep_moe_forward, local_experts
from tests.parallel.expert.helpers import params


def _fn(E, K, mode="exact", B=None, full=False):
    mp = params(np.random.default_rng(0), 4, 5, E)

    def fn(comm):
        b = 2 if B is None else B[comm.rank]
        m = np.random.default_rng(comm.rank).normal(size=(b, 3, 4))
        mpl = mp if full else local_experts(mp, comm.rank, comm.size)
        return ep_moe_forward(comm, mpl, m, None, top_k=K, capacity_factor=1.0, dispatch=mode)[0]

    return fn


def test_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match=r"E=6 experts do not split over ep=4"):
        check_ep(6, 4, 1)
    with pytest.raises(ValueError, match=r"E=6 experts do not split over ep=4"):
        emulator.spawn(lambda c: local_experts(params(np.random.default_rng(0), 4, 5, 6), 0, 4), 1)


@pytest.mark.parametrize("K", [0, 5])
def test_top_k_outside_one_to_e(K):
    with pytest.raises(ValueError, match=rf"top_k={K} must lie in 1..E=4"):
        emulator.spawn(_fn(4, K), 2, timeout=30)


def test_full_experts_on_a_rank():
    with pytest.raises(ValueError, match=r"local w1 has 4 experts on axis 0.*El=2"):
        emulator.spawn(_fn(4, 2, full=True), 2, timeout=30)


def test_unknown_dispatch_mode():
    with pytest.raises(ValueError, match=r"dispatch='dense' must be one of"):
        emulator.spawn(_fn(4, 2, mode="dense"), 2, timeout=30)


def test_mismatched_count_exchange_names_the_ranks(monkeypatch):
    real = dx.expert_counts

    def lying(n):  # rank 1 announces one row more to rank 2's first expert than it packs
        c = real(n)
        if emulator.current_state().rank == 1:
            c = c.copy()
            c[4] += 1
        return c

    monkeypatch.setattr(dx, "expert_counts", lying)
    with pytest.raises(RuntimeError, match=r"rank 1 of group .* announces \d+ rows to rank 2 "
                       r"\(experts 4\.\.5\) but packed \d+"):  # fmt: skip
        emulator.spawn(_fn(8, 2), 4, timeout=30)


def test_padded_needs_equal_slots_on_every_rank():
    # rank 0 routes 6 tokens, rank 1 routes 3: capacities differ, so the fixed-size all_to_all
    # shapes differ -> the collective check names both ranks (exact mode sends uneven rows fine)
    with pytest.raises(
        emulator.CollectiveMismatch, match=r"rank [01] called .*but rank [01] called"
    ):
        emulator.spawn(_fn(4, 2, mode="padded", B=[2, 1]), 2, timeout=30)
    out = emulator.spawn(_fn(4, 2, mode="exact", B=[2, 1]), 2, timeout=30)
    assert [o.shape for o in out] == [(2, 3, 4), (1, 3, 4)]
