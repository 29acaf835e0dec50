"""Comparing a run with the oracle: named arrays, relative differences, loud reports.

Every layout test and example ends the same way: gather the layout's parameters / gradients
back to full shape, compare them by name with the single-rank reference, and report the worst
entry. `compare` returns the figures; `assert_close` raises with the name, the max difference
and a few entries, so a failure says where to look.
"""

from __future__ import annotations

import numpy as np


def rel_diff(got, want) -> float:
    """max |got - want| / max |want| (float64 arithmetic; 0 for two empty arrays)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shape {got.shape} does not match the reference's {want.shape}")
    if want.size == 0:
        return 0.0
    scale = float(np.max(np.abs(want)))
    err = float(np.max(np.abs(got - want)))
    return err / scale if scale > 0 else err


def compare(got: dict, want: dict, rtol: float, what: str = "param") -> tuple[float, list[str]]:
    """(worst relative difference, one message per name that fails `rtol` or is missing)."""
    problems = []
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing:
        problems.append(f"{what}s missing from the run: {missing}")
    if extra:
        problems.append(f"{what}s the reference does not have: {extra}")
    worst = 0.0
    for name, ref in want.items():
        if name not in got:
            continue
        try:
            d = rel_diff(got[name], ref)
        except ValueError as exc:
            problems.append(f"{what} {name}: {exc}")
            continue
        worst = max(worst, d)
        if not d <= rtol:  # also catches NaN
            g = np.asarray(got[name], np.float64).reshape(-1)
            w = np.asarray(ref, np.float64).reshape(-1)
            i = np.argsort(-np.abs(g - w))[:3]
            problems.append(
                f"{what} {name}: max rel diff {d:.3e} > {rtol:.1e}; worst entries "
                f"(flat index, got, want): {[(int(j), g[j], w[j]) for j in i]}"
            )
    return worst, problems


def assert_close(got: dict, want: dict, rtol: float, what: str = "param") -> float:
    worst, problems = compare(got, want, rtol, what)
    if problems:
        raise AssertionError("\n".join(problems))
    return worst


def assert_losses_close(got, want, rtol: float) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"{got.size} losses against the reference's {want.size}")
    d = rel_diff(got, want)
    if not d <= rtol:
        raise AssertionError(f"losses differ by {d:.3e} > {rtol:.1e}: {got} vs {want}")
    return d
