"""The memory planner: resident bytes per GPU of a layout, by the formulas a training course uses.

Letters: Psi the preset's quoted parameter count, L layers, h d_model, a heads, s sequence,
b micro-batch, dp / tp / pp the degrees, z the ZeRO stage. Every figure is per GPU.

state (mixed-precision Adam, 2 + 2 + 12 bytes/param: ZeRO, arXiv:1910.02054 section 3.1), over
the Psi_r = Psi / (tp pp) parameters one model-parallel rank owns:
  z0  16 Psi_r      z1  4 Psi_r + 12 Psi_r/dp      z2  2 Psi_r + 14 Psi_r/dp
  z3  16 Psi_r/dp + 4 Psi/(tp L)   <- one layer's unsharded bf16 parameters and bf16 gradients
      (the gathered unit in flight; equivalently the current plus the prefetched layer's
      parameters). The course's 133.6 GiB for 70B on 8 GPUs is exactly 16 Psi/8 + 4 Psi/80.
activations per layer (Korthikanti et al., arXiv:2205.05198, eqs. 1-2 and section 5), with
sequence parallelism whenever tp > 1 (the course: "always enable it with TP"):
  none  s b h (34 + 5 a s / h) / tp     selective  34 s b h / tp     full  2 s b h / tp
  times L layers: under 1F1B the first stage holds pp in-flight micro-batches of L/pp layers
  each, so pp cancels (eq. 5 has no p in it).
total = state + activations + reserve; a plan fits when total <= the GPU's memory.
"""

from __future__ import annotations

import dataclasses
import math

GIB = 2**30
RECOMPUTE = ("none", "selective", "full")
# --suggest's heuristic disruption score ("prefer ZeRO stages over recompute over TP over PP"):
# one point per ZeRO stage, 3 / 6 for selective / full recompute, 4 per doubling of tp or pp
RC_SCORE = {"none": 0, "selective": 3, "full": 6}
MP_SCORE = 4
TP_MAX = 8  # GPUs per node: tensor parallelism stays on the intra-node fabric


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    dp: int
    tp: int
    pp: int
    zero: int
    recompute: str
    state: float  # bytes
    activ: float  # bytes
    reserve: float  # bytes

    @property
    def total(self) -> float:
        return self.state + self.activ + self.reserve

    @property
    def axes(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp} z{self.zero}"

    @property
    def score(self) -> float:
        mp = math.log2(self.tp) + math.log2(self.pp)
        return self.zero + RC_SCORE[self.recompute] + MP_SCORE * mp


def state_bytes(psi: float, L: int, dp: int, tp: int, pp: int, zero: int) -> float:
    p = psi / (tp * pp)
    return {0: 16 * p, 1: 4 * p + 12 * p / dp, 2: 2 * p + 14 * p / dp,
            3: 16 * p / dp + 4 * psi / (tp * L)}[zero]  # fmt: skip


def activation_bytes(L: int, h: int, a: int, s: int, b: int, tp: int, recompute: str) -> float:
    per = {"none": 34 + 5 * a * s / h, "selective": 34, "full": 2}[recompute]
    return L * s * b * h * per / tp


def check_layout(preset, gpus: int, dp: int, tp: int, pp: int, even_pp: bool = True) -> None:
    """A layout must use every GPU and divide the model; the error names the degree."""
    for name, d in (("tp", tp), ("pp", pp), ("dp", dp)):
        if d < 1:
            raise ValueError(f"{name}={d} must be >= 1")
    what = {"heads": preset.heads, "kv heads": preset.kv_heads, "d_ff": preset.d_ff}
    bad = [f"{n} {v}" for n, v in what.items() if v % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide {preset.name}'s {' and '.join(bad)}")
    if even_pp and preset.layers % pp:
        raise ValueError(f"pp={pp} does not divide {preset.name}'s {preset.layers} layers")
    if pp > preset.layers:
        raise ValueError(f"pp={pp} is more stages than {preset.name}'s {preset.layers} layers")
    if gpus % (tp * pp) or dp * tp * pp != gpus:
        raise ValueError(f"dp x tp x pp = {dp} x {tp} x {pp} != {gpus} GPUs "
                         f"(tp x pp = {tp * pp} must divide the GPU count)")  # fmt: skip


def plan(
    preset, gpus, dp, tp, pp, zero, recompute, seq, b, reserve_gib, name=None, even_pp=True
) -> Plan:
    check_layout(preset, gpus, dp, tp, pp, even_pp)
    state = state_bytes(preset.params, preset.layers, dp, tp, pp, zero)
    act = activation_bytes(preset.layers, preset.d_model, preset.heads, seq, b, tp, recompute)
    name = name or f"tp={tp} pp={pp} z{zero} rc={recompute}"
    return Plan(name, dp, tp, pp, zero, recompute, state, act, reserve_gib * GIB)


def strategies(preset, gpus, seq, b, recompute, reserve_gib, skipped=None) -> list[Plan]:
    """The six single-axis plans: DDP and ZeRO-1/2/3 over dp = gpus, then tp = gpus, pp = gpus
    (a model-parallel row the model's shape cannot take is left out, its reason appended to
    ``skipped``)."""
    skipped = [] if skipped is None else skipped
    rows = []
    for z, name in enumerate(("DDP (replicate everything)", "ZeRO-1 (shard optimizer)",
                              "ZeRO-2 (+ shard grads)", "ZeRO-3 / FSDP (+ shard params)")):  # fmt: skip
        rows.append(plan(preset, gpus, gpus, 1, 1, z, recompute, seq, b, reserve_gib, name))
    for axis, (tp, pp) in (("Tensor parallel tp", (gpus, 1)), ("Pipeline parallel pp", (1, gpus))):
        try:
            rows.append(plan(preset, gpus, 1, tp, pp, 0, recompute, seq, b, reserve_gib,
                             f"{axis}={gpus}"))  # fmt: skip
        except ValueError as exc:
            skipped.append(f"{axis}={gpus} left out: {exc}")
    return rows


def candidates(preset, gpus, seq, b, reserve_gib) -> list[Plan]:
    """Every layout: tp a power of two <= 8 dividing the heads, pp a divisor of gpus / tp and of
    L, each ZeRO stage and recompute mode; in the order tp, pp, recompute, zero."""
    out = []
    tp = 1
    while tp <= min(TP_MAX, gpus):
        for pp in range(1, gpus // tp + 1):
            if (gpus // tp) % pp or gpus % tp:
                continue
            for rc in RECOMPUTE:
                for z in range(4):
                    try:
                        out.append(plan(preset, gpus, gpus // (tp * pp), tp, pp, z, rc, seq, b,
                                        reserve_gib))  # fmt: skip
                    except ValueError:
                        break
        tp *= 2
    return out


def suggest(preset, gpus, seq, b, reserve_gib, gpu_gib, top) -> list[Plan]:
    """The fitting plans with the lowest scores: sorted by score (stable, so ties keep the
    candidates' order), the first `top` taken, then a plan whose state and activations equal an
    earlier listed plan's dropped - it adds an axis that changes nothing (the course prints five
    rows for --top 6 on 70B / 64 GPUs; the sixth, tp=1 pp=2 z3 selective, repeats row one)."""
    fits = [p for p in candidates(preset, gpus, seq, b, reserve_gib) if p.total <= gpu_gib * GIB]
    if not fits:
        raise ValueError(
            f"no layout of {gpus} GPUs fits {preset.name} (seq={seq}, micro-batch={b}) in "
            f"{gpu_gib:g} GiB per GPU, even with ZeRO-3 and full recompute; use more GPUs"
        )
    shown = []
    for p in sorted(fits, key=lambda p: p.score)[:top]:
        if all((q.state, q.activ) != (p.state, p.activ) for q in shown):
            shown.append(p)
    return shown


def _g(x: float) -> str:
    return f"{x / GIB:9.1f}"


def format_table(preset, rows, *, gpus, seq, b, recompute, gpu_gib, reserve_gib,
                 suggested=False, notes=()) -> str:  # fmt: skip
    p = preset
    state16 = 16 * p.params
    lines = [
        f"model      : {p.params / 1e9:.1f}B params, L={p.layers}, h={p.d_model}, heads={p.heads}",
        f"step shape : seq={seq}, micro-batch={b}, recompute={recompute}",
        (
            f"cluster    : {gpus} GPUs x {gpu_gib:g} GiB (reserve {reserve_gib:g} GiB, usable "
            f"{gpu_gib - reserve_gib:g} GiB)"
        ),
        (
            f"state      : 2+2+12 = 16 bytes/param -> {state16 / GIB:.0f} GiB unsharded "
            f"({state16 / GIB / gpu_gib:.1f} GPUs of pure state)"
        ),
        "",
    ]
    head = f"{'strategy':<32}{'axes':<22}{'state':>9}{'activ':>9}{'reserve':>9}{'total':>9}"
    head += f"  fits {gpu_gib:g} GiB?"
    lines += [head, "-" * len(head)]
    for r in rows:
        fits = "YES" if r.total <= gpu_gib * GIB else "NO"
        lines.append(f"{r.name:<32}{r.axes:<22}{_g(r.state)}{_g(r.activ)}{_g(r.reserve)}"
                     f"{_g(r.total)}  {fits}")  # fmt: skip
    lines.append("-" * len(head))
    if suggested:
        best = rows[0]
        lines.append(
            f"cheapest fit (heuristic score {best.score:g}): dp={best.dp} tp={best.tp} "
            f"pp={best.pp} z{best.zero} recompute={best.recompute} -> {best.total / GIB:.1f} GiB/GPU"
        )
    else:
        lines.append("all figures GiB per GPU, analytic model (not measured)")
        lines += list(notes)
    return "\n".join(lines)


def to_json(rows, gpu_gib) -> list[dict]:
    return [
        dict(
            dataclasses.asdict(r),
            total=r.total,
            score=r.score,
            fits=r.total <= gpu_gib * GIB,
            **{
                f"{k}_gib": round(v / GIB, 1)
                for k, v in (("state", r.state), ("activ", r.activ), ("total", r.total))
            },
        )
        for r in rows
    ]
