"""The planners' closed forms against independent definitions: brute force, the project's own
collective byte formulas, and the ZeRO / Megatron expressions written out again."""

from hypothesis import given
from hypothesis import strategies as st

from collectives import cost
from planning import bubble, collective, memory, presets


@given(st.integers(2, 64), st.integers(1, 8), st.sampled_from([0.5, 0.75, 0.9, 0.95, 0.99]))
def test_needed_microbatches_is_the_least(S, v, E):
    M = bubble.needed_microbatches(S, E, v)
    # exact rational check by cross-multiplying M v / (M v + S - 1) >= E
    ok = lambda m: m * v * 100 >= round(E * 100) * (m * v + S - 1)
    assert ok(M) and (M == 1 or not ok(M - 1))


@given(st.integers(2, 64), st.integers(1, 1 << 16))
def test_ring_bytes_and_time_match_the_collectives(P, chunks):
    n = P * chunks  # divisible: every rank sends exactly 2 (P-1)/P n elements
    sent = cost.ring_all_reduce(n, P, 2, 0)[0]
    assert sent == 2 * (P - 1) * chunks * 2
    S = n * 2
    assert collective.ring_time(S, P, 8e-6, 50e9) == cost.ring_all_reduce_time(S, P, 8e-6, 50e9)
    # at S* the latency term equals the bandwidth term
    star = P * 8e-6 * 50e9
    assert abs(collective.latency(P, 8e-6) - collective.wire(star, P, 50e9)) < 1e-15


def test_state_and_activations_written_out():
    p = presets.get("llama2-70b")
    psi, L, h, a, s = p.params, p.layers, p.d_model, p.heads, p.seq
    for dp, z, want in ((8, 0, 16 * psi), (8, 1, 4 * psi + 12 * psi / 8),
                        (8, 2, 2 * psi + 14 * psi / 8), (8, 3, 2 * psi + 4 * psi / L)):  # fmt: skip
        assert memory.state_bytes(psi, L, dp, 1, 1, z) == want
    # Megatron eq. 1 and eq. 4 (sequence parallel) with t = 8
    assert memory.activation_bytes(L, h, a, s, 1, 1, "none") == L * s * h * (34 + 5 * a * s / h)
    assert memory.activation_bytes(L, h, a, s, 1, 8, "none") == L * s * h * (34 / 8 + 5 * a * s
                                                                             / (h * 8))  # fmt: skip


def test_suggest_rows_all_fit_and_are_sorted():
    p = presets.get("llama3-70b")
    rows = memory.suggest(p, 128, p.seq, 1, 10, 80, 10)
    assert rows and all(r.total <= 80 * memory.GIB for r in rows)
    assert [r.score for r in rows] == sorted(r.score for r in rows)
    assert all(r.dp * r.tp * r.pp == 128 for r in rows)


def test_this_model_column_closed_forms():
    from planning import exact

    p = presets.get("llama2-70b")
    H, F, L, V, T = p.d_model, p.d_ff, p.layers, p.vocab, p.seq
    n = L * (4 * H * H + 4 * H + 2 * H * F + F + H + 4 * H) + 2 * V * H + T * H + 2 * H
    rows = memory.strategies(p, 8, T, 1, "none", 10)
    e = exact.price(p, rows[0], T, 1)
    assert e.params == n
    # DDP, mixed: 4 + 2 (master, compute copy) + 8 (Adam) per real element + 2 per padded
    # gradient element; 8 divides every bucket here except possibly the last ones
    assert 16 * n <= e.state < 16 * n + 2 * 8 * 100
    # activations: L (16 s h + 4 s F + 2 a s^2 + 8 s) at b = 1 in bf16 with fp32 statistics
    assert e.activ == L * (16 * T * H + 4 * T * F + 2 * p.heads * T * T + 8 * T)


@given(st.integers(2, 8), st.integers(1, 12))
def test_replayed_schedules_equal_the_bubble_formula(S, M):
    rows = {r["schedule"]: r for r in bubble.replayed(S, M)}
    for name in ("gpipe", "1f1b"):
        assert abs(rows[name]["bubble"] - (1 - bubble.efficiency(S, M))) < 1e-15
    assert rows["1f1b"]["in_flight_stage0"] == min(S, M)


@given(st.sampled_from([2, 3, 8, 16]), st.integers(1, 64))
def test_dry_ring_bytes_equal_the_formula(P, kib):
    S = kib * 1024 * P  # divisible: exactly 2 (P-1)/P S
    assert collective.dry_bytes(P, S) == 2 * (P - 1) * S // P
