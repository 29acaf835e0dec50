"""Data parallelism: DDP and ZeRO-1/2/3 (FSDP), checked against the single-rank reference.

    python -m emulator run -n 4 examples/03_data_parallel.py --stage 3
    mpiexec -n 4 python examples/03_data_parallel.py --stage ddp --dtype mixed --moe

Every rank trains on its slice of each global batch; the run is compared, by name, with
reference_train on the whole batch in the same precision (losses, gradients, parameters or their
updates, Adam m and v; tolerances measured, parallel/check/data.py; MoE routing first). Printed
beside the ZeRO paper's figures as numbers (Rajbhandari et al. 2020, sections 3.1 and 7): bytes
sent per rank per step (2, 2, 2, 3 Psi at k = 1, and the k-scaled count moved here), static
memory (16 Psi, 4 Psi + 12 Psi/D, 2 Psi + 14 Psi/D, 16 Psi/D in mixed), padding included; peak
memory per category beside its formula (parallel/data/cost.py); and the order the collectives
fired in: DDP buckets at their backward point (Li et al. 2020, section 3.2.3), ZeRO-3 gathers
with prefetch (Zhao et al. 2023, section 3.3.3).
"""

from __future__ import annotations

import sys

from emulator.check import compare_replicas
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig, n_params
from emulator.reference import reference_train
from parallel.check.data import compare_dp
from parallel.check.routing import reference_routes
from parallel.data.cost import (
    PAPER,
    PAPER_WIRE,
    paper_figures,
    peak_memory,
    static_memory,
    step_bytes,
    wire_elements,
)
from parallel.data.train import train_data_parallel
from tools import args as cli
from tools.run import progress, record, run_example, say_verdict

p = cli.parser(__doc__)
p.add_argument("--stage", choices=["ddp", "1", "2", "3"], default="ddp")
p.add_argument("--dtype", choices=["float64", "float32", "mixed"], default="float64")
p.add_argument("--moe", action="store_true", help="4 experts, top-2, in every block")
p.add_argument("--microbatches", type=cli.positive_int, default=2)
p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=0.01)
p.add_argument("--no-reshard", action="store_true", help="ZeRO-3: reshard_after_forward=False")
p.add_argument("--prefetch", action="store_true", help="ZeRO-3: forward/backward prefetch")
cli.add_common(p, model={"vocab": 32, "seq": 8, "d_model": 10, "heads": 2, "layers": 2}, batch=16,
               steps=3)  # fmt: skip
args = cli.parse(p)
for flag in ("--prefetch", "--no-reshard"):
    cli.refuse_unless(p, args, flag, False, args.stage == "3", "outside --stage 3 (ZeRO-3)")
D_ = cli.planned_world_size(4)
if args.batch % (D_ * args.microbatches):
    p.error(f"argument --batch: {args.batch} does not split into {D_} ranks x "
            f"{args.microbatches} micro-batches; use a multiple of {D_ * args.microbatches}")  # fmt: skip

MOE = {"n_experts": 4, "moe_top_k": 2} if args.moe else {}
CFG = ModelConfig(**cli.model_kwargs(args), dtype=args.dtype, **MOE)
S, TRAIN = args.seq, {"lr": 1e-3, "max_norm": 1.0}


def batches(step):
    return synthetic_batch(args.seed, step, args.batch, S, CFG.vocab_size)


def main(comm) -> int:
    st, D, k, reshard = args.stage, comm.size, args.microbatches, not args.no_reshard
    run = train_data_parallel(comm, CFG, args.seed, progress(batches, args.steps), args.steps, stage=st, microbatches=k,
                              bucket_cap_mb=args.bucket_cap_mb, reshard_after_forward=reshard,
                              prefetch=args.prefetch, **TRAIN)  # fmt: skip
    psi, pad = n_params(CFG), sum(lay.padded for lay in run.layouts)
    want_b = step_bytes(st, run.layouts, CFG.dtype, k, reshard)
    want_m = static_memory(st, run.layouts, psi, CFG.dtype)
    want_p = peak_memory(st, run.layouts, psi, CFG, args.batch // (D * k), S,
                         reshard_after_forward=reshard, prefetch=args.prefetch)  # fmt: skip
    fig = paper_figures(st, psi, pad, D, CFG.dtype, k, reshard)
    got_m = {c: run.memory["current"][c] for c in want_m}
    got_p = {c: run.memory["peak"][c] for c in want_p}
    sb = run.step_bytes[-1]
    row = [comm.rank, f"{run.losses[-1]:.6f}"]
    row += [f"{got_m[c]} / {want_m[c]}" for c in want_m]
    row += [f"{got_p[c]} / {want_p[c]}" for c in want_p]
    row += [f"{sb[w][0]}+{sb[w][1]} / {want_b[w]}+{want_b[w]}" for w in ("grads", "params")]
    ok = got_m == want_m and got_p == want_p and sum(got_m.values()) == fig["memory (Psi_pad)"]
    ok = ok and all(sb[w] == (want_b[w],) * 2 for w in want_b)
    ok = ok and sb["grads"][0] + sb["params"][0] == fig[f"bytes k={k} (Psi_pad)"]
    rows = comm.gather_object((row, ok))
    # every rank's replica, not rank 0's alone (uncounted): a rank that skipped a step shows
    replicas = comm.gather_object({"losses": run.losses, "grads": run.grads, "params": run.params})
    ref = routing = None
    if comm.rank == 0:
        ref = reference_train(CFG, args.seed, batches, args.steps, microbatches=D * k, **TRAIN)
        if CFG.is_moe:  # the routing of every reference micro-batch, to compare first
            routing = reference_routes(
                CFG, args.seed, batches, args.steps, microbatches=D * k, **TRAIN
            )
    if comm.rank != 0:
        return 0
    _, problems, checked = compare_dp(run, ref, CFG.dtype, routing, CFG.moe_top_k)
    problems += compare_replicas(replicas)
    checked += f"; losses, grads, params bitwise identical on {D}/{D} ranks"
    c = fig["c"]
    print(f"stage {st}, D={D}, {CFG.dtype}{' MoE' if CFG.is_moe else ''}, k={k} micro-batches, "
          f"{len(run.layouts)} flat buffers; Psi={psi}, Psi_pad={pad} "
          f"(padding {pad - psi} elements)")  # fmt: skip
    w1, wk = wire_elements(st, 1, reshard), wire_elements(st, k, reshard)
    print(f"bytes sent per rank per step, wire itemsize c={c}:\n"
          f"  paper {PAPER_WIRE[st] if reshard else '2 Psi'} x c x (D-1)/D at k=1: from Psi "
          f"{fig['bytes k=1 (Psi)']:.1f}, from Psi_pad {fig['bytes k=1 (Psi_pad)']}\n"
          f"  this run, k={k}: {wk} Psi_pad x c x (D-1)/D = {fig[f'bytes k={k} (Psi_pad)']} "
          f"(k=1 would be {w1} Psi_pad); measured on rank 0: "
          f"{sb['grads'][0] + sb['params'][0]}")  # fmt: skip
    print(f"static memory per rank (2c + K per parameter, c={c}, K={fig['K']}; the paper's "
          f"mixed-precision {PAPER[st]}):\n  from Psi {fig['memory (Psi)']:.1f}, as allocated "
          f"(padded) {fig['memory (Psi_pad)']:.0f}; measured on rank 0: "
          f"{sum(run.memory['current'][c] for c in want_m)}")  # fmt: skip
    b, act = args.batch // (D * k), want_p["activations"]
    peak_why = {"ddp": "static (nothing transient)", "1": "static (nothing transient)",
                "2": f"grads = shards {want_m['grads']} + one bucket's full gradient "
                     f"{want_p['grads'] - want_m['grads']} (max padded x c)",
                "3": f"params = shards + gathered root and block unit(s) "
                     f"{want_p['params'] - want_m['params']}, grads = shards + root and one block "
                     f"{want_p['grads'] - want_m['grads']}"}[st]  # fmt: skip
    print(f"peak memory: {peak_why}; activations = L x activation_bytes_per_block(b={b}, S={S}) "
          f"= {CFG.n_layers} x {act // CFG.n_layers} (one micro-batch live at a time)")  # fmt: skip
    what = {"ddp": "bucket all-reduce fired at", "1": "reduce-scatter / all-gather at the step",
            "2": "bucket reduce-scatter fired at", "3": "unit all-gather order"}[st]  # fmt: skip
    order = [t.removeprefix("dp/") for t in run.comm_order]
    if st == "3":  # gathers only, one micro-batch (the order repeats)
        order = [t.removeprefix("params/") for t in order if t.startswith("params/")]
    print(f"step 0, {what}: " + ", ".join(order))
    head = ["rank", "loss", *(f"{c} B" for c in want_m), *(f"peak {c}" for c in want_p),
            "grads sent+recv", "params sent+recv"]  # fmt: skip
    print(format_table(head, [r for r, _ in rows]))
    bad_ranks = [i for i, (_, good) in enumerate(rows) if not good]
    if bad_ranks:
        problems.append(f"bytes or memory differ from the formulas on ranks {bad_ranks}")
    for line in problems[:8]:
        print("  MISMATCH:", line[:300])
    if len(problems) > 8:
        print(f"  ... and {len(problems) - 8} more mismatches")
    sent = want_b["grads"] + want_b["params"]
    record(step_bytes_sent_per_rank=sent, static_memory=want_m, peak_memory=want_p,
           losses=[float(x) for x in run.losses])  # fmt: skip
    say_verdict(problems, f"stage {st} D={D} {CFG.dtype}{' MoE' if CFG.is_moe else ''}, "
                            f"{args.steps} steps: {checked}; bytes ({sent} B/step sent per rank)"
                            f", static and peak memory == formulas on {D}/{D} ranks")  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(run_example(main, args, world_size=4))
