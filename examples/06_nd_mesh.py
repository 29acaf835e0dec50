"""One program for every layout: dp x pp x tp (+ SP), ZeRO 0-3 on dp, checked against the reference.

    python -m emulator run -n 8 examples/06_nd_mesh.py --dp 2 --pp 2 --tp 2 --zero 3 --sequence-parallel
    python -m emulator run -n 8 examples/06_nd_mesh.py --zero 1 --schedule interleaved --chunks 2
    mpiexec -n 8 python examples/06_nd_mesh.py --dp 2 --pp 2 --tp 2 --zero 2 --moe
    python -m emulator run -n 8 examples/06_nd_mesh.py --dp 4 --ep 2 --tp 1 --zero 3
    python -m emulator run -n 8 examples/06_nd_mesh.py --dp 2 --ep 2 --cp 2 --tp 1 --zero 1
    python -m emulator run -n 8 examples/06_nd_mesh.py --svg nd.svg --json nd.json --seed 1

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
--ep P (expert parallelism, MoE with E = 2 P experts, K = 2, capacity factor 1: tokens drop)
and --cp C (context parallelism, ring attention; each cp rank's tokens one routing group, the
reference given the same groups) compose with every other flag; their rows add the ep / edp / cp
axes (parallel/expert/nd.py rank_bytes and ep_step_bytes from the ep group's routing counts,
static_memory, peak_memory); the peak activations of ep / cp runs are not printed (no formula
for them yet).
--svg PATH writes the pipeline timeline (the executed per-stage orders replayed under unit costs)
to PATH and the per-axis communication matrix (bytes each rank sent to each rank, from the
ledger) to PATH with -comm.svg; --json PATH every rank's ledger totals and memory and the verdict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys

import parallel
from emulator import svg
from emulator.check import compare, compare_run
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.precision import compute_dtype
from emulator.reference import reference_train
from parallel import Layout, nd_cost
from parallel.context.layout import table
from parallel.context.train import routing_groups
from parallel.expert import nd as nd_ep
from parallel.pipeline.bubble import Cost, replay
from parallel.pipeline.schedules import Schedule, make_schedule
from parallel.tensor.block import megatron_plan
from parallel.tensor.shard import shard
from tools import args as cli
from tools.run import progress, rank_report, record, run_example, say_verdict

p_ = cli.parser(__doc__)
for axis, default in (("dp", 2), ("pp", 2), ("tp", 2), ("ep", 1), ("cp", 1)):
    p_.add_argument(f"--{axis}", type=cli.positive_int, default=default, help=f"{axis} degree")
p_.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="0 = DDP")
p_.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb-h1"])
p_.add_argument("--chunks", type=cli.positive_int, default=None,
                help="v, for --schedule interleaved (default 2)")  # fmt: skip
p_.add_argument("--microbatches", type=cli.positive_int, default=None,
                help="m per dp rank (default 2 pp)")  # fmt: skip
p_.add_argument("--sequence-parallel", action="store_true", help="SP on the tp group (tp > 1)")
p_.add_argument("--recompute", default="none", choices=["none", "selective"])
p_.add_argument("--prefetch", action="store_true", help="ZeRO-3: gather the next layer early")
p_.add_argument("--no-reshard", action="store_true", help="ZeRO-3: keep units forward->backward")
p_.add_argument("--moe", action="store_true", help="MoE blocks (E = K = 2: no discrete choice)")
p_.add_argument("--max-norm", type=cli.nonneg_float, default=0.5, help="clip norm (0: no clip)")
p_.add_argument("--svg", default=None, metavar="PATH",
                help="write the pipeline timeline (PATH) and the per-axis comm matrix (PATH with "
                     "-comm.svg)")  # fmt: skip
p_.add_argument("--layers", type=cli.positive_int, default=None,
                help="model L (default max(2, pp v))")  # fmt: skip
p_.add_argument("--batch", type=cli.positive_int, default=None,
                help="global batch B, a multiple of dp m (default 2 dp m)")  # fmt: skip
cli.add_common(p_, model={"vocab": 32, "seq": 8, "d_model": 16, "heads": 4}, steps=2)
ARGS = cli.parse(p_)
for _flag in ("--prefetch", "--no-reshard"):
    cli.refuse_unless(
        p_, ARGS, _flag, False, ARGS.zero == 3, f"with --zero {ARGS.zero} (ZeRO-3 only)"
    )
cli.refuse_unless(p_, ARGS, "--chunks", None, ARGS.schedule == "interleaved",
                  f"with --schedule {ARGS.schedule} (only interleaved has chunks)")  # fmt: skip
cli.refuse_unless(p_, ARGS, "--sequence-parallel", False, ARGS.tp > 1,
                  "with --tp 1 (SP cuts the sequence over the tp group)")  # fmt: skip
ARGS.chunks = (ARGS.chunks or 2) if ARGS.schedule == "interleaved" else 1
ARGS.microbatches = ARGS.microbatches or 2 * ARGS.pp
_pieces = ARGS.pp * ARGS.chunks
ARGS.layers = ARGS.layers or max(2, _pieces)
if ARGS.layers < _pieces:
    p_.error(f"argument --layers: {ARGS.layers} blocks cannot fill {_pieces} stage chunks; "
             f"need --layers >= {_pieces}")  # fmt: skip
ARGS.batch = ARGS.batch or 2 * ARGS.dp * ARGS.microbatches
if ARGS.batch % (ARGS.dp * ARGS.microbatches):
    _dm = ARGS.dp * ARGS.microbatches
    p_.error(f"argument --batch: {ARGS.batch} is not a multiple of --dp {ARGS.dp} x "
             f"--microbatches {ARGS.microbatches} = {_dm}; choose --batch {_dm * max(1, ARGS.batch // _dm)}")  # fmt: skip
RTOL = 1e-12  # float64: the layouts sum in other orders (dp, tp partials, the clip norm)
HYPER = {"lr": 3e-3, "betas": (0.85, 0.95), "eps": 1e-7, "weight_decay": 0.05}


def setup():
    a = ARGS
    layout = Layout(dp=a.dp, pp=a.pp, tp=a.tp, ep=a.ep, cp=a.cp, zero=a.zero,
                    sequence_parallel=a.sequence_parallel,
                    schedule=a.schedule, chunks=a.chunks, microbatches=a.microbatches,
                    recompute=a.recompute, reshard_after_forward=not a.no_reshard,
                    prefetch=a.prefetch)  # fmt: skip
    E = 2 * a.ep if a.ep > 1 else 2 if a.moe else 0  # ep: E = 2 P, top-2 of them, drops
    cfg = ModelConfig(vocab_size=a.vocab, max_seq_len=max(16, a.seq), d_model=a.d_model,
                      n_heads=a.heads, n_layers=a.layers, n_experts=E, moe_top_k=2,
                      capacity_factor=2.0 if a.ep == 1 else 1.0)  # fmt: skip
    B, S = a.batch, a.seq
    return layout, cfg, B, S, lambda step: synthetic_batch(5 + a.seed, step, B, S, cfg.vocab_size)


def main(comm) -> int:
    layout, cfg, B, S, batches = setup()
    clip = ARGS.max_norm or None
    run = parallel.train(comm, layout, cfg, progress(batches, ARGS.steps), ARGS.steps,
                         seed=ARGS.seed, max_norm=clip, **HYPER)  # fmt: skip
    tab = table(S, layout.cp, layout.cp_balance)  # cp: each cp rank's tokens, one group
    groups = (
        (lambda step, j, b, s: routing_groups(b, s, tab)) if cfg.is_moe and ARGS.cp > 1 else None
    )
    ref = reference_train(cfg, ARGS.seed, batches, ARGS.steps, groups_fn=groups,
                          microbatches=layout.dp * layout.microbatches, max_norm=clip, **HYPER)  # fmt: skip
    worst, fails = compare_run(run, ref, RTOL)
    fails += [f"replicas differ: {x}" for x in run.replica_mismatch]
    t, r, P, El = layout.tp, run.coords["tp"], layout.ep, cfg.n_experts // layout.ep
    plan = nd_ep.expert_plan(megatron_plan(cfg)) if P > 1 else megatron_plan(cfg)
    for what, mine, full in (("param", run.local_params, ref.params),
                             ("grad", run.local_grads, ref.grads)):  # fmt: skip
        if P > 1:  # this ep rank's E / P experts
            full = nd_ep.shard_experts({n: full[n] for n in mine}, run.coords["ep"], El)
        want = shard({n: full[n] for n in mine}, plan, r, t)
        fails += [f"own {what} shards: {x}" for x in compare(mine, want, RTOL, what)[1]]
    s = run.coords["pp"]
    if P > 1:  # parallel/expert/nd.py: two parts, the all-to-alls from the ep group's counts
        shapes = nd_ep.local_shapes(cfg, layout, s)  # from the config alone
        bytes_want = nd_ep.rank_bytes(cfg, layout, B, S, run.coords, shapes)
        key = tuple(run.coords[x] for x in ("edp", "pp", "cp", "tp"))
        mine = comm.allgather_object((key, run.coords["ep"], run.ep_counts[-1]))  # uncounted
        group = [c for k, _, c in sorted(x for x in mine if x[0] == key)]  # ep order
        bytes_want["ep"] = nd_ep.ep_step_bytes(layout.dispatch, group, run.coords["ep"], cfg.d_model,
                                               compute_dtype(cfg.dtype).itemsize)  # fmt: skip
        static = nd_ep.static_memory(cfg, layout, shapes)
        peak = nd_ep.peak_memory(cfg, layout, shapes, s) if layout.zero >= 2 else {}
    else:
        bytes_want = nd_cost.rank_bytes(cfg, layout, B, S, run.coords)
        static = nd_cost.rank_static_memory(cfg, layout, s)
        peak = nd_cost.rank_peak_memory(cfg, layout, s)
        peak = {k: v for k, v in peak.items() if layout.zero >= 2 and layout.cp == 1}  # ZeRO-2/3
    if not (cfg.is_moe and layout.schedule == "zb-h1") and P == layout.cp == 1:  # MoE W stash
        peak["activations"] = nd_cost.rank_peak_activations(cfg, layout, B, S, s)
    got_static = {k: run.memory["current"][k] for k in static}
    got_peak = {k: run.memory["peak"][k] for k in peak}
    for what, got, want in (("bytes", run.step_bytes[-1], bytes_want),
                            ("static memory", got_static, static), ("peak memory", got_peak, peak)):  # fmt: skip
        fails += [f"{what} {k}: {got[k]} != formula {want[k]}" for k in want if got[k] != want[k]]
    h = hashlib.sha256(repr(run.losses).encode())  # every bit of the run: losses, own state
    for n in sorted(run.local_params):
        h.update(run.local_params[n].tobytes() + run.local_grads[n].tobytes())
    want_order = make_schedule(layout.schedule, layout.pp, layout.microbatches, layout.chunks)
    if run.executed != want_order.stages[s]:
        fails.append(f"stage {s} ran {' '.join(map(str, run.executed))}, not the schedule's order")
    row = (comm.rank, run.coords, run.step_bytes[-1], bytes_want, got_static, static, got_peak,
           peak, [f"rank {comm.rank}: {f}" for f in fails], worst, h.hexdigest(), run.executed)  # fmt: skip
    rows = comm.allgather_object(row)  # uncounted: the report
    sent_to = comm.allgather_object(rank_report(comm)["sent_to"]) if ARGS.svg else None
    if comm.rank:
        return 0 if not fails else 1
    print(layout)
    print(run.mesh)
    axes = ("dp", "tp", "pp", "clip") + ("ep", "edp") * (layout.ep > 1) + ("cp",) * (layout.cp > 1)
    print(format_table(["rank", "dp,pp,cp,tp", *(f"{x} sent/formula" for x in axes), "total"],
                       [[g, f"{c['dp']},{c['pp']},{c['cp']},{c['tp']}",
                         *(f"{b[x]} / {w[x]}" for x in axes), sum(b.values())]
                        for g, c, b, w, *_ in rows]))  # fmt: skip
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
    peaks = "".join(f" and peak {w}" for w, k in (("params / grads", "params"),
                    ("activations", "activations")) if k in rows[0][7])  # fmt: skip
    pictures = pictures_of(rows, sent_to, want_order, layout) if ARGS.svg else []
    for pic in pictures:
        print(f"SVG: {pic}")
    record(step_bytes_sent=[row[2] for row in rows], step_bytes_formula=[row[3] for row in rows],
           static_memory_formula=[row[5] for row in rows], peak_memory_formula=[row[7] for row in rows],
           digest=digest, svg=pictures)  # fmt: skip
    say_verdict(every, f"{layout} on all {comm.world_size} ranks, {ARGS.steps} steps vs the "
                  f"reference (rtol {RTOL:.0e}): loss {w['loss']:.1e}, grad {w['grad']:.1e}, "
                  f"param {w['param']:.1e}, own shards too; bytes by axis = formula on every rank "
                  f"({total} B/step in all); static memory{peaks} = formula")  # fmt: skip
    return 0 if not every else 1


def pictures_of(rows, sent_to, sched: Schedule, layout) -> list[str]:
    """The timeline of the executed per-stage orders (the dp = tp = 0 rank of each pp stage)
    replayed under unit costs, and the per-axis comm matrix of every rank's sent bytes."""
    ran = {row[1]["pp"]: row[11] for row in rows if row[1]["dp"] == row[1]["tp"] == 0}
    executed = dataclasses.replace(sched, stages=[ran[s] for s in range(sched.p)])
    title = (
        f"{layout.schedule}: p={sched.p} m={sched.m} v={sched.v} (dp={layout.dp}, tp={layout.tp})"
    )
    base = ARGS.svg.removesuffix(".svg")
    return [svg.write(ARGS.svg, svg.timeline_svg(replay(executed, Cost(1, 1, 1)), sched.p,
                                                  title=title)),
            svg.write(base + "-comm.svg", svg.comm_matrix_svg(sent_to, title=f"{layout}: bytes "
                      "sent, row rank -> column rank, per axis"))]  # fmt: skip


if __name__ == "__main__":
    lay, c, b, s, _ = setup()  # refuse a layout that cannot run before any rank starts
    bad = lay.problems(lay.world, c, (b, s))
    if bad:
        p_.error(f"{lay} cannot run: " + "; ".join(bad))
    cli.check_world(p_, lay.world, f"--dp {lay.dp} x --pp {lay.pp} x --cp {lay.cp} x --tp {lay.tp}")
    sys.exit(run_example(main, ARGS, world_size=lay.world))
