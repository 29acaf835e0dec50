"""One program for every layout: dp x pp x tp (+ SP), ZeRO 0-3 on dp, checked against the reference.

    python -m emulator run -n 8 examples/06_nd_mesh.py --dp 2 --pp 2 --tp 2 --zero 3 --sequence-parallel
    python -m emulator run -n 8 examples/06_nd_mesh.py --zero 1 --schedule interleaved --chunks 2
    mpiexec -n 8 python examples/06_nd_mesh.py --dp 2 --pp 2 --tp 2 --zero 2 --moe

parallel.train runs the Layout on every rank: the pipeline executor drives each stage's layers
through the rank's LayerContext (single-rank or Megatron TP/SP blocks), and DP / ZeRO act through
per-layer hooks on the rank's local (TP-sharded, stage-local) parameters. Checks, every rank:
loss of every step, every named gradient and the final parameters vs
emulator.reference.reference_train on the same global batch (float64, rtol 1e-12), for the
gathered model AND for the rank's own shards (replicas included); the bytes it sent in the last
step split by axis (ledger tags dp/, tp/, pp/, dp/clip) beside parallel/nd_cost.rank_bytes (each
axis's own formula on its share); its static memory by category (and ZeRO-2/3 peaks) beside the
formulas, and its peak activation bytes beside the pipeline's in-flight formula with TP/SP
units (parallel/nd_cost.rank_peak_activations). Prints the Layout, the mesh's groups, both tables and a VERDICT line; exits 1 on any
mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import emulator
import parallel
from emulator.check import compare, compare_run, verdict
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.reference import reference_train
from parallel import Layout, nd_cost
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard

p_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
for axis, default in (("dp", 2), ("pp", 2), ("tp", 2)):
    p_.add_argument(f"--{axis}", type=int, default=default, help=f"{axis} degree")
p_.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="0 = DDP")
p_.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
p_.add_argument("--chunks", type=int, default=1, help="v, for --schedule interleaved")
p_.add_argument("--microbatches", type=int, default=None, help="m per dp rank (default 2 pp)")
p_.add_argument("--sequence-parallel", action="store_true")
p_.add_argument("--recompute", default="none", choices=["none", "selective"])
p_.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next layer early")
p_.add_argument("--no-reshard", action="store_true", help="ZeRO-3: keep units forward->backward")
p_.add_argument("--moe", action="store_true", help="MoE blocks (E = K = 2: no discrete choice)")
p_.add_argument("--steps", type=int, default=2)
p_.add_argument("--max-norm", type=float, default=0.5, help="clip norm (0: no clipping)")
ARGS = p_.parse_args()
RTOL = 1e-12  # float64: the layouts sum in other orders (dp, tp partials, the clip norm)
HYPER = {"lr": 3e-3, "betas": (0.85, 0.95), "eps": 1e-7, "weight_decay": 0.05}


def setup():
    a = ARGS
    if a.schedule == "interleaved" and a.chunks < 2:
        a.chunks = 2
    m = a.microbatches or 2 * a.pp
    layout = Layout(dp=a.dp, pp=a.pp, tp=a.tp, zero=a.zero, sequence_parallel=a.sequence_parallel,
                    schedule=a.schedule, chunks=a.chunks, microbatches=m, recompute=a.recompute,
                    reshard_after_forward=not a.no_reshard, prefetch=a.prefetch)  # fmt: skip
    cfg = ModelConfig(vocab_size=32, max_seq_len=16, d_model=16, n_heads=4,
                      n_layers=max(2, a.pp * a.chunks), n_experts=2 if a.moe else 0,
                      moe_top_k=2, capacity_factor=2.0)  # fmt: skip
    B, S = 2 * a.dp * m, 8
    return layout, cfg, B, S, lambda step: synthetic_batch(5, step, B, S, cfg.vocab_size)


def main(comm) -> int:
    layout, cfg, B, S, batches = setup()
    clip = ARGS.max_norm or None
    run = parallel.train(comm, layout, cfg, batches, ARGS.steps, seed=0, max_norm=clip, **HYPER)
    ref = reference_train(cfg, 0, batches, ARGS.steps, microbatches=layout.dp * layout.microbatches,
                          max_norm=clip, **HYPER)  # fmt: skip
    worst, fails = compare_run(run, ref, RTOL)
    t, r = layout.tp, run.coords["tp"]
    plan = megatron_plan(cfg)
    for what, mine, full in (("param", run.local_params, ref.params),
                             ("grad", run.local_grads, ref.grads)):  # fmt: skip
        want = shard({n: full[n] for n in mine}, plan, r, t)
        fails += [f"own {what} shards: {x}" for x in compare(mine, want, RTOL, what)[1]]
    s = run.coords["pp"]
    bytes_want = nd_cost.rank_bytes(cfg, layout, B, S, run.coords)
    static = nd_cost.rank_static_memory(cfg, layout, s)
    peak = nd_cost.rank_peak_memory(cfg, layout, s)
    peak = {k: v for k, v in peak.items() if layout.zero >= 2}  # ZeRO-2/3: transient state
    if not (cfg.is_moe and layout.schedule == "zb-h1"):  # no formula for an MoE block's W stash
        peak["activations"] = nd_cost.rank_peak_activations(cfg, layout, B, S, s)
    got_static = {k: run.memory["current"][k] for k in static}
    got_peak = {k: run.memory["peak"][k] for k in peak}
    for what, got, want in (("bytes", run.step_bytes[-1], bytes_want),
                            ("static memory", got_static, static), ("peak memory", got_peak, peak)):  # fmt: skip
        fails += [f"{what} {k}: {got[k]} != formula {want[k]}" for k in want if got[k] != want[k]]
    h = hashlib.sha256(repr(run.losses).encode())  # every bit of the run: losses, own state
    for n in sorted(run.local_params):
        h.update(run.local_params[n].tobytes() + run.local_grads[n].tobytes())
    row = (comm.rank, run.coords, run.step_bytes[-1], bytes_want, got_static, static, got_peak,
           peak, [f"rank {comm.rank}: {f}" for f in fails], worst, h.hexdigest())  # fmt: skip
    rows = comm.allgather_object(row)  # uncounted: the report
    if comm.rank:
        return 0 if not fails else 1
    print(layout)
    print(run.mesh)
    axes = ("dp", "tp", "pp", "clip")
    print(format_table(["rank", "dp,pp,tp", *(f"{x} sent/formula" for x in axes), "total"],
                       [[g, f"{c['dp']},{c['pp']},{c['tp']}", *(f"{b[x]} / {w[x]}" for x in axes),
                         sum(b.values())] for g, c, b, w, *_ in rows]))  # fmt: skip
    cats = ("params", "grads", "optimizer")
    print(format_table(["rank", *(f"static {x} ledger/formula" for x in cats),
                        "peak [params; grads (ZeRO-2/3);] activations ledger/formula"],
                       [[g, *(f"{gs[x]} / {st[x]}" for x in cats),
                         "; ".join(f"{gp[x]} / {pk[x]}" for x in pk) or "-"]
                        for g, _, _, _, gs, st, gp, pk, *_ in rows]))  # fmt: skip
    every = [f for row in rows for f in row[8]]
    digest = hashlib.sha256("".join(row[10] for row in rows).encode()).hexdigest()[:16]
    print(f"digest of every rank's losses, parameters and gradients: {digest} (bitwise: the same "
          f"run to run and on either backend)")  # fmt: skip
    for f in every:
        print("MISMATCH:", f)
    w = {k: max(row[9][k] for row in rows) for k in ("loss", "grad", "param")}
    total = sum(sum(row[2].values()) for row in rows)
    print(verdict(every, f"{layout} on all {comm.world_size} ranks, {ARGS.steps} steps vs the "
                  f"reference (rtol {RTOL:.0e}): loss {w['loss']:.1e}, grad {w['grad']:.1e}, "
                  f"param {w['param']:.1e}, own shards too; bytes by axis = formula on every rank "
                  f"({total} B/step in all); static memory and peak activations = formula"))  # fmt: skip
    return 0 if not every else 1


if __name__ == "__main__":
    lay, c, b, s, _ = setup()  # refuse a layout that cannot run before any rank starts
    bad = lay.problems(lay.world, c, (b, s))
    if bad:
        p_.error(f"{lay} cannot run: " + "; ".join(bad))
    sys.exit(emulator.launch(main, world_size=lay.world))
