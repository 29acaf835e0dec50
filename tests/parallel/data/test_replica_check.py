"""parallel/data/replica_check.py: comparing the flat buffers first finds exactly what the
per-tensor comparison finds - nothing when the copies agree, and the same tensors named when one
rank's copy moved by an ulp anywhere in a buffer, holds a NaN, or differs only in the padding."""

import numpy as np
import pytest

import emulator
from parallel.data.axis import Part
from parallel.data.flat import make_buckets
from parallel.data.replica_check import replica_mismatch

SHAPES = {"emb": (13, 7), "w": (7, 24), "b": (23,), "ln": (7,), "head": (7, 13)}


def _run(P, plant):
    """Every rank's findings with the buffers (flats) and without (per tensor only)."""
    layouts = make_buckets(SHAPES, P, 600 / 2**20, 8)  # several buckets, padded
    assert len(layouts) > 1 and any(lay.padding for lay in layouts)

    def rank(comm):
        rng = np.random.default_rng(0)  # the same values on every rank
        pf = [lay.flatten({n: rng.standard_normal(s) for n, s in SHAPES.items()}, np.float64)
              for lay in layouts]  # fmt: skip
        gf = [lay.flatten({n: rng.standard_normal(s) for n, s in SHAPES.items()}, np.float64)
              for lay in layouts]  # fmt: skip
        plant(comm.rank, layouts, pf, gf)
        params = {n: v for lay, f in zip(layouts, pf) for n, v in lay.views(f).items()}
        grads = {n: v for lay, f in zip(layouts, gf) for n, v in lay.views(f).items()}
        parts = [Part(comm, tuple(SHAPES))]
        return (replica_mismatch(parts, params, grads, [(pf, gf)]),
                replica_mismatch(parts, params, grads))  # fmt: skip

    return emulator.spawn(rank, P, timeout=60)


def _ulp(where):
    def plant(r, layouts, pf, gf):
        if r == 1:
            f = (pf if where[0] == "p" else gf)[where[1]]
            i = where[2] if where[2] >= 0 else layouts[where[1]].numel - 1
            f[i] = np.nextafter(f[i], np.inf)

    return plant


def _nan(r, layouts, pf, gf):
    gf[0][3] = np.nan  # on every rank, the same bits: array_equal calls it unequal


def _padding(r, layouts, pf, gf):
    lay = next(i for i, lay in enumerate(layouts) if lay.padding)
    if r == 1:
        pf[lay][-1] = 1.0


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("plant, named", [
    (lambda *a: None, 0), (_ulp(("p", 0, 0)), 1), (_ulp(("p", 1, -1)), 1),
    (_ulp(("g", 1, 5)), 1), (_ulp(("g", 0, -1)), 1), (_nan, 1), (_padding, 0)])  # fmt: skip
def test_the_buffers_first_find_what_the_tensors_find(P, plant, named):
    for with_flats, per_tensor in _run(P, plant):
        assert with_flats == per_tensor
        assert len(with_flats) == named, with_flats
