"""Every op that emulator/halves.py splits is bitwise its one call, on awkward shapes: odd row
counts, one row, odd columns, odd batches, float32 and float64 (the linear layers' GEMMs by rows
too: OpenBLAS's one-thread kernel on half the rows against NumPy's one matmul). The split is forced for tiny arrays
(MIN_SIZE = 1, as if the BLAS pool had 2 threads) and counted, so each case really runs halves;
the column sums are also checked against NumPy's own sum(axis=0) of the whole array."""

import numpy as np
import pytest

from emulator import halves, ops
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, init_params
from tests.emulator.halves_kit import model_step, one_call, same

DTYPES = [np.float32, np.float64]


@pytest.fixture
def splits(monkeypatch):
    """Split everything; -> the list of (first half's shape, second half's shape) of each job
    handed off (a hand-off of several jobs, halves.together, adds one entry per job)."""
    monkeypatch.setattr(halves.blas, "threads", lambda: 2)
    monkeypatch.setattr(halves, "MIN_SIZE", 1)
    seen, two = [], halves._two

    def spy(fn, first, second):
        parts = zip(first[1], second[1], strict=True) if fn is halves._each else [(first, second)]
        seen.extend((f[0].shape, s[0].shape) for f, s in parts)
        two(fn, first, second)

    monkeypatch.setattr(halves, "_two", spy)
    return seen


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 7), (1, 1, 9), (1, 3, 1), (2, 1, 4)])
def test_linear_and_layernorm(splits, monkeypatch, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    H = shape[-1]
    x, dy = _rand(rng, shape, dtype, 3), _rand(rng, shape[:-1] + (H + 2,), dtype)
    w, b = _rand(rng, (H, H + 2), dtype), _rand(rng, H + 2, dtype)
    gain, bias = _rand(rng, H, dtype), _rand(rng, H, dtype)

    def run():
        y, c = ops.linear_forward(x, w, b)
        ln, lc = ops.layernorm_forward(x, gain, bias, 1e-5)
        return (y, *ops.linear_backward(dy, c), ln, *ops.layernorm_backward(y[..., :H], lc))

    got = run()
    assert splits  # the bias rows and sums, the layernorm rows and columns
    same(got, one_call(run, monkeypatch))
    x2, dy2 = x.reshape(-1, H), dy.reshape(-1, H + 2)
    same(got[:3], [(x2 @ w + b).reshape(dy.shape), (dy2 @ w.T).reshape(x.shape), x2.T @ dy2])
    same([got[3]], [dy2.sum(axis=0)])  # db: NumPy's column sums
    d, xhat = got[0][..., :H], ops.layernorm_forward(x, gain, bias, 1e-5)[1][0]
    same(got[6:], [(d * xhat).reshape(-1, H).sum(axis=0), d.reshape(-1, H).sum(axis=0)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(257, 129, 131), (256, 128, 128), (301, 200, 1000)])
def test_gemm_by_rows(splits, monkeypatch, dtype, mkn):
    """ops._gemm on halves of the rows (odd M too) against NumPy's one matmul, a and a^T."""
    M, K, N = mkn
    rng = np.random.default_rng(M)
    a, at, b = _rand(rng, (M, K), dtype), _rand(rng, (K, M), dtype).T, _rand(rng, (K, N), dtype)
    got = [ops._gemm(a, b), ops._gemm(at, b)]
    assert [f[0] for f, _ in splits] == [M // 2, M // 2]
    same(got, [a @ b, at @ b])
    small = ops._gemm(a[: 2 * ops.GEMM_HALF_MIN - 1], b)  # halves below the minimum: one call
    assert len(splits) == 2 and small.tobytes() == (a[: 2 * ops.GEMM_HALF_MIN - 1] @ b).tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [257, 256])
def test_one_handoff_per_layer(handoffs, monkeypatch, dtype, N):
    """A linear layer with its bias and residual, the q/k/v projections and their summed dx,
    and a layernorm backward with its residual: one hand-off each (halves.together), bitwise
    the one-call definition (odd N too: the GEMM's and the adds' row halves must meet)."""
    rng = np.random.default_rng(N)
    H, F = 256, 128
    x, r, dy = (
        _rand(rng, (1, N, H), dtype, 3),
        _rand(rng, (1, N, F), dtype),
        _rand(rng, (1, N, F), dtype),
    )
    w, b = _rand(rng, (H, F), dtype), _rand(rng, F, dtype)
    ws = [(_rand(rng, (H, F), dtype), _rand(rng, F, dtype)) for _ in range(3)]
    gain, bias = _rand(rng, H, dtype), _rand(rng, H, dtype)

    def run():
        y, c = ops.linear_forward(x, w, b, residual=r)
        outs = ops.linears_forward(x, ws)
        da, dwb = ops.linears_backward([dy, 2 * dy, r], [c for _, c in outs])
        _, lc = ops.layernorm_forward(x, gain, bias, 1e-5)
        dln = ops.layernorm_backward(da, lc, residual=x)
        return [y, *(o for o, _ in outs), *ops.linear_backward(dy, c), da,
                *(g for pair in dwb for g in pair), *dln]  # fmt: skip

    got = run()
    assert handoffs == [3, 6, 10, 1, 3, 3]  # the layernorm forward is one job anyway
    want = one_call(run, monkeypatch)
    same(got, want)
    x2, r2 = x.reshape(-1, H), r.reshape(-1, F)
    same(
        [got[0], got[4]],
        [(r2 + (x2 @ w + b)).reshape(r.shape), (dy.reshape(-1, F) @ w.T).reshape(x.shape)],
    )
    dxs = [(g.reshape(-1, F) @ wq.T).reshape(x.shape) for g, (wq, _) in zip([dy, 2 * dy, r], ws)]
    same([got[7]], [(dxs[0] + dxs[1]) + dxs[2]])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 11), (1, 1, 7), (1, 3, 2)])
def test_cross_entropy(splits, monkeypatch, dtype, shape):
    rng = np.random.default_rng(sum(shape))
    logits = _rand(rng, shape, dtype, 4)
    targets = rng.integers(0, shape[-1], shape[:-1])

    def run():
        total, n, c = ops.cross_entropy_sum_forward(logits, targets)
        return total, n, ops.cross_entropy_sum_backward(0.37, c)

    got = run()
    assert splits or shape[:-1] == (1, 1)  # one row: nothing to split
    same(got, one_call(run, monkeypatch))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [7, 1, 2])
def test_embedding_backward(splits, monkeypatch, dtype, H):
    rng = np.random.default_rng(H)
    tokens = np.array([[1, 1, 4, 1, 0], [0, 1, 2, 5, 5], [3, 3, 3, 1, 0]])  # repeated ids
    tok, pos, dx = (
        _rand(rng, (6, H), dtype),
        _rand(rng, (9, H), dtype),
        _rand(rng, (3, 5, H), dtype),
    )
    run = lambda: ops.embedding_backward(dx, ops.embedding_forward(tokens, tok, pos)[1])
    got = run()
    assert splits or H == 1
    same(got, one_call(run, monkeypatch))
    dtok = np.zeros_like(tok)
    np.add.at(dtok, tokens.reshape(-1), dx.reshape(-1, H))
    same(got, [dtok, np.concatenate([dx.sum(axis=0), np.zeros((4, H), dtype)])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [3, 1, 2, 5])
@pytest.mark.parametrize("keep", [True, False])
def test_attention(splits, monkeypatch, dtype, B, keep):
    rng = np.random.default_rng(B)
    q, k, v, do = (_rand(rng, (B, 6, 6), dtype, 2) for _ in range(4))

    def run():
        o, c = ops.attention_forward(q, k, v, 2, keep_probs=keep)
        return (o, *ops.attention_backward(do, c))

    got = run()
    assert any(f[0] == B // 2 for f, _ in splits) == (B > 1)  # halves of the batch
    same(got, one_call(run, monkeypatch))


@pytest.mark.parametrize("dtype", ["float32", "float64", "mixed"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_model_step(splits, monkeypatch, dtype, recompute):
    """The whole step (residual adds, summed q/k/v gradients, GELU, AdamW's inputs)."""
    cfg = ModelConfig(vocab_size=13, max_seq_len=5, d_model=6, n_heads=2, n_layers=2, dtype=dtype)
    params = init_params(cfg, 0)
    tokens, targets = synthetic_batch(0, 0, 3, 5, 13)

    run = model_step(params, tokens, targets, cfg, recompute)

    got = run()
    assert len(splits) > 40
    same(got, one_call(run, monkeypatch))


def test_one_blas_thread_restores_the_pool():
    before = halves.blas.threads()
    with halves.one_blas_thread():
        assert halves.blas.threads() in (None, 1)
    assert halves.blas.threads() == before


@pytest.mark.parametrize("dtype", ["float32", "mixed"])
def test_block_forward_in_three_handoffs(handoffs, monkeypatch, dtype):
    """At sizes whose GEMMs split and an odd batch, a dense block's forward is three hand-offs
    (LN1 + q/k/v; attention; projection + LN2 + MLP: halves.deferred) when nothing is cast
    (B even: one, tests/emulator/test_halves_fused.py), one per layer when bf16 casts sit
    between them; the step is bitwise the one-call definition either way."""
    cfg = ModelConfig(
        vocab_size=32, max_seq_len=128, d_model=256, n_heads=2, n_layers=1, dtype=dtype
    )
    params = init_params(cfg, 0)
    tokens, targets = synthetic_batch(0, 0, 3, 128, 32)

    run = model_step(params, tokens, targets, cfg, "none")

    got = run()
    # the jobs per hand-off: LN1 1 + q/k/v 2 x 3; attention; wo 3 (GEMM, bias, residual), LN2 1,
    # w1 + GELU 3, w2 3. bf16: LN1 alone (q/k/v read its cast output), then q/k/v, attention
    assert handoffs[:3] == ([7, 1, 10] if dtype == "float32" else [1, 6, 1])
    same(got, one_call(run, monkeypatch))
