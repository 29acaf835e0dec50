"""The cp layouts against their definitions, and the work closed forms against a count over the
causal mask itself (independent of ring.py)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parallel.context import layout, work


def test_contiguous_and_zigzag_by_definition():
    assert layout.table(8, 2, "contiguous").tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 2 cp = 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert layout.table(8, 2, "zigzag").tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert layout.positions(12, 3, 1, "zigzag").tolist() == [2, 3, 8, 9]


@given(C=st.integers(1, 6), n=st.integers(1, 4), balance=st.sampled_from(layout.BALANCES))
def test_table_is_a_permutation_and_unshard_inverts_shard(C, n, balance):
    S = 2 * C * n
    tab = layout.table(S, C, balance)
    assert np.array_equal(np.sort(tab, axis=None), np.arange(S))
    assert all(np.all(np.diff(row) > 0) for row in tab)  # each rank's tokens in sequence order
    x = np.random.default_rng(C).standard_normal((2, S, 3))
    parts = [layout.shard(x, tab[r]) for r in range(C)]
    assert np.array_equal(layout.unshard(parts, tab), x)


@given(C=st.integers(1, 6), n=st.integers(1, 4), balance=st.sampled_from(layout.BALANCES))
def test_work_closed_forms_vs_the_mask(C, n, balance):
    """Per step: the rows and columns of the block pair that see anything, counted on the
    causal mask of global positions; per rank: the visible pairs."""
    S = 2 * C * n
    tab = layout.table(S, C, balance)
    steps = work.steps(S, C, balance)
    for r in range(C):
        for t in range(C):
            src = (r - t) % C
            vis = tab[src][None, :] <= tab[r][:, None]
            assert steps[r][t] == (int(vis.any(1).sum()), int(vis.any(0).sum())), (r, t)
        assert work.visible(S, C, balance, r) == int((tab[r][:, None] >= np.arange(S)).sum())
    s = work.summary(S, C, balance)
    assert sum(s["visible"]) == S * (S + 1) // 2
    S_l = S // C
    if balance == "zigzag":
        assert s["per_rank"] == [S_l * S_l * (C + 1) // 2] * C and s["imbalance"] == 1.0
        assert s["critical_path"] == S_l * S_l * (C + 1) // 2
    else:
        assert s["per_rank"] == [(r + 1) * S_l * S_l for r in range(C)]
        assert s["skipped"] == [C - 1 - r for r in range(C)]
        assert s["critical_path"] == C * S_l * S_l


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="S=10 does not split into 4 equal 2 cp chunks"):
        layout.positions(10, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="S=10 does not split into 3 equal cp chunks"):
        layout.positions(10, 3, 0, "contiguous")
    with pytest.raises(ValueError, match="or balance='contiguous'"):
        layout.table(9, 3, "zigzag")
    with pytest.raises(ValueError, match="balance='stripe' must be one of"):
        layout.table(8, 2, "stripe")
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        layout.positions(8, 2, 2)


def test_position_rows_by_global_index():
    """The embedding of a rank's columns with their global positions is the full embedding's
    columns; the ranks' dpos (distinct rows) sum to the full dpos, each row written once."""
    from emulator.ops import embedding_backward, embedding_forward

    rng = np.random.default_rng(2)
    tokens, tok, pos = (
        rng.integers(0, 7, (2, 12)),
        rng.standard_normal((7, 3)),
        rng.standard_normal((16, 3)),
    )
    dx = rng.standard_normal((2, 12, 3))
    x, c = embedding_forward(tokens, tok, pos)
    _, dpos = embedding_backward(dx, c)
    total = np.zeros_like(dpos)
    for p in layout.table(12, 3, "zigzag"):
        xp, cp_ = embedding_forward(tokens[:, p], tok, pos, p)
        assert np.array_equal(xp, x[:, p])
        _, dp = embedding_backward(dx[:, p], cp_)
        assert not np.any(dp[np.setdiff1d(np.arange(16), p)])  # only its own rows
        total += dp
    assert np.allclose(total, dpos, rtol=0, atol=1e-15)
