"""Expert parallelism: MoE experts split over an ep group, tokens moved by all-to-all(v), through
the one N-D training program (parallel.train, the ep slot of its Layout).

    python -m emulator run -n 4 examples/07_expert_parallel.py --ep 4 --experts 8 --top-k 2 \
        --capacity-factor 1.0 --dispatch exact
    mpiexec -n 8 python examples/07_expert_parallel.py --dp 2 --ep 4 --dispatch padded
    python -m emulator run -n 8 examples/07_expert_parallel.py --dp 2 --ep 2 --tp 2
    python -m emulator run -n 8 examples/07_expert_parallel.py --dp 2 --ep 2 --pp 2

Every data-parallel rank routes its own tokens (capacity per routing group, choice-major slots,
dropping); the ep group (neighbouring dp ranks) holds E / ep experts each (parallel/expert/);
--tp splits the non-expert layers Megatron-style (experts replicated over tp), --pp cuts the
blocks into 1F1B stages, each stage's MoE blocks over its own ep group. --dp is the
expert-data-parallel degree: Layout(dp = --dp x --ep, ep, tp, pp).
Printed per rank: the load table of every MoE layer of its stage (token copies routed to / kept
by / dropped by each expert, imbalance max/mean, the rows each local expert computed on), the
all-to-all bytes of every MoE layer and micro-batch forward and backward beside
parallel/expert/cost.py's formula from the ep group's routing counts (checked every step), the
gradient (dp + edp), tp and clip bytes beside their formulas, and static memory beside its
formula (peak activations too at tp = pp = 1); then the verdict against reference_train on the
same batch and routing groups in the same dtype (parallel/check/data.py: routing first, then
losses, gradients, parameters and Adam moments with its measured tolerances; float64 1e-12),
every rank's load table against a recount of the reference's routing, every rank's shards read
(edp replicas bitwise equal to the rank they mirror, tp replicas too).
"""

from __future__ import annotations

import sys

import numpy as np

import parallel
from collectives import cost as ccost
from emulator.check import compare_losses
from emulator.data import synthetic_batch
from emulator.flops import head_activation_bytes
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.precision import compute_dtype
from emulator.reference import reference_train
from parallel import Layout
from parallel.check.data import TOL, compare_dp
from parallel.check.routing import reference_routes
from parallel.expert import nd as nd_ep
from parallel.expert.cost import PHASES, ep_block_activation_bytes, layer_bytes
from parallel.expert.layer import check_ep
from parallel.expert.load import format_load, merge_loads, received, reference_load, same_load
from parallel.expert.train import (
    PER_TENSOR_MB,
    FullView,
    check_batch,
    full_state,
    moe_records,
    replica_problems,
    routing_of,
)
from parallel.tensor.block import megatron_plan
from tools import args as cli
from tools.run import progress, record, run_example, say_verdict

p = cli.parser(__doc__)
p.add_argument("--ep", type=cli.positive_int, default=4,
               help="expert-parallel group size (divides the data-parallel ranks)")  # fmt: skip
p.add_argument("--dp", type=cli.positive_int, default=None,
               help="expert-data-parallel degree: ranks / (ep tp pp)")  # fmt: skip
p.add_argument("--tp", type=cli.positive_int, default=1,
               help="tensor-parallel degree of the non-expert layers")  # fmt: skip
p.add_argument("--pp", type=cli.positive_int, default=1, help="pipeline stages (1F1B)")
p.add_argument("--experts", type=cli.positive_int, default=8, help="E")
p.add_argument("--top-k", type=cli.positive_int, default=2, help="K, experts per token")
p.add_argument("--capacity-factor", type=cli.positive_float, default=1.0)
p.add_argument("--dispatch", choices=["exact", "padded"], default="exact")
p.add_argument("--grad-sync", choices=["allreduce", "ddp"], default="allreduce",
               help="DDP over dp and over edp: one bucket per tensor, or 0.01 MB buckets")  # fmt: skip
p.add_argument("--dtype", choices=["float64", "float32", "mixed"], default="float64")
p.add_argument("--microbatches", type=cli.positive_int, default=2)
p.add_argument("--batch", type=cli.positive_int, default=None,
               help="global batch (default 2 x data-parallel ranks x k)")  # fmt: skip
cli.add_common(p, model={"vocab": 32, "seq": 8, "d_model": 16, "heads": 2, "layers": 2}, steps=3)
args = cli.parse(p)
inner = args.ep * args.tp * args.pp
# the world: --dp x --ep x --tp x --pp when --dp is given (checked against -n / mpiexec), else
# the job's size; the data-parallel ranks are world / (tp pp)
W_ = args.dp * inner if args.dp is not None else cli.planned_world_size(4)
if args.dp is not None:
    cli.check_world(p, W_, f"--dp {args.dp} x --ep {args.ep} x --tp {args.tp} x --pp {args.pp}")
if W_ % (args.tp * args.pp):
    p.error(f"argument --tp {args.tp} / --pp {args.pp}: tp x pp = {args.tp * args.pp} must "
            f"divide the {W_} ranks")  # fmt: skip
D_ = W_ // (args.tp * args.pp)  # data-parallel ranks (edp x ep)
if D_ % args.ep:
    p.error(f"argument --ep: ep={args.ep} must divide the {D_} data-parallel ranks; choose --ep "
            f"in {[d for d in range(1, D_ + 1) if D_ % d == 0]}")  # fmt: skip
if args.ep == 1:
    p.error("argument --ep: ep=1 splits no experts (the single-rank MoE block under DDP); "
            "examples/03_data_parallel.py --moe runs that")  # fmt: skip
try:
    check_ep(args.experts, args.ep, args.top_k)
except ValueError as e:
    p.error(f"argument --experts {args.experts} / --ep {args.ep} / --top-k {args.top_k}: {e}")
if args.layers < args.pp:
    p.error(f"argument --layers: {args.layers} blocks cannot fill {args.pp} stages; choose "
            f"--layers >= {args.pp}")  # fmt: skip
args.batch = args.batch or 2 * D_ * args.microbatches
try:
    check_batch(D_, args.batch, args.microbatches)
except ValueError as e:
    p.error(f"argument --batch {args.batch}: {e}; choose a multiple of "
            f"{D_ * args.microbatches}")  # fmt: skip
S = args.seq
TRAIN = {"lr": 1e-3, "max_norm": 1.0}
LAYOUT = Layout(dp=D_, ep=args.ep, tp=args.tp, pp=args.pp, microbatches=args.microbatches,
                dispatch=args.dispatch, dtype=args.dtype,
                bucket_cap_mb=PER_TENSOR_MB if args.grad_sync == "allreduce" else 0.01)  # fmt: skip
CFG = ModelConfig(**cli.model_kwargs(args), n_experts=args.experts, moe_top_k=args.top_k,
                  capacity_factor=args.capacity_factor, dtype=args.dtype)  # fmt: skip
_bad = LAYOUT.problems(W_, CFG, (args.batch, S))
if _bad:
    p.error(f"{LAYOUT} cannot run: " + "; ".join(_bad))


def batches(step):
    return synthetic_batch(args.seed, step, args.batch, S, CFG.vocab_size)


def _blocks(keys) -> list[str]:
    return sorted({layer for layer, _ in keys}, key=lambda n: int(n.split(".")[1]))


def rank_report(comm, run, recs, group_kept) -> tuple[list[str], list[str]]:
    """(lines, problems) of this rank: load tables, ep bytes per layer vs formula (every step),
    the other axes' bytes and memory vs formula."""
    lay, cfg, co, k = LAYOUT, CFG, run.coords, LAYOUT.microbatches
    E, H, c = cfg.n_experts, cfg.d_model, co["ep"]
    El, w = E // lay.ep, compute_dtype(cfg.dtype).itemsize  # the rows' itemsize
    bad, last, blocks = [], recs[-1], _blocks(recs[-1])
    head = (f"== rank {comm.rank} (dp {co['dp']} = edp {co['edp']} x ep {c}: experts "
            f"{c * El}..{(c + 1) * El - 1}; tp {co['tp']}, pp {co['pp']})")  # fmt: skip
    lines = [head]
    for b in blocks:
        rows_in = sum(received(last[(b, j)]["counts"]) for j in range(k))
        lines.append(f"{b} load, last step ({k} micro-batches, this rank's tokens):")
        lines.append(format_load(merge_loads([last[(b, j)]["load"] for j in range(k)]), c * El,
                                 rows_in))  # fmt: skip
    brows = []
    for s, st in enumerate(recs):
        for (b, j), rec in sorted(st.items(), key=lambda x: (x[0][1], int(x[0][0][7:]))):
            table = np.array([kept[s][(b, j)] for kept in group_kept])  # (P, E), ep order
            want = layer_bytes(lay.dispatch, table, rec["C"], H, w, c)
            if rec["bytes"] != want:
                bad.append(f"step {s} mb{j}.{b}: all-to-all bytes {rec['bytes']} != {want}")
            if s == len(recs) - 1:
                brows.append([f"mb{j}.{b}"] + [f"{rec['bytes'][ph][0]}+{rec['bytes'][ph][1]} / "
                                              f"{want[ph][0]}+{want[ph][1]}" for ph in PHASES])  # fmt: skip
    lines.append(f"all-to-all bytes sent+received per MoE layer, last step ({lay.dispatch}), "
                 "measured / formula:")  # fmt: skip
    lines.append(format_table(["layer", *PHASES], brows))
    shapes = {n: a.shape for n, a in run.local_params.items()}
    clip = sum(ccost.ring_all_reduce(1, n, 8, r)[0] for n, r in ((lay.ep, c), (lay.tp, co["tp"]),
               (lay.pp, co["pp"])) if n > 1)  # fmt: skip
    want = {"dp+edp": nd_ep.dp_bytes(cfg, lay, shapes), "clip": clip,
            "tp": nd_ep.tp_bytes(cfg, lay, args.batch, S, co)}  # fmt: skip
    for s, sb in enumerate(run.step_bytes):
        got = {"dp+edp": sb["dp"] + sb["edp"], "clip": sb["clip"], "tp": sb["tp"]}
        bad += [f"step {s} {a} bytes {got[a]} != formula {want[a]}" for a in want
                if got[a] != want[a]]  # fmt: skip
        bad += [f"step {s}: {sb['untagged']} B under no axis's tag"] if "untagged" in sb else []
    last_sb = run.step_bytes[-1]
    lines.append(f"bytes sent per step, last step / formula: dp {last_sb['dp']} + edp "
                 f"{last_sb['edp']} = " + ", ".join(f"{a} {got[a]} / {want[a]}" for a in want)
                 + f", pp {last_sb['pp']}")  # fmt: skip
    static = nd_ep.static_memory(cfg, lay, shapes)
    got_m = {cat: run.memory["current"][cat] for cat in static}
    bad += [
        f"static {x}: {got_m[x]} != formula {static[x]}" for x in static if got_m[x] != static[x]
    ]
    peak, note = run.memory["peak"]["activations"], "no formula with tp or pp > 1 here"
    if lay.tp == lay.pp == 1:  # one micro-batch alive: its ep blocks + the ids and head caches
        b_ = args.batch // (lay.dp * k)
        want_p = max(sum(ep_block_activation_bytes(cfg, b_, S, int(st[(b, j)]["counts"].sum()))
                         for b in blocks) for st in recs for j in range(k))  # fmt: skip
        want_p += head_activation_bytes(cfg, b_, S)
        note = f"formula {want_p} (the experts' share follows the rows they received)"
        bad += [f"peak activations {peak} != formula {want_p}"] * (peak != want_p)
    lines.append(f"static memory per rank: {got_m} / formula {static}; peak activations {peak} "
                 f"B / {note}")  # fmt: skip
    return lines, [f"rank {comm.rank}: {x}" for x in bad + run.replica_mismatch]


def main(comm) -> int:
    lay, cfg, k, steps = LAYOUT, CFG, LAYOUT.microbatches, args.steps
    if comm.size != W_:
        raise ValueError(f"the world has {comm.size} ranks, but the flags planned {W_}")
    mark = comm.ledger.mark()
    run = parallel.train(comm, lay, cfg, progress(batches, steps), steps, seed=args.seed, **TRAIN)
    recs = moe_records(run, comm.ledger.since(mark))
    kept = [{key: r["kept"] for key, r in st.items()} for st in recs]
    every = comm.allgather_object((run.coords, kept))  # uncounted: the formula's inputs
    mine = {a: run.coords[a] for a in ("edp", "pp", "tp")}
    group = sorted((co["ep"], kp) for co, kp in every if all(co[a] == v for a, v in mine.items()))
    lines, problems = rank_report(comm, run, recs, [kp for _, kp in group])
    slim = [{key: {"decisions": r["decisions"], "load": r["load"]} for key, r in st.items()}
            for st in recs]  # fmt: skip
    state = (run.coords, run.local_params, run.local_grads, run.local_opt, slim)
    gathered = comm.gather_object(("\n".join(lines), problems, state))
    if comm.rank != 0:
        return 0 if not problems else 1
    kw = {"microbatches": lay.dp * k, **TRAIN}
    ref = reference_train(cfg, args.seed, batches, steps, **kw)
    routing = reference_routes(cfg, args.seed, batches, steps, **kw)
    for text, _, _ in gathered:
        print(text)
    problems = [x for _, probs, _ in gathered for x in probs]
    states = [g[2] for g in gathered]
    for i, what in ((1, "param"), (2, "grad"), (3, "adam m")):
        get = (lambda st, i=i: st[i]) if i < 3 else (lambda st: st[3]["m"])
        problems += replica_problems([(st[0], get(st)) for st in states], what)
    plan = nd_ep.expert_plan(megatron_plan(cfg))
    full = {i: full_state([(st[0], st[i]) for st in states], plan) for i in (1, 2)}
    opt = {m: full_state([(st[0], st[3][m]) for st in states], plan) for m in ("m", "v")}
    view = FullView(run.losses, run.grad_norms, full[2], full[1], opt,
                    routing_of([(st[0], st[4]) for st in states], k, cfg.n_layers))  # fmt: skip
    _, probs, note = compare_dp(view, ref, cfg.dtype, routing, cfg.moe_top_k)
    problems += probs
    if cfg.dtype != "mixed":
        problems += compare_losses(view.grad_norms, ref.grad_norms, TOL[cfg.dtype]["rtol"])[1]
    # every rank's load table against a recount of the reference's routing (rank-independent:
    # emulator/moe.py's route inside the single-rank model); mixed may flip a near tie after
    # step 0 (compare_dp judges it), so there only step 0
    checked = 0
    for co, _, _, _, st_recs in states:
        for s, st in enumerate(st_recs[: 1 if cfg.dtype == "mixed" else None]):
            for (b, j), r in st.items():
                want = reference_load(routing[s][co["dp"] * k + j][int(b[7:])][0], cfg.n_experts)
                checked += 1
                if not same_load(r["load"], want):
                    problems.append(f"rank at {co} step {s} mb{j}.{b}: load table "
                                    f"{r['load']} != the reference's recount {want}")  # fmt: skip
    for line in problems[:8]:
        print("  MISMATCH:", line[:300])
    print(f"losses {[f'{x:.6f}' for x in ref.losses]} (reference), {lay}")
    record(losses=[float(x) for x in ref.losses], problems=problems[:8])
    say_verdict(problems, f"{lay}, E={cfg.n_experts} K={cfg.moe_top_k} cf={cfg.capacity_factor}"
                          f" {args.grad_sync}, {steps} steps, {comm.size} ranks: {note}; {checked}"
                          f" load tables = the reference's recount; ep / dp+edp / tp / clip bytes"
                          f" and static memory == formulas on every rank")  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(run_example(main, args, world_size=W_))
