"""ep x dp training, comparable with emulator.reference.reference_train on the same global batch
and routing groups: a thin recipe on the one N-D program, parallel.train(comm, Layout(dp=world,
ep=ep, ...)) - expert parallelism is the ep slot of its Layout (parallel/expert/nd.py).

Shape letters: D world ranks (all data-parallel), P = ep, E experts, El = E / P.

The N-D program lays Mesh(edp = D / P, ep = P) inside dp (ep inner: an ep group is P
neighbouring ranks, as in Megatron-core). Every rank takes its data-parallel slice of the batch
and routes its own tokens, so rank r's micro-batch j is the reference's micro-batch r k + j and
its routing groups are the reference's for that micro-batch (one per micro-batch by default).
Rank r holds every replicated parameter and the experts c El .. (c+1) El - 1 of every block,
c = its ep coordinate. Gradients (parallel/expert/nd.py ep_axis, zero 0): the micro-batches summed
locally, then replicated gradients by DDP over all D ranks (tags dp/grads/bucket*) and expert
gradients - already complete over the ep group's tokens - by DDP over the D / P ranks holding
the same experts (tags edp/dp/grads/bucket*); ``grad_sync``: "ddp" buckets of bucket_cap_mb,
"allreduce" one bucket per tensor (a per-tensor all-reduce). One clipping norm over the ep group
(replicated gradients weighted 1/P), then AdamW on the local parameters.

What this adds to the NDRun: the run in ep_train's shapes (EPRun: this rank's local tensors,
per step / micro-batch / layer the load table, counts, decisions and the ledger's all-to-all
bytes by phase) and FullView, every rank's run back at full shape for parallel/check/data.py.
examples/07_expert_parallel.py reads any N-D run (tp, pp too) with moe_records / full_state.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator.guards import check_training
from parallel.expert.cost import PHASES
from parallel.expert.layer import check_ep
from parallel.expert.sync import is_expert
from parallel.layout import Layout
from parallel.tag_bytes import tag_bytes
from parallel.tensor.shard import REPLICATE, unshard
from parallel.train import train

GRAD_SYNCS = ("allreduce", "ddp")
PER_TENSOR_MB = 1e-9  # "allreduce": every tensor (>= 1 byte) closes its own DDP bucket


@dataclasses.dataclass
class EPRun:
    losses: list  # global loss per step
    grad_norms: list  # global norm before clipping
    grads: dict  # last step's synced gradient, before clipping: this rank's (local) shapes
    params: dict  # final local parameters (experts: this rank's slice)
    moe: list  # [step][micro-batch][layer] -> moe_records' dict (load, counts, decisions,
    # kept, C, bytes); empty layer lists at ep = 1 (the single-rank MoE block: no all-to-all)
    memory: dict  # the MemoryLedger snapshot at the end
    ep_rank: int
    n_local: int  # El
    opt_state: dict  # {"m", "v"}: local shapes
    layouts: dict  # {"dense", "experts"}: the DDP buckets over dp and over edp
    step_bytes: list  # [step] {"dp", "edp"}: (sent, received) of the gradient DDPs
    coords: dict  # the N-D run's {axis: index} (dp, pp, cp, tp, ep, edp)
    records: list  # [step] {(layer, mb): moe_records' dict}


def check_axes(D: int, ep: int, cfg) -> int:
    """-> El; named errors for a dense model, ep not dividing D, E % ep, top_k > E."""
    if not cfg.is_moe:
        raise ValueError("expert parallelism needs an MoE model (n_experts > 0)")
    if ep < 1 or D % ep:
        raise ValueError(
            f"ep={ep} must divide the {D} data-parallel ranks (the ep group is drawn from them); "
            f"choose ep in {[d for d in range(1, D + 1) if D % d == 0]}"
        )
    return check_ep(cfg.n_experts, ep, cfg.moe_top_k)


def check_batch(D: int, batch: int, k: int) -> None:
    if k < 1 or batch % D or (batch // D) % k:
        raise ValueError(
            f"batch B={batch} must split over D={D} ranks into {k} equal micro-batches each"
        )


def ep_train(comm, cfg, seed, batches, steps, *, ep, microbatches=1, dispatch="exact", lr=1e-3,
             betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_norm=None, groups_fn=None,
             recompute="none", grad_sync="allreduce", bucket_cap_mb=25.0) -> EPRun:  # fmt: skip
    """Train ``steps`` steps of Layout(dp=comm.size, ep=ep) through parallel.train."""
    check_training("ep_train", steps=steps, microbatches=microbatches, lr=lr, betas=betas,
                   eps=eps, weight_decay=weight_decay, max_norm=max_norm)  # fmt: skip
    El = check_axes(comm.size, ep, cfg)
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync={grad_sync!r} must be one of {GRAD_SYNCS}")
    cap = PER_TENSOR_MB if grad_sync == "allreduce" else bucket_cap_mb
    layout = Layout(dp=comm.size, ep=ep, microbatches=microbatches, dispatch=dispatch,
                    recompute=recompute, dtype=cfg.dtype, bucket_cap_mb=cap)  # fmt: skip
    mark = comm.ledger.mark()
    run = train(comm, layout, cfg, batches, steps, seed, lr=lr, betas=betas, eps=eps,
                weight_decay=weight_decay, max_norm=max_norm, groups_fn=groups_fn)  # fmt: skip
    recs = comm.ledger.since(mark)
    records = moe_records(run, recs)
    blocks = [f"blocks.{i}" for i in range(cfg.n_layers)]
    moe = [[[st[(b, j)] for b in blocks if (b, j) in st] for j in range(microbatches)]
           for st in records] if records else [[[]] * microbatches] * steps  # fmt: skip
    step_bytes = tag_bytes(recs, steps, {"dp": "dp/grads*", "edp": "edp/*"})
    split = {"dense": [], "experts": []}
    for lay in run.layouts:
        split["experts" if is_expert(lay.names[0]) else "dense"].append(lay)
    c = run.coords.get("ep", 0)
    return EPRun(run.losses, run.grad_norms, run.local_grads, run.local_params, moe, run.memory,
                 c, El, run.local_opt, split, step_bytes, run.coords, records)  # fmt: skip


def moe_records(run, records) -> list[dict]:
    """An NDRun (ep > 1) and this rank's ledger records of it -> per step {(layer, mb): {"load",
    "counts", "decisions" (NDRun.ep_routes), "kept", "C" (NDRun.ep_counts), "bytes": {phase:
    (sent, received)} of the all-to-alls tagged ep/<layer>/mb<j>/<phase>}}. [] at ep = 1."""
    moved: dict = {}
    for r in records:  # a slice test, not a call per record (~2-3 k records per rank and step)
        if r.tag[:3] == "ep/":
            key = (r.step, r.tag, r.direction)
            moved[key] = moved[key] + r.nbytes if key in moved else r.nbytes
    out = []
    for s, (counts, routes) in enumerate(zip(run.ep_counts, run.ep_routes)):
        step = {}
        for (layer, j), lr in routes.items():
            tags = {ph: f"ep/{layer}/mb{j}/{ph}" for ph in PHASES}
            step[(layer, j)] = {
                "load": lr.load, "counts": lr.counts, "decisions": lr.decisions,
                "kept": counts[(layer, j)][0], "C": counts[(layer, j)][1],
                "bytes": {ph: (moved.get((s, t, "send"), 0), moved.get((s, t, "recv"), 0))
                          for ph, t in tags.items()},
            }  # fmt: skip
        out.append(step)
    return out


def reference_slices(ref_params, c: int, El: int) -> dict:
    """The reference's full parameters cut to rank c's expert slice (for comparisons)."""
    sl = slice(c * El, (c + 1) * El)
    return {n: (a[sl] if is_expert(n) else a).copy() for n, a in ref_params.items()}


# ---- every rank's run at full shape (uncounted: the check, not the training) -----------------
def _twin_key(coords: dict) -> tuple:
    return tuple(sorted((a, v) for a, v in coords.items() if a not in ("dp", "edp")))


def replica_problems(parts, what: str) -> list[str]:
    """parts: [(coords, {name: local array})] of every rank. An edp replica (edp > 0) holds the
    experts and replicated tensors of its twin (edp 0, same ep / pp / tp), summed by the same
    DDPs in the same order: bitwise equal, or one message per differing tensor."""
    twins = {_twin_key(c): d for c, d in parts if c.get("edp", 0) == 0}
    bad = []
    for c, d in parts:
        twin = twins[_twin_key(c)]
        bad += [f"{what} {n}: rank at {c} differs from its edp twin" for n, a in d.items()
                if np.asarray(a).tobytes() != np.asarray(twin[n]).tobytes()]  # fmt: skip
    return bad


def full_state(parts, plan=None) -> dict:
    """parts: [(coords, {name: local array})] of every rank -> full shapes: each stage's tp
    shards joined by ``plan`` (parallel.tensor.shard.unshard; None: nothing tp-sharded), the
    experts concatenated in ep order, the stages merged. Only edp-0 ranks are read."""
    stages: dict = {}
    for c, d in parts:
        if c.get("edp", 0) == 0:
            stages.setdefault((c.get("pp", 0), c.get("ep", 0)), {})[c.get("tp", 0)] = d
    out: dict = {}
    for (_, e), by_tp in sorted(stages.items()):
        shards = [by_tp[t] for t in sorted(by_tp)]
        whole = unshard(shards, plan or {n: REPLICATE for n in shards[0]})
        for n, a in whole.items():
            if is_expert(n):
                out.setdefault(n, []).append(a)  # stages sorted: ep order within each
            elif e == 0:
                out[n] = a
    return {n: np.concatenate(a) if isinstance(a, list) else a for n, a in out.items()}


def routing_of(parts, micro: int, n_layers: int) -> list:
    """parts: [(coords, records)] of every rank (moe_records' lists) -> [step][global
    micro-batch d k + j][layer] -> [Route per group], read from the tp-0 ranks of each stage."""
    by: dict = {}
    for c, steps in parts:
        if c.get("tp", 0) == 0:
            for s, st in enumerate(steps):
                by.setdefault((s, c["dp"]), {}).update(st)
    D = 1 + max(c["dp"] for c, _ in parts)
    return [[[by[(s, d)][(f"blocks.{i}", j)]["decisions"] for i in range(n_layers)]
             for d in range(D) for j in range(micro)] for s in range(len(parts[0][1]))]  # fmt: skip


@dataclasses.dataclass
class FullView:
    """Every rank's run put back to full shape, as parallel/check/data.py's compare_dp reads a
    data-parallel run: losses, grads, params, opt_state {"m", "v"}, routing [step][global
    micro-batch r k + j][layer] -> [Route per group]."""

    losses: list
    grad_norms: list
    grads: dict
    params: dict
    opt_state: dict
    routing: list


def assemble(runs, ep: int | None = None) -> FullView:
    """runs: the EPRun of every world rank (gathered uncounted). Raises if an edp replica
    disagrees bitwise with the rank it copies. (``ep``: unused, the coords say it.)"""
    bad = replica_problems([(r.coords, r.params) for r in runs], "param")
    if bad:
        raise AssertionError(bad[0])

    def full(get):
        return full_state([(r.coords, get(r)) for r in runs])

    micro, n_layers = len(runs[0].moe[0]), len(runs[0].moe[0][0])
    routing = (
        routing_of([(r.coords, r.records) for r in runs], micro, n_layers) if n_layers else None
    )
    opt = {k: full(lambda r, k=k: r.opt_state[k]) for k in ("m", "v")}
    return FullView(runs[0].losses, runs[0].grad_norms, full(lambda r: r.grads),
                    full(lambda r: r.params), opt, routing)  # fmt: skip
