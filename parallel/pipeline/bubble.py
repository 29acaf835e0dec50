"""A schedule's timeline under a unit cost model, its measured bubble, and the closed forms.

The replay takes the per-stage action orders (the executed schedule, as data) and gives every
action the earliest start its stage and its dependencies allow (schedules.simulate), with
durations from `Cost`: a forward F, the input-gradient part B and the weight-gradient part W of
a backward; an unsplit backward costs B + W. Under interleaving a chunk holds 1/v of the
stage's layers, so its actions cost 1/v as much. Communication is free unless `comm` > 0.
Times are exact Fractions, so measured bubbles equal the formulas exactly, not to a tolerance.

Bubble = idle / total per stage. Closed forms (t_b includes W for an unsplit backward):
  GPipe, 1F1B      (p-1) / (m+p-1)                 Narayanan et al. 2021, section 2.2.1
  interleaved      ((p-1)/v) / (m + (p-1)/v)        Narayanan et al. 2021, section 2.2.2
  ZB-H1            (p-1)(F+B-W) / ((p-1)(F+B-W) + m(F+B+W)),        m >= p, W <= F, B
                   1 - m(F+B+W) / ((m+p-1)(F+B) + W),                m <= p, W <= F, B
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from emulator.trace import Event, busy_idle
from parallel.pipeline.schedules import Schedule, simulate


@dataclass(frozen=True)
class Cost:
    f: object = 1  # forward of one micro-batch through one stage
    b: object = 1  # input-gradient backward (B)
    w: object = 1  # weight-gradient backward (W)
    comm: object = 0  # latency of one stage-to-stage message

    def duration(self, sched: Schedule, a) -> Fraction:
        t = {"F": self.f, "B": self.b, "W": self.w}[a.kind]
        if a.kind == "B" and not sched.split:
            t = Fraction(self.b) + Fraction(self.w)  # the whole backward in one action
        return Fraction(t) / sched.v


def replay(sched: Schedule, cost: Cost = Cost(), msg_bytes: int = 0) -> list[Event]:
    """Events of the executed order under `cost`: one per action, plus one "send" event per
    stage-boundary message (activation after F, gradient after B) with `msg_bytes` bytes."""
    done = simulate(sched, lambda s, a: cost.duration(sched, a), lambda s, d: Fraction(cost.comm))
    events = []
    U = sched.p * sched.v
    for (s, a), (t0, t1) in sorted(done.items(), key=lambda kv: (kv[1][0], kv[0][0])):
        name = f"{a.kind}{a.mb + 1}" + (f".{a.chunk}" if sched.v > 1 else "")
        events.append(Event(s, a.kind, name, t0, t1 - t0, mb=a.mb))
        u = sched.virtual(s, a.chunk)
        to = u + 1 if a.kind == "F" else u - 1 if a.kind == "B" else -1
        if 0 <= to < U:  # the message this action sends across a stage boundary
            kind = "act" if a.kind == "F" else "grad"
            events.append(Event(s, "send", f"{kind} {name}", t1, Fraction(cost.comm),
                                mb=a.mb, nbytes=msg_bytes, peer=to % sched.p))  # fmt: skip
    return events


def measured_bubble(sched: Schedule, cost: Cost = Cost()) -> list[Fraction]:
    """Per stage idle / total of the replayed schedule."""
    return [r["bubble"] for r in busy_idle(replay(sched, cost), sched.p)]


def bubble_formula(sched: Schedule, cost: Cost = Cost()) -> Fraction:
    """The closed-form bubble fraction of `sched` (every stage has the same one).

    ZB-H1 (Qi et al. 2023, section 2.1): the replay gives total = m(F+B+W) + (p-1)(F+B-W),
    i.e. 2W per stage less than 1F1B's (p-1)(F+B+W): B alone is on the critical path back,
    and each stage's deferred W passes fill the cool-down. With F = B = W that is a third of
    1F1B's bubble, the paper's claim. With m < p there is no steady state to fill: the span is
    1F1B's (m+p-1)(F+B+W) critical path with B in place of B + W, plus stage 0's last W, so
    total = (m+p-1)(F+B) + W (both agree at m = p). Both hold exactly when W <= min(F, B)
    (checked exhaustively for p <= 8, m <= 13, F, B in 1..4, W in 0..min(F, B): 4784
    cases, and by hypothesis); outside that domain a ValueError says so rather than returning
    a wrong figure.
    """
    p, m, v = sched.p, sched.m, sched.v
    if sched.name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1)
    if sched.name == "interleaved":
        return Fraction(p - 1, v) / (m + Fraction(p - 1, v))
    if sched.name == "zb-h1":
        f, b, w = Fraction(cost.f), Fraction(cost.b), Fraction(cost.w)
        if w > min(f, b):
            raise ValueError(
                f"the ZB-H1 closed form needs W <= min(F, B); got p={p}, m={m}, F={f}, B={b}, "
                f"W={w} (measure it with measured_bubble instead)"
            )
        busy = m * (f + b + w)
        total = busy + (p - 1) * (f + b - w) if m >= p else (m + p - 1) * (f + b) + w
        return (total - busy) / total
    raise ValueError(f"no closed-form bubble for schedule {sched.name!r}")


def in_flight(sched: Schedule) -> list[int]:
    """Peak number of (micro-batch, chunk) units per stage whose activations are alive: from
    its F until its last backward piece (B when unsplit, W when split)."""
    last = "W" if sched.split else "B"
    peaks = []
    for acts in sched.stages:
        live = peak = 0
        for a in acts:
            live += (a.kind == "F") - (a.kind == last)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def in_flight_formula(sched: Schedule) -> list[int]:
    """GPipe m; 1F1B min(p-s, m) (Narayanan et al. 2021, section 2.2.1); interleaved
    min(2(p-1-s) + (v-1)p + 1, m v) chunk units (Megatron's warm-up + 1); ZB-H1 min(p, m)."""
    p, m, v = sched.p, sched.m, sched.v
    rule = {
        "gpipe": lambda s: m,
        "1f1b": lambda s: min(p - s, m),
        "interleaved": lambda s: min(2 * (p - 1 - s) + (v - 1) * p + 1, m * v),
        "zb-h1": lambda s: min(p, m),
    }
    if sched.name not in rule:
        raise ValueError(f"no in-flight formula for schedule {sched.name!r}")
    return [rule[sched.name](s) for s in range(p)]
