"""Comparing a run with the oracle: named arrays, relative differences, loud reports.

Every layout test and example ends the same way: gather the layout's parameters / gradients
back to full shape, compare them by name with the single-rank reference, and report the worst
entry. `compare` does one dict of named arrays, `compare_run` a whole run (losses, gradients,
parameters); both return the figures and one message per failure, naming the tensor, its max
difference and a few entries, so a failure says where to look. `assert_close` raises with them.
"""

from __future__ import annotations

import numpy as np


def rel_diff(got, want, scale: float | None = None) -> float:
    """max |got - want| / scale, scale = max |want| by default (float64 arithmetic; 0 for two
    empty arrays; the absolute difference when the scale is 0)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"shape {got.shape} does not match the reference's {want.shape}")
    if want.size == 0:
        return 0.0
    scale = float(np.max(np.abs(want))) if scale is None else scale
    err = float(np.max(np.abs(got - want)))
    return err / scale if scale > 0 else err


def _amax(x) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))


def _worst_entries(got, want) -> str:
    g = np.asarray(got, np.float64).reshape(-1)
    w = np.asarray(want, np.float64).reshape(-1)
    d = np.nan_to_num(np.abs(g - w), nan=np.inf)  # a NaN entry is the worst one
    i = np.argsort(-d, kind="stable")[:3]
    return "worst entries [flat index] got vs want: " + ", ".join(
        f"[{j}] {float(g[j])} vs {float(w[j])}" for j in i
    )


def _matched(got: dict, want: dict, what: str) -> tuple[list, list[str]]:
    """([(name, got, want) of each name in both with one shape], a message for the rest)."""
    problems, pairs = [], []
    if missing := sorted(set(want) - set(got)):
        problems.append(f"{what}s missing from the run: {missing}")
    if extra := sorted(set(got) - set(want)):
        problems.append(f"{what}s the reference does not have: {extra}")
    for name, ref in want.items():
        if name not in got:
            continue
        g, w = np.shape(got[name]), np.shape(ref)
        if g != w:
            problems.append(f"{what} {name}: shape {g} does not match the reference's {w}")
        else:
            pairs.append((name, got[name], ref))
    return pairs, problems


def compare(
    got: dict, want: dict, rtol: float, what: str = "param", noise_floor: float = 1e-6
) -> tuple[float, list[str]]:
    """(worst relative difference, one message per name that fails `rtol`, is missing, is
    extra or has another shape). NaN anywhere fails and makes the worst difference NaN.

    Each tensor is compared with its own max |want|, except a noise-level tensor - every
    reference value below ``noise_floor`` x the largest |want| of the whole dict (the model's
    largest value) - which passes when max |diff| <= rtol x that largest value.
    Why: attn.bk's exact gradient is 0 (adding k . bk shifts all of a query's scores equally,
    and softmax ignores that), so its computed gradient is rounding noise (~1e-20 in float64)
    whose value depends on the order of summation; AdamW then turns it into parameters of the
    same size. A per-tensor relative test on noise would fail any change of summation order,
    which every parallel layout makes. ``noise_floor=0`` compares every tensor with itself.
    """
    pairs, problems = _matched(got, want, what)
    amax = {n: _amax(w) for n, w in want.items()}
    top = max((a for a in amax.values() if not np.isnan(a)), default=0.0)
    diffs = [0.0]
    for name, g, w in pairs:
        noise = amax[name] < noise_floor * top
        diffs.append(rel_diff(g, w, top if noise else None))
        if not diffs[-1] <= rtol:  # also catches NaN
            kind = f" (noise-level, relative to the model's largest |{what}| {top:.3e})"
            problems.append(
                f"{what} {name}{kind if noise else ''}: max rel diff {diffs[-1]:.3e} > "
                f"{rtol:.1e}; {_worst_entries(g, w)}"
            )
    return float(np.max(diffs)), problems


def compare_abs(got: dict, want: dict, atol: float, what: str = "param") -> tuple[float, list]:
    """As `compare`, by max |diff| <= atol per tensor: (worst max |diff|, problems)."""
    pairs, problems = _matched(got, want, what)
    diffs = [0.0]
    for name, g, w in pairs:
        diffs.append(rel_diff(g, w, 0.0))
        if not diffs[-1] <= atol:
            problems.append(
                f"{what} {name}: max |diff| {diffs[-1]:.3e} > {atol:.1e}; {_worst_entries(g, w)}"
            )
    return float(np.max(diffs)), problems


def compare_losses(got, want, rtol: float) -> tuple[float, list[str]]:
    """(max |diff| / max |want| over the loss curve, problems)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf"), [f"{got.size} losses against the reference's {want.size}"]
    d = rel_diff(got, want)
    if not d <= rtol:
        return d, [f"losses differ by {d:.3e} > {rtol:.1e}: {got.tolist()} vs {want.tolist()}"]
    return d, []


def compare_run(
    run, ref, rtol: float, *, param_atol: float | None = None, noise_floor: float = 1e-6
) -> tuple[dict[str, float], list[str]]:
    """A layout's run against the reference: any two objects with ``.losses``, ``.grads`` and
    ``.params`` (full-shape dicts by name). -> (worst: {"loss", "grad", "param"}: worst
    relative difference each, problems: one message per failure; empty = pass).

    ``param_atol`` (lower precision): compare parameters by max |diff| <= param_atol instead
    (``worst["param"]`` is then that absolute difference). Rounding flips the sign of
    near-zero gradient entries and Adam turns any sign into a step of about lr, so two correct
    bf16 runs differ by up to ~2 lr per step in such entries. ``noise_floor``: as in `compare`
    (bf16 leaves attn.bk's zero gradient at up to ~1e-6 of the largest: raise it there).
    """
    if param_atol is None:
        params = compare(run.params, ref.params, rtol, "param", noise_floor)
    else:
        params = compare_abs(run.params, ref.params, param_atol, "param")
    worst, problems = {}, []
    for key, (w, p) in (
        ("loss", compare_losses(run.losses, ref.losses, rtol)),
        ("grad", compare(run.grads, ref.grads, rtol, "grad", noise_floor)),
        ("param", params),
    ):
        worst[key] = w
        problems += p
    return worst, problems


def compare_replicas(runs, fields=("losses", "grads", "params"), labels=None) -> list[str]:
    """Every rank's copy of replicated state against rank 0's, BITWISE -> one message per
    (rank, field, tensor) that differs (empty = every replica equal).

    ``runs``: each rank's run (objects with the ``fields`` as attributes, or dicts), e.g. the
    list ``emulator.spawn`` returns. A layout test that compares only ``runs[0]`` with the
    reference passes when another rank skips its last optimizer step; replicas of one state
    are computed from identical bits (a ring all-reduce leaves every rank the same sum, AdamW
    is deterministic), so any difference at all is a bug. Dict fields are compared by name,
    list fields (losses) as a whole. ``labels[i]`` names run i (default "rank i")."""
    labels = labels or [f"rank {i}" for i in range(len(runs))]
    get = lambda run, f: run[f] if isinstance(run, dict) else getattr(run, f)
    problems = []
    for f in fields:
        base = get(runs[0], f)
        for label, run in zip(labels[1:], runs[1:]):
            mine = get(run, f)
            if isinstance(base, dict):
                names = sorted(set(base) | set(mine))
                bad = [n for n in names if n not in base or n not in mine
                       or not np.array_equal(np.asarray(mine[n]), np.asarray(base[n]))]  # fmt: skip
            else:
                bad = [] if np.array_equal(np.asarray(mine), np.asarray(base)) else ["(all)"]
            for n in bad[:5]:
                problems.append(f"replicas differ: {label}'s {f} {n} != {labels[0]}'s")
            if len(bad) > 5:
                problems.append(f"replicas differ: {label}'s {f}: {len(bad) - 5} more tensors")
    return problems


def assert_close(got: dict, want: dict, rtol: float, what: str = "param") -> float:
    worst, problems = compare(got, want, rtol, what)
    if problems:
        raise AssertionError("\n".join(problems))
    return worst


def assert_losses_close(got, want, rtol: float) -> float:
    d, problems = compare_losses(got, want, rtol)
    if problems:
        raise AssertionError(problems[0])
    return d


def verdict(failures: list[str], checked: str, show: int = 4, skipped: str | None = None) -> str:
    """The last line of every example, which `python -m emulator tour` shows:
    "VERDICT: PASS - <checked>" or "VERDICT: FAIL - <failures, '; '-separated>": the first
    `show`, each cut at its first "; " (where `compare`'s messages start the worst entries).
    ``skipped`` (a reason): nothing numeric could be compared - "VERDICT: SKIP - <reason>; ..."
    unless something failed; a run that compared nothing has not passed (the example exits
    non-zero and the tour counts it as not passed)."""
    if not failures and skipped:
        return f"VERDICT: SKIP - {skipped}; {checked}"
    if not failures:
        return f"VERDICT: PASS - {checked}"
    more = [f"{len(failures) - show} more above"] if len(failures) > show else []
    return "VERDICT: FAIL - " + "; ".join([f.split("; ")[0] for f in failures[:show]] + more)
