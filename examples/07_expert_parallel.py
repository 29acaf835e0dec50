"""Expert parallelism: MoE experts split over an ep group, tokens moved by all-to-all(v).

    python -m emulator run -n 4 examples/07_expert_parallel.py --ep 4 --experts 8 --top-k 2 \
        --capacity-factor 1.0 --dispatch exact
    mpiexec -n 8 python examples/07_expert_parallel.py --dp 2 --ep 4 --dispatch padded

Every rank is data-parallel and routes its own tokens (capacity per routing group, choice-major
slots, dropping); the ep group (neighbouring ranks) holds E / ep experts each (parallel/expert/).
Printed per rank: the load table of every MoE layer (token copies routed to / kept by / dropped by
each expert, imbalance max/mean, the rows each local expert computed on), the all-to-all bytes of
every MoE layer forward and backward beside parallel/expert/cost.py's formula from the routing
counts, and the static memory beside its formula; then the verdict against reference_train on the
same batch and routing groups in the same dtype (parallel/check/data.py: routing first, then
losses, gradients, parameters and Adam moments with its measured tolerances; float64 1e-12;
every edp replica bitwise equal to the ep rank it mirrors).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from emulator.check import compare_losses
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig, param_shapes
from emulator.precision import compute_dtype, master_dtype
from emulator.reference import reference_train
from parallel.check.data import TOL, compare_dp
from parallel.check.routing import reference_routes
from parallel.data.cost import step_bytes as ddp_step_bytes
from parallel.expert.cost import PHASES, ep_block_activation_bytes, layer_bytes
from parallel.expert.layer import check_ep
from parallel.expert.load import format_load, load_table, received
from parallel.expert.train import assemble, check_batch, ep_train, is_expert
from tools import args as cli
from tools.run import progress, record, run_example, say_verdict

p = cli.parser(__doc__)
p.add_argument("--ep", type=cli.positive_int, default=4,
               help="expert-parallel group size (divides the ranks)")  # fmt: skip
p.add_argument("--dp", type=cli.positive_int, default=None,
               help="expert-data-parallel degree: ranks / ep")  # fmt: skip
p.add_argument("--experts", type=cli.positive_int, default=8, help="E")
p.add_argument("--top-k", type=cli.positive_int, default=2, help="K, experts per token")
p.add_argument("--capacity-factor", type=cli.positive_float, default=1.0)
p.add_argument("--dispatch", choices=["exact", "padded"], default="exact")
p.add_argument("--grad-sync", choices=["allreduce", "ddp"], default="allreduce",
               help="per-tensor all-reduce, or DDP buckets over dp and over edp")  # fmt: skip
p.add_argument("--dtype", choices=["float64", "float32", "mixed"], default="float64")
p.add_argument("--microbatches", type=cli.positive_int, default=2)
p.add_argument("--batch", type=cli.positive_int, default=None,
               help="global batch (default 2 x ranks x k)")  # fmt: skip
cli.add_common(p, model={"vocab": 32, "seq": 8, "d_model": 16, "heads": 2, "layers": 2}, steps=3)
args = cli.parse(p)
# the world: --dp x --ep when --dp is given (checked against -n / mpiexec), else the job's size
D_ = args.dp * args.ep if args.dp is not None else cli.planned_world_size(4)
if args.dp is not None:
    cli.check_world(p, D_, f"--dp {args.dp} x --ep {args.ep}")
if D_ % args.ep:
    p.error(f"argument --ep: ep={args.ep} must divide the {D_} data-parallel ranks; choose --ep "
            f"in {[d for d in range(1, D_ + 1) if D_ % d == 0]}")  # fmt: skip
try:
    check_ep(args.experts, args.ep, args.top_k)
except ValueError as e:
    p.error(f"argument --experts {args.experts} / --ep {args.ep} / --top-k {args.top_k}: {e}")
args.batch = args.batch or 2 * D_ * args.microbatches
try:
    check_batch(D_, args.batch, args.microbatches)
except ValueError as e:
    p.error(f"argument --batch {args.batch}: {e}; choose a multiple of "
            f"{D_ * args.microbatches}")  # fmt: skip

S = args.seq
TRAIN = {"lr": 1e-3, "max_norm": 1.0}


def main(comm) -> int:
    D, ep, k = comm.size, args.ep, args.microbatches
    if D != D_:
        raise ValueError(f"the world has {D} ranks, but the flags planned {D_}")
    cfg = ModelConfig(**cli.model_kwargs(args), n_experts=args.experts, moe_top_k=args.top_k,
                      capacity_factor=args.capacity_factor, dtype=args.dtype)  # fmt: skip
    B = args.batch

    def batches(step):
        return synthetic_batch(args.seed, step, B, S, cfg.vocab_size)

    run = ep_train(comm, cfg, args.seed, progress(batches, args.steps), args.steps, ep=ep, microbatches=k,
                   dispatch=args.dispatch, grad_sync=args.grad_sync, bucket_cap_mb=0.01,
                   **TRAIN)  # fmt: skip
    last = run.moe[-1]  # [micro-batch][layer] of the last step
    E, El, H, c = cfg.n_experts, run.n_local, cfg.d_model, run.ep_rank
    w = compute_dtype(cfg.dtype).itemsize  # the activations' (rows') itemsize
    kept = [[load_table(lay["routes"], E)["kept"] for lay in mb] for mb in last]
    every = comm.allgather_object(kept)  # uncounted: the formula's inputs from every rank
    base = comm.rank - c  # world rank of this ep group's coordinate 0
    lines, ok = (
        [f"== rank {comm.rank} (ep coordinate {c}: experts {c * El}..{(c + 1) * El - 1})"],
        True,
    )
    for i in range(cfg.n_layers):
        routes = [r for mb in last for r in mb[i]["routes"]]
        rows_in = sum(received(mb[i]["counts"]) for mb in last)
        lines.append(f"blocks.{i} load, last step ({k} micro-batches, this rank's tokens):")
        lines.append(format_load(load_table(routes, E), c * El, rows_in))
    brows = []
    for j, mb in enumerate(last):
        for i, lay in enumerate(mb):
            table = np.array([every[base + q][j][i] for q in range(ep)])
            C = sum(r["C"] for r in lay["routes"])
            want = layer_bytes(args.dispatch, table, C, H, w, c)
            ok = ok and lay["bytes"] == want
            brows.append([f"mb{j}.blocks.{i}"] + [f"{lay['bytes'][ph][0]}+{lay['bytes'][ph][1]} / "
                                                 f"{want[ph][0]}+{want[ph][1]}" for ph in PHASES])  # fmt: skip
    lines.append(f"all-to-all bytes sent+received per MoE layer, last step ({args.dispatch}), "
                 "measured / formula:")  # fmt: skip
    lines.append(format_table(["layer", *PHASES], brows))
    shapes = param_shapes(cfg)
    n_local = sum(int(np.prod(s)) // (ep if is_expert(n) else 1) for n, s in shapes.items())
    m_, c_ = master_dtype(cfg.dtype).itemsize, w
    grads_b = n_local * c_  # allreduce: the accumulated gradient; ddp: both engines' buckets
    if args.grad_sync == "ddp":
        grads_b = c_ * sum(lay.padded for lays in run.layouts.values() for lay in lays)
        want_g = {g: ddp_step_bytes("ddp", run.layouts[e], cfg.dtype, k)["grads"]
                  for g, e in (("dp", "dense"), ("edp", "experts"))}  # fmt: skip
        ok = ok and all(sb == {g: (b_, b_) for g, b_ in want_g.items()} for sb in run.step_bytes)
        lines.append(f"gradient bytes per step (sent+received): dp {run.step_bytes[-1]['dp']}, "
                     f"edp {run.step_bytes[-1]['edp']} / DDP formula 2 (G-1)/G padded c: "
                     f"{want_g}")  # fmt: skip
    static = {"params": n_local * (m_ + (c_ if cfg.dtype == "mixed" else 0)),
              "grads": grads_b, "optimizer": 2 * n_local * m_}  # fmt: skip
    got = {cat: run.memory["current"][cat] for cat in static}
    b = B // (D * k)
    peak = max(sum(ep_block_activation_bytes(cfg, b, S, int(lay["counts"].sum())) for lay in mb)
               for st in run.moe for mb in st)  # fmt: skip
    ok = ok and got == static and run.memory["peak"]["activations"] == peak
    lines.append(f"static memory per rank: {got} / formula {static} from Psi_local = {n_local} "
                 f"(replicated + experts / ep); peak activations "
                 f"{run.memory['peak']['activations']} / formula {peak} B (L blocks of one "
                 f"micro-batch; the experts' share follows the rows they received)")  # fmt: skip
    slim = [[[{"decisions": lay["decisions"]} for lay in mb] for mb in st] for st in run.moe]
    gathered = comm.gather_object(("\n".join(lines), ok, dataclasses.replace(run, moe=slim)))
    if comm.rank != 0:
        return 0
    kw = {"microbatches": D * k, **TRAIN}
    ref = reference_train(cfg, args.seed, batches, args.steps, **kw)
    routing = reference_routes(cfg, args.seed, batches, args.steps, **kw)
    problems = [f"rank {r}: bytes or memory differ from the formulas"
                for r, (_, good, _) in enumerate(gathered) if not good]  # fmt: skip
    for text, _, _ in gathered:
        print(text)
    try:  # every edp replica must hold its ep twin's bits; then ranks 0..ep-1 make the model
        view = assemble([g[2] for g in gathered], ep)
    except AssertionError as e:
        view, problems = None, problems + [str(e)]
    note = "no comparison"
    if view is not None:
        _, probs, note = compare_dp(view, ref, cfg.dtype, routing, cfg.moe_top_k)
        problems += probs
        if cfg.dtype != "mixed":
            problems += compare_losses(view.grad_norms, ref.grad_norms, TOL[cfg.dtype]["rtol"])[1]
    for line in problems[:8]:
        print("  MISMATCH:", line[:300])
    print(f"losses {[f'{x:.6f}' for x in ref.losses]} (reference), ep {ep} x edp {D // ep}")
    record(losses=[float(x) for x in ref.losses], formulas_hold=[g[1] for g in gathered])
    say_verdict(problems, f"ep={ep} x edp={D // ep}, E={E} K={cfg.moe_top_k} "
                            f"cf={cfg.capacity_factor} {args.dispatch} {cfg.dtype}, {args.steps} "
                            f"steps, {D} ranks: {note}; ep bytes, static and peak activation memory == formulas")  # fmt: skip
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(run_example(main, args, world_size=D_))
