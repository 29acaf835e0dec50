"""Expert parallelism inside the N-D program (parallel/train.py): the ep groups, the MoE drop-in
pair bound to them, the data-parallel hooks that sum expert and replicated gradients over
different groups, and the per-axis bytes of such a run.

Letters: D dp, P = ep, Q = D / P the expert-data-parallel degree (edp), t tp, E experts,
El = E / P. The ep group is drawn from the data-parallel ranks (Megatron-core, DeepSpeed-MoE):
dp rank d = q P + e sits at ep coordinate e = d mod P and edp coordinate q = d // P, so an ep
group is P neighbouring dp ranks (same pp, cp, tp coordinates) and every rank routes its own
tokens: the routing groups stay the spec's default, one per micro-batch per dp rank.
A rank holds experts e El .. (e+1) El - 1 of every MoE block of its stage; router and everything
else replicated over ep (or sharded by the other axes as before).

Gradients (as parallel/expert/sync.py): replicated ones summed over dp (one DDP over the dp
group, tags dp/grads/bucket*), expert ones over edp (a second DDP over the edp group, tags
edp/dp/grads/bucket*): the all-to-alls already brought every ep rank's token copies to the expert.
Clipping: one norm, squares reduced over ep, then tp, pp; the replicated gradients (identical
over ep after DDP) weigh 1/P so they count once, tp-replicated ones 1/t as before.
Ledger: every all-to-all of layer L, micro-batch j under "ep/<L>/mb<j>/<fwd|bwd>/<phase>",
phases as parallel/expert/cost.py (counts, dispatch, combine), whatever scope is open around it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from emulator import scope
from emulator.mesh import Mesh
from emulator.model import to_compute
from emulator.optim import AdamW
from emulator.precision import compute_dtype, master_dtype
from emulator.rank import current_state
from parallel import nd_cost
from parallel.clip import clip_and_step
from parallel.data.common import backward_order
from parallel.data.cost import step_bytes as dp_step_bytes
from parallel.data.ddp import DDP
from parallel.data.flat import make_buckets
from parallel.expert import cost as ep_cost
from parallel.expert.layer import ep_moe_backward, ep_moe_forward
from parallel.expert.load import layer_route
from parallel.expert.sync import is_expert
from parallel.pipeline.executor import Accumulate
from parallel.tensor import cost as tp_cost
from parallel.tensor.shard import REPLICATE


def ep_mesh(comm, layout) -> Mesh:
    """The mesh edp x ep x pp x cp x tp over the same ranks as layout.mesh (dp = edp x ep,
    ep inner): every group created here, in one order on every rank."""
    mesh = Mesh(comm, edp=layout.dp // layout.ep, ep=layout.ep, pp=layout.pp, cp=layout.cp,
                tp=layout.tp)  # fmt: skip
    mesh.group("ep")
    mesh.group("edp")
    return mesh


def expert_plan(plan: dict) -> dict:
    """megatron_plan with the expert tensors replicated over tp (they are cut over ep instead:
    Megatron-core's expert-tensor-parallel size 1); everything else as before."""
    return {n: (REPLICATE if is_expert(n) else p) for n, p in plan.items()}


def shard_experts(params: dict, e: int, El: int) -> dict:
    """{name: array} -> the expert tensors cut to experts e El .. (e+1) El - 1 (axis 0)."""
    sl = slice(e * El, (e + 1) * El)
    return {n: (a[sl].copy() if is_expert(n) else a) for n, a in params.items()}


def unshard_experts(ep, params: dict, grads: dict) -> tuple[dict, dict]:
    """The stage's params / grads with the experts concatenated back to E over the ep group, in
    ep-coordinate order (uncounted: the check, not the training)."""
    every = ep.allgather_object((params, grads))

    def whole(k, d):
        return {n: np.concatenate([e[k][n] for e in every]) if is_expert(n) else a
                for n, a in d.items()}  # fmt: skip

    return whole(0, params), whole(1, grads)


@contextlib.contextmanager
def _rooted(tag: str):
    """Record the traffic inside under exactly ``tag`` (not under the tp scope around the
    block): ep bytes are the ep axis's, whatever layer scope is open."""
    state = current_state()
    if state is None:
        yield
        return
    saved, state.tags = state.tags, [tag]
    try:
        yield
    finally:
        state.tags = saved


def moe_pair(ep, dispatch: str, record: dict, log: dict | None = None):
    """(forward, backward) with emulator's moe_fn signatures plus ``where`` (the block's cache
    name "mb<j>.blocks.<i>", bound by LayerContext). record[(layer, mb)] = (kept (E,), C): the
    kept token copies per expert and the slot total of this rank's groups (the formula's input);
    log[(layer, mb)]: the LayerRoute (load table, counts, decisions; parallel/expert/load.py)."""

    def forward(mp, m, groups, *, top_k, capacity_factor, where):
        mb, layer = where.split(".", 1)
        tag = f"ep/{layer}/{mb}"
        with _rooted(tag):
            y, aux, cache = ep_moe_forward(ep, mp, m, groups, top_k=top_k,
                                           capacity_factor=capacity_factor, dispatch=dispatch,
                                           prefix="")  # fmt: skip
        E = mp["router"].shape[1]
        kept = ep_cost.kept_table([cache["routes"]], E)[0]
        record[(layer, int(mb[2:]))] = (kept, sum(int(r["C"]) for r in cache["routes"]))
        if log is not None:
            log[(layer, int(mb[2:]))] = layer_route(cache, E, m.shape[1])
        cache["where"] = tag
        return y, aux, cache

    def backward(dy, cache, daux):
        with _rooted(cache["where"]):
            return ep_moe_backward(dy, cache, daux)

    return forward, backward


class EPAxis(Accumulate):
    """The dp axis hooks (parallel/data/axis.py's DataAxis, zero 0) of an ep run: gradients
    summed over the micro-batches locally, then replicated ones by DDP over dp and expert ones by
    DDP over edp, one global norm (ep, tp, pp), AdamW on the local tensors (elementwise)."""

    def __init__(self, dp, edp, ep, master, cfg, *, hyper, max_norm=None, norm_groups=(),
                 tp_replicated=(), t=1, bucket_cap_mb=25.0, partial=None,
                 mem=None):  # fmt: skip
        super().__init__(None)
        self.master, self.cfg, self.max_norm, self.mem = master, cfg, max_norm, mem
        self.partial, self.mb = partial, 0  # SP: the tp-partial gradients summed per layer
        self.groups = (ep, *norm_groups)
        P = ep.size
        self.weights = {n: (1.0 if is_expert(n) else 1.0 / P) / (t if n in tp_replicated else 1)
                        for n in master}  # fmt: skip
        self.opt = AdamW(master, **hyper)
        self.position = {n: i for i, n in enumerate(master)}
        dense = {n: p for n, p in master.items() if not is_expert(n)}
        experts = {n: p for n, p in master.items() if is_expert(n)}
        kw = {"bucket_cap_mb": bucket_cap_mb, "dtype": cfg.dtype}
        self.ddp = DDP(dp, dense, mem=mem, **kw)
        self.eddp = DDP(edp, experts, mem=None, **kw) if edp.size > 1 else None
        n, c = sum(p.size for p in master.values()), compute_dtype(cfg.dtype).itemsize
        self.statics = [("params", "master", sum(p.nbytes for p in master.values())),
                        ("optimizer", "adamw", self.opt.nbytes())]  # fmt: skip
        if cfg.dtype == "mixed":
            self.statics.append(("params", "compute_copy", n * c))
        if self.eddp is not None:  # its buckets, renamed beside the dense DDP's
            for b in self.eddp.layouts:
                self.statics.append(("grads", f"edp.ddp.bucket{b.index}", b.padded * c))
        else:  # edp = 1: the experts' local gradient buffer
            self.statics.append(
                ("grads", "expert_grads", sum(p.size for p in experts.values()) * c)
            )
        for cat, name, nbytes in self.statics if mem is not None else ():
            mem.alloc(cat, name, nbytes)
        self.layouts = list(self.ddp.layouts) + list(self.eddp.layouts if self.eddp else [])
        self.last_grads: dict = {}

    def begin_step(self) -> None:
        self.grads, self.params = {}, to_compute(self.master, self.cfg)

    def finish_step(self) -> float:
        grads = {n: self.grads[n] for n in self.master}
        for n in backward_order(grads, self.position):
            if not is_expert(n):
                self.ddp.grad_ready(n, grads[n], where="step")
            elif self.eddp is not None:
                with scope("edp"):  # tags edp/dp/grads/bucket<i>@step
                    self.eddp.grad_ready(n, grads[n], where="step")
        out = dict(self.ddp.finish())
        out.update(self.eddp.finish() if self.eddp else {})
        grads = {n: (out[n] if n in out else grads[n]).copy() for n in self.master}
        self.ddp.zero_grad()
        if self.eddp:
            self.eddp.zero_grad()
        self.last_grads = grads
        return clip_and_step(self.opt, self.master, grads, self.groups, max_norm=self.max_norm,
                             weights=self.weights, tag="dp/clip")  # fmt: skip

    def start(self, kind: str, mb: int, layers: list) -> None:
        self.mb = mb

    def post_backward(self, layer: str, grads: dict) -> None:
        if self.partial is not None:  # as DataAxis: SP's partial replicated grads over tp first
            grads = self.partial(layer, self.mb, grads)
        super().post_backward(layer, grads)

    def result(self) -> None:
        return None

    def local_state(self) -> tuple[dict, dict]:
        return {n: p.copy() for n, p in self.master.items()}, self.last_grads

    def close(self) -> None:
        self.ddp.close()
        if self.eddp is not None:
            self.eddp.close()
        for cat, name, _ in self.statics if self.mem is not None else ():
            with contextlib.suppress(KeyError):
                self.mem.free(cat, name)
        self.statics = []


# ---- bytes -----------------------------------------------------------------------------------
def ep_layer_bytes(dispatch: str, kept, C: int, H: int, itemsize: int, rank: int) -> dict:
    """{phase: (sent, received)} of one MoE layer and micro-batch: parallel/expert/cost.py's
    formula, kept (P, E) the ep group's kept copies, C the slot total of one rank's groups."""
    return ep_cost.layer_bytes(dispatch, np.asarray(kept), C, H, itemsize, rank)


def dp_bytes(cfg, layout, shapes: dict) -> int:
    """Bytes this rank sends per step on dp and edp: DDP over D of the replicated tensors'
    buckets, plus DDP over D / P of the experts' (parallel/data/cost.step_bytes)."""
    c = compute_dtype(cfg.dtype).itemsize
    total = 0
    for names, D in (([n for n in shapes if not is_expert(n)], layout.dp),
                     ([n for n in shapes if is_expert(n)], layout.dp // layout.ep)):  # fmt: skip
        if D > 1 and names:
            lays = make_buckets({n: shapes[n] for n in names}, D, layout.bucket_cap_mb, c)
            total += sum(dp_step_bytes("ddp", lays, cfg.dtype, layout.microbatches).values())
    return total


def tp_bytes(cfg, layout, B: int, S: int, coords: dict) -> int:
    """Bytes this rank sends per step on tp: parallel/nd_cost.rank_bytes's tp formula, with each
    MoE block's share replaced. Its experts are replicated over tp and run on the full m, so the
    block keeps the attention's f / g (2 all-reduces of (b, S, H); SP: AG + RS both ways) and
    only the entry of m: none without SP, an all-gather forward and of dy backward with it. So
    per block and micro-batch, against nd_cost's 4 ar + gates: (2 - sp) ar + gates fewer."""
    t, m, sp = layout.tp, layout.microbatches, layout.sequence_parallel
    if t == 1:
        return 0
    b = B // (layout.dp * m)
    generic = nd_cost.rank_bytes(cfg, dataclasses.replace(layout, ep=1), B, S, coords)["tp"]
    rows = tp_cost.layer_rows(cfg, b, S, t, sp=sp, regather=layout.regather, rank=coords["tp"])
    ar = tp_cost.hidden_all_reduce_bytes(cfg, b, S, t)
    n_blocks = len({n.split(".")[1] for n in nd_cost.local_shapes(cfg, layout, coords["pp"])
                    if n.startswith("blocks.")})  # fmt: skip
    return generic - m * n_blocks * ((2 - sp) * ar + rows["gates"])


def static_memory(cfg, layout, shapes: dict) -> dict:
    """Bytes per category of EPAxis's state for local ``shapes``: the master params (+ the
    compute copy in mixed), AdamW's two moments, and the gradients in the DDP buckets - the
    replicated tensors' padded to D, the experts' to D / P (their local buffer, unpadded, when
    edp = 1): parallel/data/cost.static_memory's DDP row with two bucket sets."""
    c, mi = compute_dtype(cfg.dtype).itemsize, master_dtype(cfg.dtype).itemsize
    n = sum(math.prod(s) for s in shapes.values())
    grads = 0
    for names, D in (([k for k in shapes if not is_expert(k)], layout.dp),
                     ([k for k in shapes if is_expert(k)], layout.dp // layout.ep)):  # fmt: skip
        lays = make_buckets({k: shapes[k] for k in names}, D, layout.bucket_cap_mb, c)
        grads += sum(lay.padded for lay in lays) * c
    return {
        "params": n * (mi + c * (cfg.dtype == "mixed")),
        "grads": grads,
        "optimizer": 2 * n * mi,
    }
