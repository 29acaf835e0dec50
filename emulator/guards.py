"""Training input checks and the non-finite stop: one place every entry point calls.

A training run with an invalid hyper-parameter (lr = inf, eps = 0, betas = 1, weight decay nan)
or a loss that overflows does not fail by itself: NaN propagates through every later step and
the run "finishes". So every trainer (emulator.reference.reference_train and the layouts in
parallel/) validates its arguments up front with `check_training` (ValueError naming the
argument) and stops on the first non-finite loss or gradient norm with `check_finite`
(NonFiniteError naming the step, the rank and what was non-finite).
"""

from __future__ import annotations

import math
import numbers


class NonFiniteError(FloatingPointError):
    """A loss or gradient norm was NaN or infinite; the message names the step and the rank."""


def _finite_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def check_hyper(*, lr, betas, eps, weight_decay, max_norm=None, where="AdamW") -> None:
    """ValueError naming the first invalid argument: lr finite >= 0, betas two finite numbers in
    [0, 1), eps finite > 0 (eps = 0 divides 0 by 0 where a gradient entry and its moment are 0),
    weight_decay finite >= 0, max_norm None or > 0 (inf: never clips; nan: rejected)."""
    bad = None
    if not (_finite_real(lr) and lr >= 0):
        bad = f"lr={lr!r}: must be a finite number >= 0"
    elif not (len(tuple(betas)) == 2 and all(_finite_real(b) and 0 <= b < 1 for b in betas)):
        bad = f"betas={tuple(betas)!r}: must be two finite numbers in [0, 1)"
    elif not (_finite_real(eps) and eps > 0):
        bad = f"eps={eps!r}: must be a finite number > 0"
    elif not (_finite_real(weight_decay) and weight_decay >= 0):
        bad = f"weight_decay={weight_decay!r}: must be a finite number >= 0"
    elif max_norm is not None and not (isinstance(max_norm, numbers.Real) and max_norm > 0):
        bad = f"max_norm={max_norm!r}: must be > 0, or None for no clipping"
    if bad:
        raise ValueError(f"{where}: {bad}")


def check_count(name: str, value, where: str, minimum: int = 1) -> int:
    """ValueError unless ``value`` is an integer >= minimum (steps, micro-batches)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{where}: {name}={value!r} must be an integer >= {minimum}")
    return int(value)


def check_training(where: str, *, steps, microbatches=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                   weight_decay=0.0, max_norm=None) -> None:  # fmt: skip
    """A trainer's entry check: steps and micro-batches >= 1, then `check_hyper`."""
    check_count("steps", steps, where)
    if microbatches is not None:
        check_count("microbatches", microbatches, where)
    check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_norm=max_norm,
                where=where)  # fmt: skip


def check_finite(step: int, *, rank: int, loss=None, grad_norm=None, losses=None,
                 where: str = "") -> None:  # fmt: skip
    """NonFiniteError on the first non-finite value of this step: ``losses`` (a list, entry r
    being rank r's share: names the first non-finite rank), ``loss`` and ``grad_norm`` (this
    rank's view, named as ``rank``). Every rank of a layout sees the same gathered loss and
    global norm, so every rank raises at the same step (no rank is left waiting)."""
    where = f" ({where})" if where else ""
    for r, x in enumerate(losses or ()):
        if not math.isfinite(float(x)):
            raise NonFiniteError(f"step {step}: non-finite loss share {x} on rank {r}{where}; "
                                 f"check lr, the data and the initial parameters")  # fmt: skip
    for what, x in (("loss", loss), ("gradient norm", grad_norm)):
        if x is not None and not math.isfinite(float(x)):
            raise NonFiniteError(f"step {step}: non-finite {what} {x} on rank {rank}{where}; "
                                 f"check lr, the data and the initial parameters")  # fmt: skip
