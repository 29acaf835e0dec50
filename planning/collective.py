"""The collective cost model: a ring all-reduce of S bytes over P ranks, alpha-beta style.

  bytes sent per rank   2 (P-1)/P S                    (reduce-scatter + all-gather, P-1 steps
  time T(S, P)          2 (P-1) alpha + 2 (P-1)/P S/B   each of S/P bytes; Patarasuk & Yuan 2009)
  crossover S*          P alpha B                      (the two terms equal; regime = S vs S*)
  busbw                 S/T x 2 (P-1)/P                (the nccl-tests "bus bandwidth" convention)
alpha is the per-step latency, B the bandwidth one rank drives into the collective (decimal GB/s:
1 GB/s = 1e9 bytes/s); sizes are MiB (2^20 bytes). A ring-only model: below S* real libraries
switch to tree / one-shot algorithms, so it overstates small-message cost.

Bucketing a gradient of G bytes into c = ceil(G / bucket) all-reduces costs c latency terms plus
the one bandwidth term of G (the last bucket is partial): T = 2 (P-1) alpha c + 2 (P-1)/P G/B.
"""

from __future__ import annotations

import math

MIB = 2**20
SIZES_MIB = (0.25, 1, 4, 16, 64, 256, 1024)
BUCKETS_MIB = (1, 4, 25, 100, 400)
BACKWARD_SHARE = 2 / 3  # backward = 2x forward: the part of a step a gradient sync can hide under


def latency(P: int, alpha: float) -> float:
    return 2 * (P - 1) * alpha


def wire(S: float, P: int, B: float) -> float:
    return 2 * (P - 1) / P * S / B


def ring_time(S: float, P: int, alpha: float, B: float) -> float:
    return latency(P, alpha) + wire(S, P, B)


def size_rows(P, alpha, B) -> list[dict]:
    rows = []
    for mib in SIZES_MIB:
        S = mib * MIB
        T = ring_time(S, P, alpha, B)
        rows.append({"size_mib": mib, "time_ms": T * 1e3, "latency_pct": 100 * latency(P, alpha) / T,
                     "busbw_gbs": S / T * 2 * (P - 1) / P / 1e9,
                     "regime": "latency-bound" if S < P * alpha * B else "bandwidth-bound"})  # fmt: skip
    return rows


def bucket_rows(G, P, alpha, B) -> list[dict]:
    rows = []
    for mib in BUCKETS_MIB:
        count = math.ceil(G / (mib * MIB))
        lat = latency(P, alpha) * count
        T = lat + wire(G, P, B)
        rows.append({"bucket_mib": mib, "count": count, "time_ms": T * 1e3,
                     "latency_pct": 100 * lat / T, "overlap": count >= 2,
                     "bandwidth_bound": mib * MIB >= P * alpha * B})  # fmt: skip
    return rows


def layer_ratio(h, seq, b, grad_accum, tflops, P, alpha, B, grad_bytes=2) -> dict:
    """One transformer layer's 12 h^2 parameters: compute 6 N T FLOPs per micro-batch of T = s b
    tokens times grad_accum, against one all-reduce of its gradient."""
    n = 12 * h * h
    flops = 6 * n * seq * b * grad_accum
    compute = flops / (tflops * 1e12)
    G = n * grad_bytes
    T = ring_time(G, P, alpha, B)
    return {"params": n, "flops": flops, "compute_ms": compute * 1e3, "grad_mib": G / MIB,
            "allreduce_ms": T * 1e3, "latency_pct": 100 * latency(P, alpha) / T,
            "ratio": T / compute, "hideable": T / compute < BACKWARD_SHARE}  # fmt: skip


def verdict(fraction: float) -> str:
    if fraction > 1:
        return "COMMUNICATION-BOUND"
    if fraction > BACKWARD_SHARE:
        return "EXPOSED (longer than the backward pass it can overlap)"
    return "hideable behind backward"


def format_report(P, bw, lat_us, *, nbytes=None, params=None, step_ms=None, grad_bytes=2,
                  layer=None) -> str:  # fmt: skip
    alpha, B = lat_us * 1e-6, bw * 1e9
    star = P * alpha * B
    out = [f"op=allreduce  ranks={P}  link={bw:g} GB/s  alpha={lat_us:g} us",
           (f"latency/bandwidth crossover S* = P*alpha*B = {star / MIB:.2f} MiB "
           "(below this, fuse your messages)"), ""]  # fmt: skip
    if nbytes is not None:
        T, L = ring_time(nbytes, P, alpha, B), latency(P, alpha)
        out.append(f"single message {nbytes / MIB:.2f} MiB: {T * 1e3:.3f} ms (latency "
                   f"{L * 1e6:.1f} us + wire {wire(nbytes, P, B) * 1e3:.3f} ms)")  # fmt: skip
    elif layer is None:
        out += [f"{'size MiB':>10}{'time ms':>10}{'latency %':>11}{'busbw GB/s':>12}  regime",
                "-" * 62]  # fmt: skip
        for r in size_rows(P, alpha, B):
            out.append(f"{r['size_mib']:>10.2f}{r['time_ms']:>10.3f}{r['latency_pct']:>11.1f}"
                       f"{r['busbw_gbs']:>12.1f}  {r['regime']}")  # fmt: skip
        out += ["-" * 62, "analytic ring model, not measured"]
    if params is not None:
        G = params * 1e9 * grad_bytes
        T = ring_time(G, P, alpha, B)
        out += ["", (f"DDP gradient all-reduce for {params:g}B params @ {grad_bytes}B: "
                f"{G / MIB:.0f} MiB -> {T * 1e3:.1f} ms")]  # fmt: skip
        if step_ms is not None:
            frac = T * 1e3 / step_ms
            out.append(
                f"  fraction of a {step_ms:g} ms step: {100 * frac:.1f}%  -> {verdict(frac)}"
            )
        out += ["", (f"bucketing (total {G / MIB:.0f} MiB, bandwidth-bound above "
                f"{star / MIB:.2f} MiB):"),
                (f"{'bucket MiB':>11}{'count':>7}{'time ms':>10}{'latency %':>11}  "
                f"{'overlap?':<10}bandwidth-bound?"), "-" * 66]  # fmt: skip
        for r in bucket_rows(G, P, alpha, B):
            out.append(f"{r['bucket_mib']:>11}{r['count']:>7}{r['time_ms']:>10.1f}"
                       f"{r['latency_pct']:>11.1f}  {'yes' if r['overlap'] else 'no':<10}"
                       f"{'yes' if r['bandwidth_bound'] else 'no'}")  # fmt: skip
        out.append("")
    if layer is not None:
        r = layer_ratio(P=P, alpha=alpha, B=B, grad_bytes=grad_bytes, **layer)
        out += [(f"one layer: {r['params'] / 1e6:.1f}M params, {r['flops'] / 1e12:.2f} TFLOP "
                f"fwd+bwd (grad-accum {layer['grad_accum']})"),
                f"  compute {r['compute_ms']:.3f} ms @ {layer['tflops']:g} TFLOP/s",
                (f"  gradient all-reduce {r['grad_mib']:.1f} MiB -> {r['allreduce_ms']:.3f} ms "
                f"({r['latency_pct']:.0f}% latency)"),
                f"  comm/compute ratio  {r['ratio']:.3f}  -> "
                + ("hideable behind backward" if r["hideable"] else "EXPOSED")]  # fmt: skip
    return "\n".join(out)


def dry_bytes(P: int, nbytes: int, rank: int = 0) -> int:
    """Bytes rank `rank` sends in this project's ring all-reduce of `nbytes` (as float32) over P
    ranks, measured by running collectives.all_reduce alone on shape-only arrays."""
    import collectives
    from emulator.dry import dry_run
    from emulator.shapes import ShapeArray

    def body(comm):
        collectives.all_reduce(comm, ShapeArray.new((nbytes // 4,), "float32"), algorithm="ring")
        return comm.ledger.sent(op="all_reduce")

    return dry_run(body, P, rank)[0]


def format_dry(P: int) -> str:
    from collectives import cost

    lines = [f"dry run: collectives.all_reduce (ring) on rank 0 of {P}, shape-only float32",
             f"{'size MiB':>10}{'sent bytes':>16}{'2(P-1)/P S':>16}  equal"]  # fmt: skip
    for mib in SIZES_MIB:
        S = int(mib * MIB)
        got, want = dry_bytes(P, S), cost.ring_all_reduce(S // 4, P, 4, 0)[0]
        lines.append(f"{mib:>10.2f}{got:>16,}{2 * (P - 1) * S / P:>16,.0f}  "
                     f"{'yes' if got == want else 'NO'}")  # fmt: skip
    return "\n".join(lines)
