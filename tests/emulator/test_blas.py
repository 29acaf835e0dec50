"""BLAS threads per virtual rank: spawn shrinks the OpenBLAS pool while its ranks run and
restores it afterwards; the size each rank sees is read back from OpenBLAS itself."""

from __future__ import annotations

import pytest

import emulator
from emulator import blas

needs_openblas = pytest.mark.skipif(blas.threads() is None, reason="no OpenBLAS pool found")


def test_per_rank_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("DISTEMU_BLAS_THREADS", raising=False)
    monkeypatch.setattr(blas, "cpus", lambda: 16)
    assert [blas.per_rank(p) for p in (1, 2, 4, 8, 16, 64)] == [16, 8, 4, 2, 1, 1]
    monkeypatch.setattr(blas, "cpus", lambda: 2)  # a small machine: one thread even for 1 rank
    assert [blas.per_rank(p) for p in (1, 2, 8)] == [1, 1, 1]
    monkeypatch.setenv("DISTEMU_BLAS_THREADS", "3")
    assert blas.per_rank(8) == 3


@needs_openblas
def test_spawn_limits_the_pool_and_restores_it(monkeypatch):
    monkeypatch.setenv("DISTEMU_BLAS_THREADS", "1")
    before = blas.threads()
    assert emulator.spawn(lambda comm: blas.threads(), 3) == [1, 1, 1]
    assert blas.threads() == before


@needs_openblas
def test_nested_limits_keep_the_outer_setting_and_restore_once():
    before = blas.threads()
    with blas.limit(1):
        with blas.limit(2):
            assert blas.threads() == 1
        assert blas.threads() == 1
    assert blas.threads() == before
