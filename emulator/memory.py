"""Per-rank memory ledger: bytes live by category, current and peak.

One ledger per rank (``comm.memory`` on a communicator). Every allocation the emulator wants to
account is named; names are unique within a category while live, so a forgotten ``free`` or a
double ``alloc`` is a loud error instead of a silently wrong peak. Contract: docs/CONTRACTS.md.
"""

from __future__ import annotations

import numpy as np

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")


class MemoryLedger:
    """Named byte counts per category with a high-water mark per category and for the total."""

    def __init__(self) -> None:
        self._live: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak_total = 0

    @staticmethod
    def _check_category(category: str) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; expected one of {CATEGORIES}")

    def alloc(self, category: str, name: str, nbytes: int) -> None:
        """Record ``nbytes`` live under ``(category, name)``."""
        self._check_category(category)
        nbytes_int = int(nbytes)
        if nbytes_int != nbytes or nbytes_int < 0:
            raise ValueError(
                f"alloc {category}/{name}: nbytes must be a non-negative int, got {nbytes!r}"
            )
        live = self._live[category]
        if name in live:
            raise KeyError(
                f"double alloc of {category}/{name!r} ({live[name]} bytes already live); "
                "free it first or use a unique name"
            )
        live[name] = nbytes_int
        self._current[category] += nbytes_int
        self._total += nbytes_int
        self._peak[category] = max(self._peak[category], self._current[category])
        self._peak_total = max(self._peak_total, self._total)

    def free(self, category: str, name: str) -> int:
        """Release ``(category, name)``; returns the bytes freed."""
        self._check_category(category)
        live = self._live[category]
        if name not in live:
            shown = sorted(live)[:8]
            raise KeyError(f"free of {category}/{name!r}, which is not live (live names: {shown})")
        nbytes = live.pop(name)
        self._current[category] -= nbytes
        self._total -= nbytes
        return nbytes

    def nbytes(self, category: str, name: str) -> int:
        """Bytes of one live allocation (KeyError if not live)."""
        self._check_category(category)
        return self._live[category][name]

    def live(self, category: str) -> dict[str, int]:
        """A copy of the live allocations of one category, name -> bytes."""
        self._check_category(category)
        return dict(self._live[category])

    def current(self, category: str | None = None) -> int:
        """Bytes live now in ``category`` (all categories if None)."""
        if category is None:
            return self._total
        self._check_category(category)
        return self._current[category]

    def peak(self, category: str | None = None) -> int:
        """High-water mark of ``current(category)`` since creation or the last ``reset_peak``."""
        if category is None:
            return self._peak_total
        self._check_category(category)
        return self._peak[category]

    def reset_peak(self) -> None:
        """Restart every high-water mark from what is live now."""
        self._peak = dict(self._current)
        self._peak_total = self._total

    def snapshot(self) -> dict:
        return {
            "current": dict(self._current),
            "peak": dict(self._peak),
            "peak_total": self._peak_total,
        }

    def __repr__(self) -> str:
        cur = ", ".join(f"{c}={v}" for c, v in self._current.items() if v)
        return f"MemoryLedger(current: {cur or 'empty'}; peak_total={self._peak_total})"


def saved_nbytes(obj, exclude=()) -> int:
    """Bytes of the distinct arrays reachable from a cache (nested dict / tuple / list).

    Views are charged once, at the size of the array that owns the memory; arrays in ``exclude``
    (the parameters a cache references so the backward can use them) are not charged at all.
    This measures what a cache really holds, so it can be checked against a formula. (Every
    block's forward calls it: the exact dict, tuple and list types are told apart by ``type``
    first, the base chains walked inline.)
    """
    ndarray = np.ndarray
    skip = set()
    for a in exclude:
        if isinstance(a, ndarray):
            b = a.base
            while isinstance(b, ndarray):
                a, b = b, b.base
            skip.add(id(a))
    seen: dict[int, int] = {}
    stack = [obj]
    pop, push = stack.pop, stack.extend
    while stack:
        o = pop()
        t = type(o)
        if t is dict:
            push(o.values())
        elif t is tuple or t is list:
            push(o)
        elif isinstance(o, ndarray):
            b = o.base
            while isinstance(b, ndarray):
                o, b = b, b.base
            if id(o) not in skip:
                seen[id(o)] = o.nbytes
        elif isinstance(o, dict):
            push(o.values())
        elif isinstance(o, (tuple, list)):
            push(o)
    return sum(seen.values())


def _owner(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a
