"""parallel/expert/cost.py's closed forms against collectives/cost.py's all-to-all(v) formulas
and the textbook (P-1)/P E C H w; the ledger checks are in test_layer.py (every rank, phase)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.expert import cost


@settings(max_examples=30, deadline=None)
@given(P=st.integers(1, 5), per=st.integers(1, 3), H=st.integers(1, 8), seed=st.integers(0, 99))
def test_exact_equals_pairwise_alltoallv(P, per, H, seed):
    kept = np.random.default_rng(seed).integers(0, 7, (P, P * per))
    for r in range(P):
        assert cost.exact_bytes(kept, H, 4, r) == cost.exact_bytes_pairwise(kept, H, 4, r)


def test_exact_by_hand():
    # P = 2, E = 4: rank 0 keeps [3, 1 | 2, 0], rank 1 keeps [0, 4 | 5, 1]; H = 2, w = 8
    kept = [[3, 1, 2, 0], [0, 4, 5, 1]]
    b0 = cost.exact_bytes(kept, 2, 8, 0)
    assert b0["fwd/dispatch"] == (2 * 16, 4 * 16)  # sends 2 rows to rank 1, gets 0 + 4
    assert b0["fwd/combine"] == b0["bwd/dispatch"] == (4 * 16, 2 * 16)
    assert b0["fwd/counts"] == (16, 16)  # 2 int64 counts each way


@given(P=st.integers(1, 6), per=st.integers(1, 3), C=st.integers(0, 9), H=st.integers(1, 5))
def test_padded_is_the_textbook_fraction(P, per, C, H):
    E, w = P * per, 2
    b = cost.padded_bytes(E, P, C, H, w)
    assert b["fwd/counts"] == (0, 0)
    for phase in cost.PHASES[1:]:
        assert b[phase][0] == b[phase][1] == round((P - 1) / P * E * C * H * w)
