"""emulator/halves.py: the two-thread split of an elementwise chain is bitwise the one call (GELU
forward and backward, float32 and float64, even and odd row counts), it really runs a half on the
helper thread, it stays off on other threads, and a failing half raises."""

import threading

import numpy as np
import pytest

from emulator import halves, ops


@pytest.fixture
def split_on(monkeypatch):
    monkeypatch.setattr(halves.blas, "threads", lambda: 2)  # as if the BLAS pool had 2 threads


def _gelu_both(z, dy):
    y, _ = ops.gelu_forward(z)
    return y, ops.gelu_backward(dy, z)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(8, 128, 256), (3, 7, 4099), (5, 1 << 14)])
def test_split_gelu_is_bitwise_the_one_call(split_on, monkeypatch, dtype, shape):
    rng = np.random.default_rng(0)
    z = (rng.standard_normal(shape) * 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    assert halves.enabled(z.size)
    got = _gelu_both(z, dy)
    monkeypatch.setattr(halves, "_on", lambda: False)
    want = _gelu_both(z, dy)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype and g.tobytes() == w.tobytes()


def test_a_half_runs_on_the_helper_thread(split_on):
    seen = []

    def fn(a, out):
        seen.append((threading.current_thread().name, a.shape[0]))
        np.multiply(a, 2.0, out=out)

    a = np.arange(9 * 8192, dtype=np.float64).reshape(9, 8192)
    out = np.empty_like(a)
    halves.in_halves(fn, a, out)
    assert np.array_equal(out, 2.0 * a)
    assert sorted(seen) == [("MainThread", 5), ("distemu-halves", 4)]


def test_off_on_other_threads_and_for_small_arrays(split_on):
    got = []
    t = threading.Thread(target=lambda: got.append(halves.enabled(1 << 20)))
    t.start()
    t.join(timeout=60)
    assert got == [False]  # a virtual rank is a thread: never split there
    assert not halves.enabled(halves.MIN_SIZE - 1) and halves.enabled(halves.MIN_SIZE)


def test_a_failing_half_raises(split_on):
    def fn(a):
        if threading.current_thread() is not threading.main_thread():
            raise FloatingPointError("helper half")

    with pytest.raises(FloatingPointError, match="helper half"):
        halves.in_halves(fn, np.zeros((4, 1 << 16)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_layernorm_and_adamw_are_bitwise_the_one_call(split_on, monkeypatch, dtype):
    from emulator.optim import adamw_update

    rng = np.random.default_rng(1)
    x = (rng.standard_normal((7, 129, 300)) * 5 + 1).astype(dtype)
    gain, bias = rng.standard_normal(300).astype(dtype), rng.standard_normal(300).astype(dtype)
    p, g = (rng.standard_normal((515, 257)).astype(dtype) for _ in range(2))

    def run():
        y, (xhat, rstd, _) = ops.layernorm_forward(x, gain, bias, 1e-5)
        pp, m, v = p.copy(), np.full_like(p, 0.1), np.full_like(p, 0.2)
        for step in (1, 2):
            adamw_update(pp, g, m, v, step, weight_decay=0.1)
        return y, xhat, rstd, pp, m, v

    got = run()
    monkeypatch.setattr(halves, "_on", lambda: False)
    want = run()
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == dtype and a.tobytes() == b.tobytes()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_helper(split_on):
    """The parent's helper thread does not exist in a forked child: the child's halves must
    start their own (else they wait WAIT_S for nothing)."""
    import multiprocessing as mp

    a = np.arange(4 * 65536, dtype=np.float64).reshape(4, 65536)
    halves.in_halves(lambda x: None, a)  # the parent's helper exists now
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.apply_async(_double_in_halves, (a,)).get(timeout=120)
    assert np.array_equal(got, 2.0 * a)


def _double_in_halves(a):
    halves.blas.threads = lambda: 2  # this child only: as if its pool had 2 threads
    out = np.empty_like(a)
    halves.in_halves(lambda x, o: np.multiply(x, 2.0, out=o), a, out)
    return out
