"""emulator/halves.py's bigger hand-offs: a dense block's forward in ONE hand-off and its backward
in two (the dx chain, then the weight gradients: together_then) when B is even, AdamW's whole
step in one (independent), and together's runs around a job too small to split; each bitwise the
one-call definition (every split forced: MIN_SIZE = 1, as if the BLAS pool had 2 threads)."""

import numpy as np
import pytest

from emulator import halves
from emulator.data import synthetic_batch
from emulator.model import ModelConfig, init_params
from emulator.optim import AdamW, adamw_update
from tests.emulator.halves_kit import model_step, one_call, same


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_block_in_one_forward_and_two_backward_handoffs(handoffs, monkeypatch, dtype, recompute):
    """B even, GEMMs large enough to split: per block one forward hand-off (LN1, q/k/v,
    attention, wo, LN2, MLP) and two backward ones; bitwise the one-call step."""
    cfg = ModelConfig(
        vocab_size=32, max_seq_len=128, d_model=256, n_heads=2, n_layers=2, dtype=dtype
    )
    params = init_params(cfg, 0)
    tokens, targets = synthetic_batch(0, 0, 2, 128, 32)

    run = model_step(params, tokens, targets, cfg, recompute)

    got = run()
    # forward: LN1 1 + q/k/v 6 + attention 1 + wo 3 + LN2 1 + w1 + GELU 3 + w2 3 = 18 per block;
    # backward: w2 dx + GELU' 2, w1 dx 1, LN2 dx + residual 2, wo dx 1, attention 1, q/k/v dx 3
    # + their sum 1, LN1 dx + residual 2 = 13; then dw, db of w2, w1, wo, q, k, v 12 + 2 LN sums
    block_fwd, block_bwd = [18], [13, 14]
    if recompute == "full":
        block_bwd = block_fwd + block_bwd  # the forward rerun first, in its own hand-off
    assert handoffs[:2] == block_fwd * 2
    # then the head's LN and CE (its V = 32 GEMMs are too small to split, so they run whole
    # between them), CE's and LN's dx backward, LN's sums
    assert handoffs[2:7] == [1, 1, 1, 1, 1]
    assert handoffs[7 : 7 + 2 * len(block_bwd)] == block_bwd * 2
    same(got, one_call(run, monkeypatch))


def test_odd_batch_keeps_attention_apart(handoffs, monkeypatch):
    """B odd: the batch halves are not the token rows' halves, so the attention core has its own
    hand-off and the row-wise ops two regions each side of it; bitwise the one-call step."""
    cfg = ModelConfig(vocab_size=32, max_seq_len=128, d_model=256, n_heads=2, n_layers=1)
    params = init_params(cfg, 0)
    tokens, targets = synthetic_batch(0, 0, 3, 128, 32)

    run = model_step(params, tokens, targets, cfg, "none")

    got = run()
    assert handoffs[:3] == [7, 1, 10]  # forward: LN1 + q/k/v; attention; wo + LN2 + MLP
    # backward (after the head's 2 + 3): the MLP to wo's dx chain, its weight gradients and sums;
    # attention; q/k/v's dx, their sum, LN1's dx; their weight gradients and LN1's sums
    assert handoffs[8:13] == [6, 7, 1, 6, 7]
    same(got, one_call(run, monkeypatch))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_in_one_handoff(handoffs, monkeypatch, weight_decay):
    """Every parameter's update in one hand-off (the one-row ones, which do not split, on this
    thread meanwhile), bitwise adamw_update one parameter at a time without splits."""
    rng = np.random.default_rng(3)
    shapes = {"w": (9, 40), "b": (40,), "one": (1, 5), "v": (7, 3, 2)}
    params = {n: rng.standard_normal(s) for n, s in shapes.items()}
    grads = [{n: rng.standard_normal(s) for n, s in shapes.items()} for _ in range(2)]

    def run():
        p = {n: a.copy() for n, a in params.items()}
        opt = AdamW(p, lr=0.01, weight_decay=weight_decay)
        for g in grads:
            opt.step(p, g)
        return [*p.values(), *opt.m.values(), *opt.v.values()]

    got = run()
    assert handoffs == [4, 4]  # w and v split; b and one (one row each) whole here, the
    # helper's half of each empty
    want = {n: a.copy() for n, a in params.items()}
    m, v = ({n: np.zeros(s) for n, s in shapes.items()} for _ in range(2))
    for k, g in enumerate(grads, start=1):
        for n in shapes:
            adamw_update(want[n], g[n], m[n], v[n], k, lr=0.01, weight_decay=weight_decay)
    same(got, [*want.values(), *m.values(), *v.values()])
    same(got, one_call(run, monkeypatch))


def test_together_runs_around_a_whole_job(handoffs):
    """A job too small to split between split ones: the runs before and after it are one
    hand-off each, in order (the whole job reads every row the first run wrote)."""
    a = np.arange(12.0).reshape(6, 2)
    out, col = np.empty_like(a), np.empty(1)

    def total(x, o):
        o[0] = x.sum()

    halves.together(
        (halves.ROWS, lambda x, o: np.multiply(x, 2.0, out=o), (a, out)),
        (halves.ROWS, lambda o: np.add(o, 1.0, out=o), (out,)),
        (halves.ONE, total, (out, col)),
        (halves.ROWS, lambda o, c: np.subtract(o, c, out=o), (out, np.broadcast_to(col, (6, 1)))),
    )
    assert handoffs == [2]  # the last job's broadcast view is not C-contiguous: whole too
    assert col[0] == (2 * a + 1).sum()
    assert np.array_equal(out, 2 * a + 1 - col[0])


@pytest.mark.parametrize("order", [(40, 30, 20), (20, 40, 30)])
def test_independent_sums_whole_on_both_sides(handoffs, order):
    """Sums over rows in independent(): each whole (every column) on one thread, largest first
    whatever order they come in, each on the side with less so far, bitwise NumPy's own
    sum(axis=0)."""
    import threading

    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((n, 7 + n)) for n in order]
    outs = [np.empty(a.shape[1]) for a in arrays]
    seen = []

    def col_sum(a, out):
        seen.append((threading.current_thread().name, a.shape))
        np.sum(a, axis=0, out=out)

    halves.independent(*[(halves.COLUMNS, col_sum, (a, o)) for a, o in zip(arrays, outs)])
    assert handoffs == [3]
    for a, o in zip(arrays, outs, strict=True):
        assert o.tobytes() == a.sum(axis=0).tobytes()
    whole = sorted((name, shape) for name, shape in seen if shape[1])
    assert whole == [("MainThread", (20, 27)), ("MainThread", (30, 37)),
                     ("distemu-halves", (40, 47))]  # fmt: skip
