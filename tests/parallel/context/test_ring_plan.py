"""The ring's per-rank plan (parallel/context/ring.py): rows / cols of each step as slices under
the contiguous and zigzag tables, index arrays under any other permutation table - each against
the causal mask's definition - and ring attention under random permutation tables (the index
array path) against the single-rank emulator.ops attention, float64 ~1e-12."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.ops import attention_backward, attention_forward
from parallel.context import layout
from parallel.context.attention import cache_nbytes, cp_attention_backward, cp_attention_forward
from parallel.context.ring import _row_max, plan


def check_plan(tab):
    """Every step of every rank against visible(i, j) = pos_j <= pos_i."""
    C = tab.shape[0]
    for r in range(C):
        steps = plan(tab, r).steps
        assert [s.src for s in steps] == [(r - t) % C for t in range(C)]
        for s in steps:
            vis = tab[s.src][None, :] <= tab[r][:, None]
            rows, cols = np.flatnonzero(vis.any(1)), np.flatnonzero(vis.any(0))
            assert np.array_equal(np.arange(tab.shape[1])[s.rows], rows)
            assert np.array_equal(np.arange(tab.shape[1])[s.cols], cols)
            assert (s.n_rows, s.n_cols, s.seen) == (rows.size, cols.size, int(vis.sum()))
            part = vis[np.ix_(rows, cols)]
            if s.hidden is None:
                assert part.all()
            else:
                assert np.array_equal(s.hidden, ~part)


@pytest.mark.parametrize("balance", layout.BALANCES)
@pytest.mark.parametrize("C", [1, 2, 3, 4])
def test_plan_slices(C, balance):
    tab = layout.table(12 * C, C, balance)
    check_plan(tab)
    for r in range(C):
        for s in plan(tab, r).steps:
            assert s.n_rows == 0 or (isinstance(s.rows, slice) and isinstance(s.cols, slice))
            assert s.hidden is None or s.src == r  # only the own block is partly masked


def permuted(C, S_l, seed):
    return np.random.default_rng(seed).permutation(C * S_l).reshape(C, S_l).astype(np.int64)


@settings(max_examples=40, deadline=None)
@given(C=st.integers(1, 4), S_l=st.integers(1, 4), seed=st.integers(0, 10**6))
def test_plan_any_table(C, S_l, seed):
    check_plan(permuted(C, S_l, seed))


def ring_vs_reference(tab, B, A, D, keep, seed=0):
    C, S_l = tab.shape
    S, H = C * S_l, A * D
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, S, H)) for _ in range(4))
    o_ref, c = attention_forward(q, k, v, A)
    g_ref = attention_backward(do, c)

    def fn(comm):
        p = tab[comm.rank]
        o, cache = cp_attention_forward(comm, q[:, p], k[:, p], v[:, p], A, positions=tab,
                                        keep_probs=keep)  # fmt: skip
        # q, k, v, o (B, S_l, H), lse (B, A, S_l) and the kept blocks (B, A, rows, cols):
        # the plan's index arrays are static metadata like the table, not cache memory
        kept = sum(s.n_rows * s.n_cols for s in plan(tab, comm.rank).steps) if keep else 0
        assert cache_nbytes(cache) == 8 * (4 * B * S_l * H + B * A * S_l + B * A * kept)
        return o, cp_attention_backward(do[:, p], cache)

    out = emulator.spawn(fn, C, timeout=60)
    got = [layout.unshard([x[0] for x in out], tab)]
    got += [layout.unshard([x[1][i] for x in out], tab) for i in range(3)]
    for name, g, w in zip(("o", "dq", "dk", "dv"), got, [o_ref, *g_ref]):
        err = np.abs(g - w).max() / max(1.0, np.abs(w).max())
        assert err <= 1e-12, f"{name}: {err:.3g}"


@settings(max_examples=20, deadline=None)
@given(C=st.integers(2, 4), S_l=st.integers(1, 4), seed=st.integers(0, 10**6),
       B=st.integers(1, 2), A=st.integers(1, 2), D=st.integers(1, 3), keep=st.booleans())  # fmt: skip
def test_ring_any_table(C, S_l, seed, B, A, D, keep):
    ring_vs_reference(permuted(C, S_l, seed), B, A, D, keep, seed)


@pytest.mark.parametrize("keep", [True, False])
def test_ring_striped_table(keep):
    """Round-robin tokens (rank r holds r, r + C, ...): every block pair is partly masked."""
    C, S_l = 4, 6
    tab = np.arange(C * S_l).reshape(S_l, C).T.copy()
    assert all(s.hidden is not None for r in range(C) for s in plan(tab, r).steps if s.n_rows)
    ring_vs_reference(tab, 2, 2, 3, keep)


@pytest.mark.parametrize("keep", [True, False])
def test_ring_gapped_table(keep):
    """Rank 0 holds 5, 0, 4: at step 1 its rows 0 and 2 see rank 1's keys, row 1 does not, so
    the rows are an index array (the copy-and-write-back path)."""
    tab = np.array([[5, 0, 4], [1, 2, 3]])
    st1 = plan(tab, 0).steps[1]
    assert not isinstance(st1.rows, slice) and list(st1.rows) == [0, 2]
    ring_vs_reference(tab, 2, 2, 3, keep)


@pytest.mark.parametrize("n", list(range(1, 20)))
def test_row_max_is_max(n):
    """The ring's short-row maxima (one np.maximum per key column up to 16 keys, NumPy's
    reduction beyond) equal s.max(axis=-1) for every row length, with -inf (masked keys) and a
    NaN propagating, as C-contiguous arrays (they become the running maxima)."""
    rng = np.random.default_rng(n)
    s = rng.standard_normal((3, 2, 5, n))
    s[rng.random(s.shape) < 0.3] = -np.inf
    s[..., n // 2] = rng.standard_normal((3, 2, 5))  # every row sees a key
    s[0, 1, 2, n - 1] = np.nan
    got = _row_max(s)
    assert got.shape == s.shape[:-1] and got.flags.c_contiguous
    assert np.array_equal(got, s.max(axis=-1), equal_nan=True)
    assert np.isnan(got[0, 1, 2]) and np.isfinite(np.delete(got.ravel(), 1 * 5 + 2)).all()
