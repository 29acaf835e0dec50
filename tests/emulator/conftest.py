"""Fixtures for tests/emulator: the halves tests' hand-off counter."""

import pytest

from emulator import halves


@pytest.fixture
def handoffs(monkeypatch):
    """Split everything (MIN_SIZE 1, as if the BLAS pool had 2 threads); -> the number of jobs
    in each hand-off, in order."""
    monkeypatch.setattr(halves.blas, "threads", lambda: 2)
    monkeypatch.setattr(halves, "MIN_SIZE", 1)
    seen, two = [], halves._two

    def spy(fn, first, second):
        seen.append(len(first[1]) if fn is halves._each else 1)
        two(fn, first, second)

    monkeypatch.setattr(halves, "_two", spy)
    return seen
