"""The pipeline bubble calculator: S balanced stages, M micro-batches, v interleaved chunks.

A flush schedule (GPipe or 1F1B) with per-micro-batch stage time t spends (S-1) t filling and
draining, so total = (M + S - 1) t and the bubble is (S-1)/(M+S-1) (Huang et al. 2019,
arXiv:1811.06965; Narayanan et al. 2021, arXiv:2104.04473 section 2.2). Interleaving v chunks
per device makes a chunk's time t/v and the fill (S-1) t/v:
  bubble = ((S-1)/v) / (M + (S-1)/v)      efficiency E = M / (M + (S-1)/v)
  E >= target  <=>  M >= target (S-1) / (v (1 - target))   (solved exactly in fractions)
Under 1F1B the first stage keeps min(S, M) micro-batches of activations alive.
"""

from __future__ import annotations

import math
from fractions import Fraction

SWEEP_S = (2, 4, 8, 16, 32)
SWEEP_M = (1, 2, 4, 8, 16, 32, 64, 128)
CORNER = "S \\ M"


def efficiency(S: int, M: int, v: int = 1) -> float:
    return M / (M + (S - 1) / v)


def needed_microbatches(S: int, target: float, v: int = 1) -> int:
    """The least M with M / (M + (S-1)/v) >= target; the target read as its decimal."""
    E = Fraction(str(target))
    if not 0 < E < 1:
        raise ValueError(f"--target-efficiency must be in (0, 1), got {target}")
    return max(1, math.ceil(E * (S - 1) / (v * (1 - E))))


def check(S: int, M: int, v: int) -> None:
    for name, x in (("--stages", S), ("--micro-batches", M), ("--chunks", v)):
        if x < 1:
            raise ValueError(f"{name} must be >= 1, got {x}")


def report(S, M, v=1, target=0.9, stage_ms=None) -> dict:
    check(S, M, v)
    need = needed_microbatches(S, target, v)
    out = {"stages": S, "micro_batches": M, "chunks": v, "bubble": 1 - efficiency(S, M, v),
           "efficiency": efficiency(S, M, v), "target": target, "needed_micro_batches": need,
           "in_flight": min(S, need)}  # fmt: skip
    if stage_ms is not None:
        out |= {"step_ms": (M + (S - 1) / v) * stage_ms, "ideal_ms": M * stage_ms,
                "bubble_ms": (S - 1) / v * stage_ms}  # fmt: skip
    return out


def sweep(v=1) -> list[dict]:
    return [{"stages": S, **{str(M): efficiency(S, M, v) for M in SWEEP_M}} for S in SWEEP_S]


def format_report(r: dict, with_sweep=False) -> str:
    S, M, v = r["stages"], r["micro_batches"], r["chunks"]
    lines = [f"stages S={S}  micro-batches M={M}  chunks v={v}",
             f"bubble fraction (S-1)/v / (M + (S-1)/v) = {100 * r['bubble']:.1f}%",
             f"pipeline efficiency                     = {100 * r['efficiency']:.1f}%",
             (f"to reach {100 * r['target']:g}% efficiency you need M >= "
             f"{r['needed_micro_batches']} (={r['needed_micro_batches'] / S:.1f}x the stage count)"),
             (f"cost of that: the first stage keeps ~{r['in_flight']} micro-batches of activations "
             "alive under 1F1B")]  # fmt: skip
    if "step_ms" in r:
        lines.append(f"step time (M + (S-1)/v) x t = {r['step_ms']:.1f} ms at t = "
                     f"{r['step_ms'] / (M + (S - 1) / v):g} ms/stage (ideal M x t = "
                     f"{r['ideal_ms']:.1f} ms, bubble {r['bubble_ms']:.1f} ms)")  # fmt: skip
    if with_sweep:
        lines += ["", f"{CORNER:>7}" + "".join(f"{m:>8}" for m in SWEEP_M), "-" * 71]
        for row in sweep(v):
            lines.append(f"{row['stages']:>7}" + "".join(f"{100 * row[str(m)]:>7.0f}%"
                                                         for m in SWEEP_M))  # fmt: skip
        lines += ["-" * 71, (f"pipeline efficiency %, analytic model with v={v} "
                  "(balanced stages, free P2P)")]  # fmt: skip
    return "\n".join(lines)


def replayed(S: int, M: int, v: int = 1) -> list[dict]:
    """The twin measured by this project's pipeline code: each schedule built for (S, M, v)
    (parallel/pipeline/schedules.py) and replayed under unit costs (parallel/pipeline/bubble.py,
    exact fractions): the worst stage's bubble and stage 0's micro-batches in flight."""
    from parallel.pipeline.bubble import in_flight, measured_bubble
    from parallel.pipeline.schedules import make_schedule

    rows = []
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1"):
        if (name == "interleaved") != (v > 1):
            continue
        try:
            sched = make_schedule(name, S, M, v if name == "interleaved" else 1)
        except ValueError as exc:
            rows.append({"schedule": name, "error": str(exc)})
            continue
        rows.append({"schedule": name, "bubble": float(max(measured_bubble(sched))),
                     "in_flight_stage0": in_flight(sched)[0]})  # fmt: skip
    return rows


def format_replayed(S: int, M: int, v: int = 1) -> str:
    lines = [f"replayed by this project's schedules (S={S}, M={M}, v={v}; unit costs F = B = W):"]
    for r in replayed(S, M, v):
        if "error" in r:
            lines.append(f"  {r['schedule']:<12} not built: {r['error']}")
        else:
            lines.append(f"  {r['schedule']:<12} bubble {100 * r['bubble']:5.1f}%   stage 0 holds "
                         f"{r['in_flight_stage0']} micro-batch unit(s)")  # fmt: skip
    return "\n".join(lines)
