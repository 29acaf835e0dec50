"""Run a test body on virtual ranks: a pytest fixture and a decorator.

    def test_mine(virtual_world):                 # the fixture (conftest.py: pytest_plugins =
        ...                                       #   ["parallel.testing.world"])
        sums = virtual_world(4, lambda comm: all_reduce(comm, np.ones(3)))

    @on_virtual_ranks(4)                          # the decorator: the body runs on 4 ranks
    def test_mine_too(comm):
        ...

Both run with a timeout on every blocking wait (a hang becomes CommTimeout naming the waiting
rank and its peer) and re-raise the first failing rank's exception, noting the rank.
"""

from __future__ import annotations

import functools
import inspect

import pytest

import emulator

DEFAULT_TIMEOUT = 30.0


def run_on_virtual_ranks(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT, **kw):
    """fn(comm, *args, **kw) on `world_size` virtual ranks -> every rank's return value."""
    return emulator.spawn(fn, world_size, *args, timeout=timeout, **kw)


def on_virtual_ranks(world_size: int, timeout: float = DEFAULT_TIMEOUT):
    """Decorate `def test_x(comm, ...)`: pytest calls test_x(...) once, and the body runs on
    every one of `world_size` virtual ranks (other arguments are pytest fixtures or
    hypothesis draws, passed through by keyword)."""

    def wrap(body):
        @functools.wraps(body)
        def test(*args, **kw):
            return run_on_virtual_ranks(world_size, lambda comm: body(comm, *args, **kw),
                                        timeout=timeout)  # fmt: skip

        # pytest must not see `comm` as a fixture: hide the first parameter of the signature
        sig = inspect.signature(body)
        test.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        return test

    return wrap


@pytest.fixture
def virtual_world():
    """A runner: virtual_world(n, fn, *args, timeout=30, **kw) -> [fn's result on each rank]."""
    return run_on_virtual_ranks
