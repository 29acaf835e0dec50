"""Pipeline schedules as data: one function per schedule returns every stage's ordered actions.

Letters: p stages, m micro-batches, v model chunks per stage (interleaving), s a stage, j a
micro-batch, c a chunk. Chunk c of stage s is the virtual stage  u = c*p + s  (Narayanan et al.
2021, section 2.2.2: with 4 stages and 2 chunks, stage 0 holds virtual stages 0 and 4), so a
micro-batch visits u = 0, 1, ..., p*v - 1 forward and the reverse backward.

An action is (kind, j, c):
  F  forward of micro-batch j through chunk c
  B  backward: with `split=False` the whole backward (input and weight gradients); with
     `split=True` only the input gradient, on the critical path (Qi et al. 2023, section 2)
  W  the weight gradient of (j, c), split from B; any time after B, before the optimizer step
Nothing here runs a model: `validate` checks a schedule before the executor touches it, and
parallel/pipeline/bubble.py replays it under a cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F" | "B" | "W"
    mb: int  # j
    chunk: int = 0  # c

    def __str__(self) -> str:  # F3, or F3.1 for chunk 1 under interleaving
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


@dataclass
class Schedule:
    name: str
    p: int
    m: int
    v: int
    split: bool  # backward split into B (input grad) and W (weight grad)
    stages: list = field(default_factory=list)  # stages[s] = [Action, ...] in execution order

    def virtual(self, s: int, c: int) -> int:
        return c * self.p + s

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: " + " ".join(map(str, a)) for s, a in enumerate(self.stages))


def _check(p, m, v=1):
    for k, x in (("p (stages)", p), ("m (micro-batches)", m), ("v (chunks)", v)):
        if not isinstance(x, int) or isinstance(x, bool) or x < 1:
            raise ValueError(f"schedule: {k} must be an int >= 1, got {x!r}")


def gpipe(p: int, m: int) -> Schedule:
    """All m forwards, then all m backwards (Huang et al. 2019, section 2.3)."""
    _check(p, m)
    acts = [Action("F", j) for j in range(m)] + [Action("B", j) for j in range(m)]
    return Schedule("gpipe", p, m, 1, False, [list(acts) for _ in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush (Narayanan et al. 2021, section 2.2.1): stage s runs p-1-s warm-up
    forwards, then alternates one forward and one backward, then drains the remaining
    backwards. At most p - s micro-batches are in flight on stage s."""
    _check(p, m)
    stages = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        acts = [Action("F", j) for j in range(warm)]
        for k in range(m - warm):  # steady state: F of a new micro-batch, B of the oldest
            acts += [Action("F", warm + k), Action("B", k)]
        acts += [Action("B", j) for j in range(m - warm, m)]  # cool-down
        stages.append(acts)
    return Schedule("1f1b", p, m, 1, False, stages)


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2), Megatron-LM's order.

    Stage s walks its m*v forward units in rounds of p micro-batches per chunk: unit k is
    chunk (k // p) % v of micro-batch (k // (p*v))*p + k % p; backwards likewise with the
    chunks reversed. Warm-up: 2(p-1-s) + (v-1)p forwards, then 1F1B, then cool-down.
    """
    _check(p, m, v)
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs the micro-batch count m={m} to be a multiple of the "
            f"stage count p={p} (micro-batches enter in rounds of p per chunk); use "
            f"m={(m // p + 1) * p} or the plain 1f1b schedule"
        )
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        c = (k // p) % v
        return (k // (p * v)) * p + k % p, c if forward else v - 1 - c

    stages = []
    for s in range(p):
        warm = min((p - 1 - s) * 2 + (v - 1) * p, total)
        acts = [Action("F", *unit(k, True)) for k in range(warm)]
        for k in range(total - warm):
            acts += [Action("F", *unit(warm + k, True)), Action("B", *unit(k, False))]
        acts += [Action("B", *unit(k, False)) for k in range(total - warm, total)]
        stages.append(acts)
    return Schedule("interleaved", p, m, v, False, stages)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, section 2.1): 1F1B with the backward split into B and W.

    Stage s keeps 1F1B's p-1-s warm-up forwards, so B (only the input gradient) travels back
    as fast as possible; its W passes are delayed by s micro-batches (at most s weight
    gradients pending), which is what lets later stages start their B passes earlier and
    the deferred W passes fill the cool-down. Every stage then has p micro-batches between
    F and W, the same as stage 0 of 1F1B, so stage 0's peak memory is 1F1B's.
    """
    _check(p, m)
    stages = []
    for s in range(p):
        warm = min(p - 1 - s, m)
        acts, pending = [Action("F", j) for j in range(warm)], []

        def backward(j, acts=None, pending=None, s=s):
            acts.append(Action("B", j))
            pending.append(j)
            if len(pending) > s:  # W of the oldest micro-batch once s are pending
                acts.append(Action("W", pending.pop(0)))

        for k in range(m - warm):
            acts.append(Action("F", warm + k))
            backward(k, acts, pending)
        for j in range(m - warm, m):
            backward(j, acts, pending)
        acts += [Action("W", j) for j in pending]  # drain the deferred weight gradients
        stages.append(acts)
    return Schedule("zb-h1", p, m, 1, True, stages)


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` (one of SCHEDULES); v only for interleaved."""
    if name == "interleaved":
        return interleaved(p, m, v)
    if v != 1:
        raise ValueError(f"schedule {name!r} has one chunk per stage; v={v} is for 'interleaved'")
    makers = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}
    if name not in makers:
        raise ValueError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    return makers[name](p, m)


# ---- what each action waits for, and validation --------------------------------------------
def depends_on(sched: Schedule, s: int, a: Action) -> list[tuple[int, Action, bool]]:
    """[(stage, action, crosses_a_link)] that must finish before `a` can start on stage s.

    F(j) at virtual stage u needs F(j) at u-1 (its activation arrives by a send); B(j) at u
    needs B(j) at u+1 (the gradient of its output) and its own F(j); W(j) needs its own B(j).
    """
    u, last = sched.virtual(s, a.chunk), sched.p * sched.v - 1
    at = lambda w: (w % sched.p, w // sched.p)
    if a.kind == "F":
        return [] if u == 0 else [(at(u - 1)[0], Action("F", a.mb, at(u - 1)[1]), True)]
    if a.kind == "W":
        return [(s, Action("B", a.mb, a.chunk), False)]
    deps = [(s, Action("F", a.mb, a.chunk), False)]
    if u < last:
        deps.append((at(u + 1)[0], Action("B", a.mb, at(u + 1)[1]), True))
    return deps


def validate(sched: Schedule) -> Schedule:
    """Raise ValueError naming the offending stage and action unless the schedule is runnable:
    each stage runs every (micro-batch, chunk) it owns exactly once as F, B (and W when split),
    F before B before W, every received message is sent by exactly one action of the
    neighbour, and the stages cannot deadlock (checked by simulating the eager-send executor)."""
    if not isinstance(sched, Schedule):
        raise TypeError(f"validate: expected a Schedule, got {type(sched).__name__}")
    _check(sched.p, sched.m, sched.v)
    key = _key(sched)
    if key in _VALID:  # the same actions passed before: validity is a function of them
        return sched
    if len(sched.stages) != sched.p:
        raise ValueError(f"{sched.name}: {len(sched.stages)} action lists for p={sched.p} stages")
    kinds = "FBW" if sched.split else "FB"
    for s, acts in enumerate(sched.stages):
        seen: dict = {}
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise TypeError(f"{sched.name}: stage {s} action #{i} {a!r} is not an Action "
                                 f"(build it as Action('F', j, c))")  # fmt: skip
            if a.kind not in kinds or not (0 <= a.mb < sched.m and 0 <= a.chunk < sched.v):
                raise ValueError(
                    f"{sched.name}: stage {s} action #{i} {a} is not one of {list(kinds)} for "
                    f"a micro-batch in 0..{sched.m - 1} and a chunk in 0..{sched.v - 1}"
                )
            if a in seen:
                raise ValueError(f"{sched.name}: stage {s} runs {a} twice (#{seen[a]}, #{i})")
            seen[a] = i
            for ds, d, _ in depends_on(sched, s, a):
                if ds == s and d not in seen:
                    raise ValueError(
                        f"{sched.name}: stage {s} action #{i} {a} runs before {d}, which it needs"
                    )
        want = sched.m * sched.v * len(kinds)
        if len(seen) != want:
            missing = [
                str(Action(k, j, c))
                for k in kinds
                for j in range(sched.m)
                for c in range(sched.v)
                if Action(k, j, c) not in seen
            ]
            raise ValueError(f"{sched.name}: stage {s} never runs {missing[:6]}")
    simulate(sched, lambda s, a: 0)  # raises on deadlock
    if key is not None and len(_VALID) < 256:
        _VALID.add(key)
    return sched


# Schedules that passed `validate`, by content: every virtual rank of a run - and every run
# of a program - validates the same schedule, and the answer depends on nothing else
# (a simulation of p m v actions per rank at each call before: 0.4 ms a rank for pp4 m4).
_VALID: set = set()


def _key(sched: Schedule):
    """A hashable copy of everything validate reads, or None (unhashable actions: no cache)."""
    try:
        key = (sched.name, sched.p, sched.m, sched.v, bool(sched.split),
               tuple(tuple(acts) for acts in sched.stages))  # fmt: skip
        hash(key)
    except TypeError:
        return None
    return key


def simulate(sched: Schedule, duration, latency=lambda s, d: 0) -> dict:
    """Replay the per-stage orders with eager sends: each action starts when its stage is free
    and every dependency has finished (+ latency(src, dst) for one that crosses a link).
    duration(s, action) -> time. Returns {(s, action): (start, end)}; ValueError on deadlock."""
    done: dict = {}
    free = [0] * sched.p
    nxt = [0] * sched.p
    progress = True
    while progress:
        progress = False
        for s, acts in enumerate(sched.stages):
            while nxt[s] < len(acts):
                a = acts[nxt[s]]
                deps = depends_on(sched, s, a)
                if any((ds, d) not in done for ds, d, _ in deps):
                    break
                t = max([free[s]] + [done[ds, d][1] + (latency(ds, s) if x else 0)
                                     for ds, d, x in deps])  # fmt: skip
                done[s, a] = (t, t + duration(s, a))
                free[s], nxt[s], progress = t + duration(s, a), nxt[s] + 1, True
    stuck = [(s, acts[nxt[s]]) for s, acts in enumerate(sched.stages) if nxt[s] < len(acts)]
    if stuck:
        why = []
        for s, a in stuck:
            need = [
                f"{d} on stage {ds}" for ds, d, _ in depends_on(sched, s, a) if (ds, d) not in done
            ]
            why.append(f"stage {s} waits at {a} for {', '.join(need)}")
        raise ValueError(f"{sched.name}: the schedule deadlocks: {'; '.join(why)}")
    return done
