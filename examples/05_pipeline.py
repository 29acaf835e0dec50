"""Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and ZB-H1, checked against the reference.

    python -m emulator run -n 4 examples/05_pipeline.py --pp 4 --microbatches 8 --schedule 1f1b
    python -m emulator run -n 4 examples/05_pipeline.py --schedule interleaved --chunks 2
    python -m emulator run -n 4 examples/05_pipeline.py --pp 2 --dp 2 --dp-mode zero1
    python -m emulator run -n 1 examples/05_pipeline.py --pp 1 --microbatches 3 --schedule interleaved --chunks 3
    python -m emulator run -n 4 examples/05_pipeline.py --dtype mixed --max-norm 0 --schedule zb-h1
    mpiexec -n 4 python examples/05_pipeline.py --pp 4 --microbatches 8 --schedule zb-h1

The L blocks are split into p stages (v chunks each when interleaved), the batch into m
micro-batches; each stage runs its schedule's action list and sends one (b, S, H) activation
forward and its gradient backward per boundary crossing (between different ranks: with p = 1
every chunk's messages stay local). Checks: loss, every gradient and parameter vs
emulator.reference.reference_train in the same dtype - bitwise without clipping and dp, else
1e-12 in float64 (the clip norm's and the dp sum's order); the bubble of the executed schedule
replayed under unit costs beside its closed form ("n/a" where none applies); peak micro-batches
in flight, peak activation bytes (memory ledger) per stage beside the per-chunk formula (and the
closed form for GPipe, 1F1B and ZB-H1), boundary bytes and, with --dp, the dp bytes of each
stage beside their formulas. Prints the ASCII timeline and writes a Chrome trace (open it in
ui.perfetto.dev).
"""

from __future__ import annotations

import sys

import emulator
from emulator import svg
from emulator.check import compare_replicas, compare_run
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.precision import compute_dtype
from emulator.reference import reference_train
from emulator.trace import ascii_timeline, write_chrome_trace
from parallel.pipeline.bubble import (
    Cost,
    bubble_formula,
    in_flight_formula,
    measured_bubble,
    replay,
)
from parallel.pipeline.cost import (
    boundary_bytes,
    dp_bytes,
    peak_activation_bytes,
    peak_closed_form,
    unit_bytes,
)
from parallel.pipeline.executor import stage_param_names
from parallel.pipeline.train import pipeline_train
from tools import args as cli
from tools.run import progress, rank_report, record, run_example, say_verdict

p_ = cli.parser(__doc__)
p_.add_argument("--pp", type=cli.positive_int, default=4, help="pipeline stages p")
p_.add_argument("--dp", type=cli.positive_int, default=1, help="data-parallel replicas (dp x pp)")
p_.add_argument("--dp-mode", default="ddp", choices=["ddp", "zero1"])
p_.add_argument("--microbatches", type=cli.positive_int, default=8, help="m per dp replica")
p_.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
p_.add_argument("--chunks", type=cli.positive_int, default=None,
                help="v, for --schedule interleaved (default 2)")  # fmt: skip
p_.add_argument("--dtype", default="float64", choices=["float64", "float32", "mixed"])
p_.add_argument("--max-norm", type=cli.nonneg_float, default=1.0, help="clip norm (0: no clip)")
p_.add_argument("--trace", default="05_pipeline_trace.json", metavar="PATH",
                help="Chrome trace path (default: ./05_pipeline_trace.json)")  # fmt: skip
p_.add_argument("--svg", default=None, metavar="PATH",
                help="write the timeline (PATH) and the comm matrix (PATH with -comm.svg)")  # fmt: skip
p_.add_argument("--micro-batch", type=cli.positive_int, default=2, help="b, sequences per mb")
p_.add_argument("--layers", type=cli.positive_int, default=None,
                help="model L (default 2 per stage chunk, 2 p v)")  # fmt: skip
cli.add_common(p_, model={"vocab": 32, "seq": 8, "d_model": 16, "heads": 2}, steps=3)
ARGS = cli.parse(p_)
cli.refuse_unless(p_, ARGS, "--chunks", None, ARGS.schedule == "interleaved",
                  f"with --schedule {ARGS.schedule} (only interleaved has chunks)")  # fmt: skip
cli.refuse_unless(p_, ARGS, "--dp-mode", "ddp", ARGS.dp > 1, "with --dp 1")
ARGS.chunks = ARGS.chunks or 2
_pieces = ARGS.pp * (ARGS.chunks if ARGS.schedule == "interleaved" else 1)
ARGS.layers = ARGS.layers or 2 * _pieces
if ARGS.layers < _pieces:
    p_.error(f"argument --layers: {ARGS.layers} blocks cannot fill {_pieces} stage chunks; "
             f"need --layers >= {_pieces}")  # fmt: skip
if ARGS.dtype == "mixed" and ARGS.dp > 1:
    p_.error("--dtype mixed with --dp > 1 has no exact check here: the dp sum adds bf16 gradients "
             "in another order than the reference and AdamW turns the flipped signs of near-zero "
             "entries into O(lr) parameter differences; run mixed with --dp 1 (compared bitwise) "
             "or dp x pp in float64 / float32")  # fmt: skip
cli.check_world(p_, ARGS.pp * ARGS.dp, f"--pp {ARGS.pp} x --dp {ARGS.dp}")


def tolerance(dtype: str, p: int, D: int, clip: bool) -> tuple[float, str]:
    """(rtol vs the same-dtype reference, why it is not 0)."""
    if D == 1 and (not clip or p == 1):
        return 0.0, "bitwise"  # the reference's arithmetic in the reference's order
    if D == 1:  # only the clip norm differs: stage sums ring-all-reduced, not one running sum,
        # so its float64 coefficient can differ in the last bit; a float32 / bf16 gradient times
        # it then rounds differently only within that bit of a rounding boundary (measured: 0
        # in float32 and mixed; 2.4e-15 in float64)
        return {"float64": 1e-12, "float32": 1e-5, "mixed": 1e-3}[dtype], "clip norm order"
    # the dp sum adds the replicas' gradients in another order (measured float64 3.1e-15,
    # float32 1.7e-6 after 3 steps)
    return {"float64": 1e-12, "float32": 1e-5}[dtype], "dp sum order"


def main(comm) -> int:
    a = ARGS
    v = a.chunks if a.schedule == "interleaved" else 1
    if comm.world_size != a.pp * a.dp:
        raise ValueError(f"--pp {a.pp} x --dp {a.dp} needs {a.pp * a.dp} ranks, got {comm.world_size}")  # fmt: skip
    sizes = cli.model_kwargs(a) | {"max_seq_len": max(16, a.seq)}  # --seq is S; T >= 16
    cfg = ModelConfig(**sizes, dtype=a.dtype)  # n_layers = --layers
    b, S, m, D = a.micro_batch, a.seq, a.microbatches, a.dp
    batches = lambda step: synthetic_batch(5 + a.seed, step, b * m * D, S, cfg.vocab_size)
    where = emulator.Mesh(comm, dp=D, pp=a.pp) if D > 1 else comm
    mode = a.dp_mode if D > 1 else "none"
    clip = a.max_norm or None
    run = pipeline_train(where, cfg, a.seed, progress(batches, a.steps), a.steps,
                         schedule=a.schedule, microbatches=m, chunks=v, dp_mode=mode,
                         max_norm=clip)  # fmt: skip
    # every rank's view of its pp group: all dp replicas must show the same figures
    mine = (run.p2p, run.in_flight, run.act_peak, run.dp_bytes)
    views = comm.allgather_object(mine)
    # and every rank's losses, grads and params (uncounted): dp replicas must agree bitwise
    states = comm.gather_object({"losses": run.losses, "grads": run.grads, "params": run.params})
    sent_to = comm.allgather_object(rank_report(comm)["sent_to"]) if a.svg else None
    if comm.rank:
        return 0
    # the reference in the same dtype (mixed: bf16 compute, fp32 master and Adam, as the run)
    ref = reference_train(cfg, a.seed, batches, a.steps, microbatches=m * D, max_norm=clip)
    rtol, why = tolerance(a.dtype, a.pp, D, clip is not None)
    worst, problems = compare_run(run, ref, rtol=rtol, noise_floor=1e-6 if rtol else 0.0)
    sched, p, fails = run.schedule, a.pp, list(problems)
    fails += [f"rank {r}'s replica differs from rank 0's: {x}" for r, x in enumerate(views)
              if x != mine]  # fmt: skip
    fails += compare_replicas(states)

    # bubble: the executed per-stage orders replayed with F = B = W = 1 (B+W for unsplit)
    events = replay(sched, Cost(1, 1, 1), msg_bytes=b * S * cfg.d_model * cfg_item(cfg))
    bubble = measured_bubble(sched, Cost(1, 1, 1))
    try:
        formula, why_not = bubble_formula(sched, Cost(1, 1, 1)), None
    except ValueError as e:  # outside the closed form's domain: show the measurement alone
        formula, why_not = None, str(e).split(";")[0]
    if formula is not None:
        fails += [
            f"stage {s} bubble {x} != {formula}" for s, x in enumerate(bubble) if x != formula
        ]
    # in flight, peak activation bytes, boundary and dp bytes (last step) beside their formulas
    want_live = in_flight_formula(sched)
    unit = unit_bytes(cfg, sched, run.split, b, S)
    want_act = peak_activation_bytes(sched, unit)  # per-chunk in-flight units x unit bytes
    try:
        closed = peak_closed_form(sched, unit)
    except ValueError:  # interleaved; ZB-H1 with m < p
        closed = None
    want_p2p = boundary_bytes(sched, b * S * cfg.d_model * cfg_item(cfg))
    want_dp = [dp_bytes(cfg, stage_param_names(cfg, run.split, s, p), D, mode) for s in range(p)]
    rows = []
    for s in range(p):
        got = run.p2p[s]
        checks = [
            (got, {"sent": want_p2p[s], "recv": want_p2p[s]}, "boundary bytes"),
            (run.in_flight[s], want_live[s], "in flight"),
            (run.act_peak[s], want_act[s], "peak activation bytes (ledger vs formula)"),
            (want_act[s], want_act[s] if closed is None else closed[s], "peak vs closed form"),
            (run.dp_bytes[s], want_dp[s], "dp bytes"),
        ]
        fails += [f"stage {s} {what} {x} != {y}" for x, y, what in checks if x != y]
        blocks = [i for u in range(s, p * v, p) for i in run.split[u]]
        rows.append([s, f"{blocks[0]}..{blocks[-1]}" if v == 1 else str(blocks),
                     f"{float(bubble[s]):.4f} / " + (f"{float(formula):.4f}" if formula is not None
                                                     else "n/a"),
                     f"{run.in_flight[s]} / {want_live[s]}",
                     f"{run.act_peak[s]} / {want_act[s]}" + ("" if closed is None else " (closed)"),
                     f"{got['sent']} / {want_p2p[s]}",
                     f"{run.dp_bytes[s]} / {want_dp[s]}"])  # fmt: skip
    path = write_chrome_trace(a.trace, events)
    pictures = []
    if a.svg:
        title = f"{a.schedule}: p={p} m={m} v={v} dp={D}"
        pictures.append(svg.write(a.svg, svg.timeline_svg(events, p, title=title)))
        comm_path = a.svg.removesuffix(".svg") + "-comm.svg"
        pictures.append(svg.write(comm_path, svg.comm_matrix_svg(sent_to, title=f"{title}: "
                                  "bytes sent, row rank -> column rank, per axis")))  # fmt: skip

    print(f"{a.schedule}: p={p} m={m} v={v} dp={D} ({mode}) b={b} S={S} H={cfg.d_model} "
          f"L={cfg.n_layers} dtype={a.dtype}")  # fmt: skip
    print("timeline in logical time (unit costs F = B = W = 1, one column each; not seconds):")
    print(ascii_timeline(events, p))
    print("legend: Fi forward of micro-batch i, Bi backward, Wi weight gradient (zb-h1), "
          "Fi.c / Bi.c chunk c (interleaved), '=' continues, '.' idle (bubble)")  # fmt: skip
    print(format_table(["stage", "blocks", "bubble meas/formula", "in flight meas/formula",
                        "peak act bytes ledger/formula", "p2p sent/formula", "dp sent/formula"],
                       rows))  # fmt: skip
    if why_not:
        print(f"bubble formula n/a: {why_not}")
    print(f"Chrome trace: {path} (open in ui.perfetto.dev)")
    for pic in pictures:
        print(f"SVG: {pic}")
    for f in fails:
        print("MISMATCH:", f)
    bub = (f"bubble {float(bubble[0]):.4f} = formula" if formula is not None
           else f"bubble {float(bubble[0]):.4f} measured only (formula n/a: {why_not})")  # fmt: skip
    cf = "" if closed is None else " = closed form"
    dpb = "" if D == 1 else f"; dp bytes per stage = {mode} formula ({sum(want_dp)} B)"
    every = "" if D == 1 else f"; the same on all {D} dp replicas"
    cmp = "bitwise (rtol 0)" if rtol == 0 else f"max rel diff (rtol {rtol:.0e}, {why})"
    record(bubble=[str(x) for x in bubble], bubble_formula=None if formula is None else str(formula),
           in_flight=run.in_flight, activation_peak=run.act_peak, boundary_bytes=want_p2p,
           dp_bytes=run.dp_bytes, chrome_trace=path, svg=pictures)  # fmt: skip
    say_verdict(fails, f"{a.schedule} p={p} m={m} v={v} dp={D} {a.dtype}, {a.steps} steps vs "
                  f"the {a.dtype} reference, {cmp}: loss {worst['loss']:.1e}, grad "
                  f"{worst['grad']:.1e}, param {worst['param']:.1e}; {bub}; in flight = formula; "
                  f"peak activation bytes (ledger) = per-chunk formula{cf}; boundary bytes = "
                  f"formula ({sum(want_p2p)} B/step, all p={p} stages){dpb}{every}")  # fmt: skip
    return 0 if not fails else 1


def cfg_item(cfg) -> int:
    return compute_dtype(cfg.dtype).itemsize


if __name__ == "__main__":
    sys.exit(run_example(main, ARGS, world_size=ARGS.pp * ARGS.dp))
