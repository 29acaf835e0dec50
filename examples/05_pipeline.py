"""Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and ZB-H1, checked against the reference.

    python -m emulator run -n 4 examples/05_pipeline.py --pp 4 --microbatches 8 --schedule 1f1b
    python -m emulator run -n 4 examples/05_pipeline.py --schedule interleaved --chunks 2
    python -m emulator run -n 4 examples/05_pipeline.py --pp 2 --dp 2 --dp-mode zero1
    mpiexec -n 4 python examples/05_pipeline.py --pp 4 --microbatches 8 --schedule zb-h1

The L blocks are split into p stages (v chunks each when interleaved), the batch into m
micro-batches; each stage runs its schedule's action list and sends one (b, S, H) activation
forward and its gradient backward per boundary crossing. Checks: loss, every gradient and
parameter vs emulator.reference.reference_train (1e-12); the bubble of the executed schedule
replayed under unit costs beside its closed form; peak micro-batches in flight and peak
activation bytes (memory ledger) per stage beside their formulas; boundary bytes per stage beside
their formula. Prints the ASCII timeline and writes a Chrome trace (open it in ui.perfetto.dev).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import emulator
from emulator.check import compare_run, verdict
from emulator.data import synthetic_batch
from emulator.flops import activation_bytes_per_block, head_activation_bytes
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.precision import compute_dtype
from emulator.reference import reference_train
from emulator.trace import ascii_timeline, write_chrome_trace
from parallel.bubble import Cost, bubble_formula, in_flight_formula, measured_bubble, replay
from parallel.pipeline_train import pipeline_train

p_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p_.add_argument("--pp", type=int, default=4, help="pipeline stages p")
p_.add_argument("--dp", type=int, default=1, help="data-parallel replicas (mesh dp x pp)")
p_.add_argument("--dp-mode", default="ddp", choices=["ddp", "zero1"])
p_.add_argument("--microbatches", type=int, default=8, help="m per data-parallel replica")
p_.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
p_.add_argument("--chunks", type=int, default=2, help="v, for --schedule interleaved")
p_.add_argument("--steps", type=int, default=3)
p_.add_argument("--trace", default=None, help="Chrome trace path (default: the temp dir)")
ARGS = p_.parse_args()


def main(comm) -> int:
    a = ARGS
    v = a.chunks if a.schedule == "interleaved" else 1
    if comm.world_size != a.pp * a.dp:
        raise ValueError(f"--pp {a.pp} x --dp {a.dp} needs {a.pp * a.dp} ranks, got {comm.world_size}")  # fmt: skip
    cfg = ModelConfig(vocab_size=32, max_seq_len=16, d_model=16, n_heads=2, n_layers=2 * a.pp * v)
    b, S, m, D = 2, 8, a.microbatches, a.dp
    batches = lambda step: synthetic_batch(5, step, b * m * D, S, cfg.vocab_size)
    where = emulator.Mesh(comm, dp=D, pp=a.pp) if D > 1 else comm
    run = pipeline_train(where, cfg, 0, batches, a.steps, schedule=a.schedule, microbatches=m,
                         chunks=v, dp_mode=a.dp_mode if D > 1 else "none", max_norm=1.0)  # fmt: skip
    if comm.rank:
        return 0
    ref = reference_train(cfg, 0, batches, a.steps, microbatches=m * D, max_norm=1.0)
    worst, problems = compare_run(run, ref, rtol=1e-12)
    sched, p, fails = run.schedule, a.pp, list(problems)

    # bubble: the executed per-stage orders replayed with F = B = W = 1 (B+W for unsplit)
    events = replay(sched, Cost(1, 1, 1), msg_bytes=b * S * cfg.d_model * 8)
    bubble, formula = measured_bubble(sched, Cost(1, 1, 1)), bubble_formula(sched, Cost(1, 1, 1))
    fails += [f"stage {s} bubble {x} != {formula}" for s, x in enumerate(bubble) if x != formula]
    # in flight, activation bytes, boundary bytes (per step) beside their formulas
    want_live = in_flight_formula(sched)
    item = compute_dtype(cfg.dtype).itemsize
    msg = b * S * cfg.d_model * item  # one (b, S, H) activation or gradient
    rows = []
    for s in range(p):
        fwd, bwd = m * v - m * (s == p - 1), m * v - m * (s == 0)  # boundary crossings
        want_bytes = (fwd + bwd) * msg
        unit = len(run.split[s]) * activation_bytes_per_block(cfg, b, S) + 8 * b * S * (s == 0)
        unit += (head_activation_bytes(cfg, b, S) - 8 * b * S) * (s == p - 1)
        want_act = unit * want_live[s] if a.schedule in ("gpipe", "1f1b") else None
        got = run.p2p[s]
        if got != {"sent": want_bytes, "recv": want_bytes}:
            fails.append(f"stage {s} boundary bytes {got} != {want_bytes} each way")
        if run.in_flight[s] != want_live[s]:
            fails.append(f"stage {s} in flight {run.in_flight[s]} != {want_live[s]}")
        if want_act is not None and run.act_peak[s] != want_act:
            fails.append(f"stage {s} peak activations {run.act_peak[s]} != {want_act}")
        blocks = [i for u in range(s, p * v, p) for i in run.split[u]]
        rows.append([s, f"{blocks[0]}..{blocks[-1]}" if v == 1 else str(blocks),
                     f"{float(bubble[s]):.4f} / {float(formula):.4f}",
                     f"{run.in_flight[s]} / {want_live[s]}",
                     f"{run.act_peak[s]} / {want_act if want_act is not None else '-'}",
                     f"{got['sent']} / {want_bytes}"])  # fmt: skip
    path = a.trace or os.path.join(tempfile.gettempdir(), f"05_pipeline_{a.schedule}.json")
    write_chrome_trace(path, events)

    print(f"{a.schedule}: p={p} m={m} v={v} dp={D} b={b} S={S} H={cfg.d_model} L={cfg.n_layers}")
    print(ascii_timeline(events, p))
    print(format_table(["stage", "blocks", "bubble meas/formula", "in flight meas/formula",
                        "peak act bytes meas/formula", "p2p sent/formula per step"], rows))  # fmt: skip
    print(f"Chrome trace: {path}")
    for f in fails:
        print("MISMATCH:", f)
    sent = sum(x["sent"] for x in run.p2p)
    print(verdict(fails, f"{a.schedule} p={p} m={m} v={v} dp={D}, {a.steps} steps: max rel diff "
                  f"vs reference (rtol 1e-12) loss {worst['loss']:.1e}, grad {worst['grad']:.1e}, "
                  f"param {worst['param']:.1e}; bubble {float(formula):.4f} = formula; in-flight, "
                  f"activation and boundary bytes ({sent} B/step sent over {p} stages) match"))  # fmt: skip
    return 0 if not fails else 1


if __name__ == "__main__":
    sys.exit(emulator.launch(main, world_size=ARGS.pp * ARGS.dp))
