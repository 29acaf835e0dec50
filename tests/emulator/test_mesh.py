"""Mesh: one grid owns the geometry; every axis's groups partition the world."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator import Mesh


@settings(max_examples=20, deadline=None)
@given(dims=st.lists(st.integers(1, 3), min_size=1, max_size=3))
def test_groups_partition_the_world_like_a_reshaped_arange(dims):
    names = ["dp", "pp", "tp"][: len(dims)]
    size = int(np.prod(dims))
    grid = np.arange(size).reshape(dims)

    def fn(c):
        m = Mesh(c, **dict(zip(names, dims)))
        out = {}
        for i, a in enumerate(names):
            g = m[a]
            out[a] = (m.ranks(a), g.rank, g.world_size, m.coord(a))
        return out

    for r, out in enumerate(emulator.spawn(fn, size)):
        coords = np.unravel_index(r, dims)
        for i, a in enumerate(names):
            idx = list(coords)
            idx[i] = slice(None)
            expect = grid[tuple(idx)].tolist()
            ranks, grank, gsize, coord = out[a]
            assert ranks == expect and gsize == dims[i] and grank == coords[i] == coord


def test_multi_axis_group_orders_by_the_axes_given():
    def fn(c):
        m = Mesh(c, dp=2, cp=2, tp=2)
        return m.ranks("dp", "cp"), m.ranks("cp", "dp"), m.group("dp", "cp").world_size

    r0 = emulator.spawn(fn, 8)[0]
    assert r0 == ([0, 2, 4, 6], [0, 4, 2, 6], 4)


def test_groups_along_an_axis_are_isolated():
    def fn(c):
        m = Mesh(c, dp=2, tp=2)
        tp = m["tp"]
        got = tp.sendrecv(np.array([c.rank]), 1 - tp.rank, 1 - tp.rank, shape=1, dtype=np.int64)
        return int(got[0]), tp.ledger.records[-1].group

    assert emulator.spawn(fn, 4) == [(1, "tp"), (0, "tp"), (3, "tp"), (2, "tp")]


@pytest.mark.parametrize(
    "dims, match",
    [
        ({"dp": 2, "tp": 3}, r"Mesh dp=2 x tp=3 = 6 ranks, but the world has 4"),
        ({"dp": 0, "tp": 4}, "axis dp=0 must be a positive integer"),
        ({}, "at least one axis"),
    ],
)
def test_bad_mesh_is_a_clear_error(dims, match):
    with pytest.raises(ValueError, match=match):
        emulator.spawn(lambda c: Mesh(c, **dims), 4)


def test_unknown_axis():
    with pytest.raises(ValueError, match="no axis 'ep'; its axes are \\('dp', 'tp'\\)"):
        emulator.spawn(lambda c: Mesh(c, dp=2, tp=2)["ep"], 4)
