"""Context-parallel attention vs the single-rank emulator.ops attention on random inputs: the
output and dq, dk, dv (local shards put back by global position), float64 ~1e-12; every rank's
bytes per direction vs cost.attention_bytes, its cache bytes vs cost.cache_nbytes, and the
ring's recorded per-step work vs work.py's closed forms."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.ops import attention_backward, attention_forward
from parallel.context import cost, layout, work
from parallel.context.attention import (
    METHODS,
    cache_nbytes,
    cp_attention_backward,
    cp_attention_forward,
)

TOL = {np.float64: 1e-12, np.float32: 2e-5}


def run(method, C, balance, B, S, H, A, *, keep=True, dtype=np.float64, seed=0):
    """-> (o, (dq, dk, dv)) put back in sequence order, the reference's, and per-rank figures."""
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, S, H)).astype(dtype) for _ in range(4))
    o_ref, c = attention_forward(q, k, v, A)
    g_ref = attention_backward(do, c)
    tab = layout.table(S, C, balance)

    def fn(comm):
        p = tab[comm.rank]
        o, cache = cp_attention_forward(comm, q[:, p], k[:, p], v[:, p], A, positions=tab,
                                        method=method, keep_probs=keep)  # fmt: skip
        held = cache_nbytes(cache)
        g = cp_attention_backward(do[:, p], cache)
        L = comm.ledger
        fig = {
            d: (L.sent(tag=f"cp-attn/{d}"), L.received(tag=f"cp-attn/{d}")) for d in ("fwd", "bwd")
        }
        fig.update(held=held, work=cache["inner"].get("work"), total=L.sent())
        return o, g, fig

    out = emulator.spawn(fn, C, timeout=60)
    o = layout.unshard([x[0] for x in out], tab)
    grads = [layout.unshard([x[1][i] for x in out], tab) for i in range(3)]
    return o, grads, o_ref, g_ref, [x[2] for x in out]


def assert_close(got, want, tol, what):
    err = np.abs(got.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
    assert err <= tol, f"{what}: max relative |diff| {err:.3g} > {tol}"


def check_all(method, C, balance, B, S, H, A, keep=True, dtype=np.float64):
    o, grads, o_ref, g_ref, figs = run(method, C, balance, B, S, H, A, keep=keep, dtype=dtype)
    tol = TOL[dtype]
    assert_close(o, o_ref, tol, f"{method} C={C} {balance}: o")
    for name, g, gr in zip(("dq", "dk", "dv"), grads, g_ref):
        assert_close(g, gr, tol, f"{method} C={C} {balance}: {name}")
    x = np.dtype(dtype).itemsize
    want = cost.attention_bytes(method, B, S, H, A, C, x)
    expected_steps = work.steps(S, C, balance)
    for r, f in enumerate(figs):
        assert f["fwd"] == (want["forward"],) * 2, (r, f["fwd"], want)
        assert f["bwd"] == (want["backward"],) * 2, (r, f["bwd"], want)
        assert f["total"] == want["forward"] + want["backward"]  # nothing outside the tags
        held = cost.cache_nbytes(method, B, S, H, A, C, x, keep_probs=keep, balance=balance,
                                 rank=r)  # fmt: skip
        assert f["held"] == held, (r, f["held"], held)
        if method == "ring":
            got = [(rows, cols) for _, rows, cols, _ in f["work"]]
            assert got == expected_steps[r], (r, got, expected_steps[r])
            assert [src for src, *_ in f["work"]] == [(r - t) % C for t in range(C)]
            assert sum(w[3] for w in f["work"]) == work.visible(S, C, balance, r)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
@pytest.mark.parametrize("C", [1, 2, 3, 4])
@pytest.mark.parametrize("method", METHODS)
def test_matches_single_rank(method, C, balance, keep):
    A = 4 if method != "ulysses" or C != 3 else 6  # Ulysses needs A divisible by C
    check_all(method, C, balance, B=2, S=24, H=2 * A, A=A, keep=keep)


@pytest.mark.parametrize("method", METHODS)
def test_float32(method):
    check_all(method, 4, "zigzag", B=1, S=16, H=8, A=4, dtype=np.float32)


@settings(max_examples=25)
@given(
    method=st.sampled_from(METHODS),
    C=st.integers(1, 4),
    balance=st.sampled_from(layout.BALANCES),
    chunks=st.integers(1, 3),
    heads=st.integers(1, 3),
    D=st.integers(1, 3),
    B=st.integers(1, 2),
    keep=st.booleans(),
)
def test_property(method, C, balance, chunks, heads, D, B, keep):
    S = chunks * 2 * C  # divisible by 2 C: both balancings apply
    A = heads * C if method == "ulysses" else heads
    check_all(method, C, balance, B, S, A * D, A, keep=keep)


def test_ulysses_heads_not_divisible():
    def fn(comm):
        x = np.zeros((1, 4, 6))
        cp_attention_forward(comm, x, x, x, 3, positions=layout.table(8, 2, "zigzag"),
                             method="ulysses")  # fmt: skip

    with pytest.raises(ValueError, match="n_heads=3 is not divisible by cp=2"):
        emulator.spawn(fn, 2, timeout=30)
    with pytest.raises(ValueError, match="n_heads=3 is not divisible by cp=2"):
        cost.attention_bytes("ulysses", 1, 8, 6, 3, 2, 8)


def test_bad_positions_and_method():
    def fn(comm, pos, method="ring"):
        x = np.zeros((1, 4, 4))
        cp_attention_forward(comm, x, x, x, 2, positions=pos, method=method)

    with pytest.raises(ValueError, match=r"\(2, 4\) integer table"):
        emulator.spawn(lambda c: fn(c, np.arange(4)), 2, timeout=30)
    with pytest.raises(ValueError, match="not a permutation"):
        emulator.spawn(lambda c: fn(c, np.zeros((2, 4), int)), 2, timeout=30)
    with pytest.raises(ValueError, match="method='tree' must be one of"):
        emulator.spawn(lambda c: fn(c, layout.table(8, 2), "tree"), 2, timeout=30)


@pytest.mark.parametrize("method", METHODS)
def test_heads_split_by_tp_first(method):
    """tp x cp mesh: each tp rank holds A / tp heads (consecutive D-column blocks, as Megatron's
    column-parallel wq/wk/wv leave them), and cp runs on those local heads over its cp group."""
    B, S, A, D, tp, C = 2, 16, 4, 2, 2, 2
    H = A * D
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((B, S, H)) for _ in range(4))
    o_ref, c = attention_forward(q, k, v, A)
    g_ref = attention_backward(do, c)
    tab = layout.table(S, C, "zigzag")

    def fn(comm):
        mesh = emulator.Mesh(comm, tp=tp, cp=C)
        t, r = mesh.coord("tp"), mesh.coord("cp")
        cols = slice(t * H // tp, (t + 1) * H // tp)
        part = [x[:, tab[r], cols] for x in (q, k, v, do)]
        o, cache = cp_attention_forward(mesh["cp"], *part[:3], A // tp, positions=tab,
                                        method=method)  # fmt: skip
        g = cp_attention_backward(part[3], cache)
        return max(np.abs(x - y[:, tab[r], cols]).max() for x, y in zip((o, *g), (o_ref, *g_ref)))

    assert max(emulator.spawn(fn, tp * C, timeout=60)) <= 1e-12


def test_ranks_that_disagree_raise_instead_of_hanging():
    from emulator.comm import CollectiveMismatch

    def fn(comm, methods, tables):
        x = np.zeros((1, 4, 4))
        cp_attention_forward(comm, x, x, x, 2, positions=tables[comm.rank],
                             method=methods[comm.rank])  # fmt: skip

    z, c = layout.table(8, 2, "zigzag"), layout.table(8, 2, "contiguous")
    with pytest.raises(CollectiveMismatch):
        emulator.spawn(lambda comm: fn(comm, ["ring", "all-gather"], [z, z]), 2, timeout=30)
    with pytest.raises(CollectiveMismatch):
        emulator.spawn(lambda comm: fn(comm, ["ring", "ring"], [z, c]), 2, timeout=30)


def test_a_table_that_passed_is_still_checked_against_the_group():
    """The checked tables are cached by their bytes (attention._table): a table that passed on a
    2-rank group is refused on a 4-rank one, and one refused stays refused."""
    tab = layout.table(8, 2, "contiguous")  # (2, 4): fits cp=2 with S_local=4

    def fn(comm, S_local):
        x = np.zeros((1, S_local, 4))
        cp_attention_forward(comm, x, x, x, 2, positions=tab)

    emulator.spawn(lambda c: fn(c, 4), 2, timeout=30)  # passes, and is cached
    with pytest.raises(ValueError, match=r"\(4, 2\) integer table"):
        emulator.spawn(lambda c: fn(c, 2), 4, timeout=30)
    bad = np.zeros((2, 4), int)
    for _ in range(2):
        with pytest.raises(ValueError, match="not a permutation"):
            emulator.spawn(lambda c: cp_attention_forward(c, *[np.zeros((1, 4, 4))] * 3, 2,
                                                          positions=bad), 2, timeout=30)  # fmt: skip
