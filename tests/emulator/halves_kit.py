"""What the halves tests share: the one-call definition and bitwise comparison."""

import numpy as np

from emulator import halves
from emulator.model import model_backward, model_forward


def one_call(fn, monkeypatch):
    """fn() with every split off (the one-thread definition)."""
    with monkeypatch.context() as m:
        m.setattr(halves, "_on", lambda: False)  # no split anywhere
        return fn()


def same(got, want):
    """Each pair bitwise equal, with dtype and shape."""
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes(), f"max |diff| {np.max(np.abs(g - w))}"


def model_step(params, tokens, targets, cfg, recompute):
    """-> a function running one forward + backward: [loss, *gradients]."""

    def run():
        loss, cache = model_forward(params, tokens, targets, cfg, recompute=recompute)
        return [loss, *model_backward(cache).values()]

    return run
