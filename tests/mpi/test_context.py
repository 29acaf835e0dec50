"""Context-parallel attention under MPI: the three methods, both balancings, equal the
single-rank attention and send exactly cost.attention_bytes on every process."""

from __future__ import annotations

import numpy as np
import pytest

from emulator.ops import attention_backward, attention_forward
from parallel.context import cost, layout
from parallel.context.attention import METHODS, cp_attention_backward, cp_attention_forward

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("balance", layout.BALANCES)
@pytest.mark.parametrize("method", METHODS)
def test_cp_attention_under_mpi(comm, method, balance):
    C, B, S, A, H = comm.size, 2, 8 * comm.size, 4, 8
    rng = np.random.default_rng(3)  # the same inputs on every process
    q, k, v, do = (rng.standard_normal((B, S, H)) for _ in range(4))
    o_ref, c = attention_forward(q, k, v, A)
    g_ref = attention_backward(do, c)
    tab = layout.table(S, C, balance)
    p, L = tab[comm.rank], comm.ledger
    mark = L.mark()
    o, cache = cp_attention_forward(comm, q[:, p], k[:, p], v[:, p], A, positions=tab,
                                    method=method)  # fmt: skip
    g = cp_attention_backward(do[:, p], cache)
    recs = L.since(mark)
    diff = max(np.abs(x - y[:, p]).max() for x, y in zip((o, *g), (o_ref, *g_ref)))
    want = cost.attention_bytes(method, B, S, H, A, C, 8)
    assert diff <= 1e-12
    for d, name in (("fwd", "forward"), ("bwd", "backward")):
        tag = f"cp-attn/{d}"
        assert (L.sent(recs, tag=tag), L.received(recs, tag=tag)) == (want[name],) * 2
