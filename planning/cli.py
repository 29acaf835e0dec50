"""`python -m emulator plan memory | collective | bubble ...` (tools/cli.py hands over here).

Errors in the input (unknown preset, a layout that does not divide the model, a GPU count no
layout fits) end the command with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from planning import bubble, collective, exact, explain, memory, presets


def _memory(a) -> str:
    if a.list_presets:
        return json.dumps(list(map(vars, presets.PRESETS.values()))) if a.json else (
            presets.format_presets())  # fmt: skip
    if a.explain and not a.preset:
        return explain.MEMORY
    p = presets.get(a.preset or "llama2-70b")
    seq = a.seq or p.seq
    common = {"seq": seq, "b": a.micro_batch, "reserve_gib": a.reserve}
    notes: list = []
    if a.suggest:
        rows = memory.suggest(p, a.gpus, gpu_gib=a.gpu_mem, top=a.top, **common)
    elif a.tp or a.pp or a.zero is not None:
        tp, pp = a.tp or 1, a.pp or 1
        dp = max(1, a.gpus // (tp * pp))
        rows = [memory.plan(p, a.gpus, dp, tp, pp, a.zero or 0, a.recompute, **common)]
    else:
        rows = memory.strategies(p, a.gpus, recompute=a.recompute, skipped=notes, **common)
    if a.json:
        out = memory.to_json(rows, a.gpu_mem)
        for j, r in zip(out, rows):
            e = exact.price(p, r, seq, a.micro_batch)
            j["model"] = {"params": e.params, "state": e.state, "activ": e.activ}
            d = exact.dry_figures(p, r, seq, a.micro_batch) if a.dry_run else None
            if d is not None:  # the dry run's twin through parallel.train (= nd_cost when [])
                j["dry_run"] = {"state": d.state, "activ": d.activ, "seconds": d.seconds,
                                "representatives": d.ranks,
                                "differences_from_nd_cost": d.differences}  # fmt: skip
        return json.dumps({"preset": vars(p), "gpus": a.gpus, "seq": seq, "rows": out})
    text = memory.format_table(p, rows, gpus=a.gpus, recompute=a.recompute, gpu_gib=a.gpu_mem,
                               suggested=a.suggest, notes=notes, **common)  # fmt: skip
    if not a.no_model:
        text += "\n\n" + exact.format_table(p, rows, seq, a.micro_batch, a.gpu_mem, a.dry_run)
    return text + ("\n\n" + explain.MEMORY if a.explain else "")


def _collective(a) -> str:
    if a.explain:
        return explain.COLLECTIVE
    layer = None
    if a.layer_ratio:
        layer = {"h": a.hidden, "seq": a.seq, "b": a.micro_batch, "grad_accum": a.grad_accum,
                     "tflops": a.tflops}  # fmt: skip
    for name, x in (("--gpus", a.gpus - 1), ("--bw", a.bw), ("--latency", a.latency + 1)):
        if x <= 0:
            raise ValueError(f"{name} must be {'>= 2' if name == '--gpus' else '> 0'}")
    kw = {"nbytes": a.bytes, "params": a.params, "step_ms": a.step_ms, "grad_bytes": a.grad_bytes,
              "layer": layer}  # fmt: skip
    if a.json:
        al, B = a.latency * 1e-6, a.bw * 1e9
        out = {"crossover_bytes": a.gpus * al * B, "sizes": collective.size_rows(a.gpus, al, B)}
        if a.params is not None:
            out["buckets"] = collective.bucket_rows(a.params * 1e9 * a.grad_bytes, a.gpus, al, B)
        if layer:
            out["layer"] = collective.layer_ratio(P=a.gpus, alpha=al, B=B, **layer)
        return json.dumps(out)
    text = collective.format_report(a.gpus, a.bw, a.latency, **kw)
    if a.dry_run:
        text += "\n\n" + collective.format_dry(a.gpus)
    return text


def _bubble(a) -> str:
    if a.explain:
        return explain.BUBBLE
    r = bubble.report(a.stages, a.micro_batches, a.chunks, a.target_efficiency, a.stage_ms)
    if a.json:
        return json.dumps(r | ({"sweep": bubble.sweep(a.chunks)} if a.sweep else {}))
    text = bubble.format_report(r, with_sweep=a.sweep)
    return text + "\n\n" + bubble.format_replayed(a.stages, a.micro_batches, a.chunks)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m emulator plan", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="tool", required=True)
    m = sub.add_parser("memory", help="resident GiB per GPU of each layout")
    m.add_argument("--preset", default=None, help=f"one of {', '.join(presets.PRESETS)}")
    m.add_argument("--gpus", type=int, default=8)
    m.add_argument("--micro-batch", type=int, default=1)
    m.add_argument("--seq", type=int, default=None, help="default: the preset's")
    m.add_argument("--recompute", choices=memory.RECOMPUTE, default="none")
    m.add_argument("--gpu-mem", type=float, default=192.0, help="GiB per GPU")
    m.add_argument("--reserve", type=float, default=10.0, help="GiB per GPU kept back")
    m.add_argument("--tp", type=int, default=None)
    m.add_argument("--pp", type=int, default=None)
    m.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None)
    m.add_argument("--suggest", action="store_true", help="rank the layouts that fit")
    m.add_argument("--top", type=int, default=5)
    m.add_argument("--list-presets", action="store_true")
    m.add_argument("--no-model", action="store_true", help="omit the 'this model' table")
    m.add_argument("--dry-run", action="store_true", help="add columns measured by dry runs")
    c = sub.add_parser("collective", help="ring all-reduce cost: crossover, sizes, buckets")
    c.add_argument("--gpus", type=int, default=8)
    c.add_argument("--bw", type=float, default=50.0, help="GB/s one rank drives")
    c.add_argument("--latency", type=float, default=8.0, help="alpha, us per step")
    c.add_argument("--bytes", type=int, default=None, help="price one message of this size")
    c.add_argument("--params", type=float, default=None, help="DDP gradient, billions")
    c.add_argument("--grad-bytes", type=int, default=2)
    c.add_argument("--step-ms", type=float, default=None)
    c.add_argument("--layer-ratio", action="store_true")
    c.add_argument("--hidden", type=int, default=8192)
    c.add_argument("--seq", type=int, default=4096)
    c.add_argument("--micro-batch", type=int, default=1)
    c.add_argument("--grad-accum", type=int, default=1)
    c.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU")
    c.add_argument("--dry-run", action="store_true", help="measure rank 0's ring bytes")
    b = sub.add_parser("bubble", help="pipeline bubble, micro-batches needed, S x M sweep")
    b.add_argument("--stages", type=int, default=8)
    b.add_argument("--micro-batches", type=int, default=8)
    b.add_argument("--chunks", type=int, default=1)
    b.add_argument("--stage-ms", type=float, default=None)
    b.add_argument("--target-efficiency", type=float, default=0.9)
    b.add_argument("--sweep", action="store_true")
    for s in (m, c, b):
        s.add_argument("--json", action="store_true")
        s.add_argument("--explain", action="store_true", help="each figure's derivation")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    try:
        text = {"memory": _memory, "collective": _collective, "bubble": _bubble}[a.tool](a)
    except ValueError as exc:
        print(f"plan {a.tool}: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
