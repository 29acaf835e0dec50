"""Pipeline parallelism: the stage split and the one executor that runs any schedule.

Letters: p stages (the `pp` group), v chunks per stage, U = p*v virtual stages, m micro-batches
of b sequences, S sequence, H d_model, L blocks. Virtual stage u = c*p + s (chunk c of stage s)
holds a consecutive range of blocks; u = 0 also holds the embedding, u = U-1 the final norm,
head and loss. The only bytes crossing a boundary are one (b, S, H) activation forward and its
gradient backward per micro-batch (Narayanan et al. 2021, section 3.2; GPipe section 2.3),
sent point to point with comm.send (eager, never blocks) and received with known shape.

The executor walks its stage's action list (schedules.py) and nothing else decides the order:
F(j, c) receives or embeds, runs chunk c's blocks, sends or computes the loss; B(j, c) receives
the output gradient (or starts from the loss), runs the blocks backward, sends the input
gradient; with a split backward, W(j, c) computes the deferred weight gradients (zero_bubble.py).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from emulator import scope
from emulator.memory import saved_nbytes
from emulator.model import block_params, param_shapes
from emulator.precision import down, up
from parallel.data.common import rebind
from parallel.layer import SINGLE

EMBED = ("embed.tok", "embed.pos")
HEAD = ("final_ln.gain", "final_ln.bias", "head.w")


def split_layers(n_layers: int, n_virtual: int, sizes=None) -> list[list[int]]:
    """Blocks of each virtual stage: consecutive ranges, as even as possible (the first
    L mod U stages get one more), or the explicit `sizes` (one count >= 1 per virtual stage)."""
    if n_virtual > n_layers:
        raise ValueError(
            f"pipeline: {n_virtual} (virtual) stages but only L={n_layers} blocks; every stage "
            f"needs at least one block: use fewer stages or chunks, or a deeper model"
        )
    if sizes is None:
        q, r = divmod(n_layers, n_virtual)
        sizes = [q + (u < r) for u in range(n_virtual)]
    sizes = list(sizes)
    if len(sizes) != n_virtual or any(not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(
            f"pipeline: split {sizes} must give {n_virtual} block counts, each an int >= 1"
        )
    if sum(sizes) != n_layers:
        raise ValueError(
            f"pipeline: split {sizes} covers {sum(sizes)} blocks, model has {n_layers}"
        )
    starts = np.cumsum([0, *sizes])
    return [list(range(starts[u], starts[u + 1])) for u in range(n_virtual)]


def stage_param_names(cfg, split, s: int, p: int) -> list[str]:
    """The parameter names stage s holds (state_dict order): its chunks' blocks, plus the
    embedding on stage 0 and the final norm and head on the stage holding u = U-1."""
    U = len(split)
    mine = {str(i) for u in range(s, U, p) for i in split[u]}
    ends = (EMBED if s == 0 else ()) + (HEAD if (U - 1) % p == s else ())
    return [
        n
        for n in param_shapes(cfg)
        if (n.startswith("blocks.") and n.split(".", 2)[1] in mine) or n in ends
    ]


class Links:
    """Stage-boundary messages. A receiver knows, from the schedule (data every rank has), the
    order in which each neighbour sends to it, so it receives FIFO into a small buffer until
    the message it needs arrives: receives always match sends whatever the two orders."""

    def __init__(self, pp, sched, shape, dtype):
        self.pp, self.shape, self.dtype, self.local = pp, shape, dtype, {}
        self.expect: dict = {}
        self.box: dict = {}
        U = sched.p * sched.v
        for src, acts in enumerate(sched.stages):
            for a in acts:
                key = self.key_sent(sched, src, a, U)
                if key and key[2] % sched.p == pp.rank and src != pp.rank:
                    self.expect.setdefault(src, deque()).append(key)

    @staticmethod
    def key_sent(sched, s, a, U):
        u = sched.virtual(s, a.chunk)
        if a.kind == "F" and u + 1 < U:
            return ("act", a.mb, u + 1)
        if a.kind == "B" and u > 0:
            return ("grad", a.mb, u - 1)
        return None

    def send(self, x, key, dst: int) -> None:
        if dst == self.pp.rank:  # p = 1 with chunks: the data stays on this rank
            self.local[key] = x
        else:
            self.pp.send(np.ascontiguousarray(x), dst)

    def recv(self, key, src: int):
        if src == self.pp.rank:
            return self.local.pop(key)
        while key not in self.box:
            k = self.expect[src].popleft()
            self.box[k] = self.pp.recv(src, shape=self.shape, dtype=self.dtype)
        return self.box.pop(key)


class Accumulate:
    """The default hooks: this stage's parameters as they are, gradients summed over the
    micro-batches in the order the backward produces them (ascending micro-batches on every
    schedule, as reference_train sums them). Layouts pass their own (parallel/data/axis.py)."""

    def __init__(self, params):
        self.params, self.grads = params, {}

    def start(self, kind: str, mb: int, layers: list) -> None:
        pass

    def pre_forward(self, layer: str) -> dict:
        return self.params

    def post_forward(self, layer: str) -> None:
        pass

    def pre_backward(self, layer: str) -> dict:
        return self.params

    def post_backward(self, layer: str, grads: dict) -> None:
        for n, g in grads.items():  # acc = acc + g, the reference's order and dtype steps
            a = self.grads.get(n)
            self.grads[n] = g if a is None else down(up(a) + up(g), g.dtype)

    def result(self) -> dict:
        return self.grads


class OneStage:
    """The pp "group" of a layout without a pipeline: one stage, every message stays local."""

    rank, size, name = 0, 1, "one-stage"


def run_schedule(pp, sched, split, params, mbs, cfg, *, ce_denom, aux_scales, groups=None,
                 recompute="none", mem=None, ctx=None, hooks=None, dtype=None, mb_losses=None,
                 routing=None, io_activations=True):  # fmt: skip
    """Execute this stage's actions for one optimizer step.

    params: this stage's compute-dtype parameters (or None with ``hooks``); mbs: the m (tokens,
    targets) micro-batches; aux_scales[j]: micro-batch j's share of the step's routing groups
    (MoE aux weight); groups[j]: its routing groups (flat indices b*S + s) or None (one group).
    ctx: the intra-layer context (parallel/layer.py; default single rank). mb_losses (a dict):
    filled with this stage's share of each micro-batch's loss, float(ce) + aux_coef * scale *
    sum(aux of its blocks) - model_forward's expression; routing (a dict of lists): each MoE
    block's decisions per micro-batch (parallel/check/routing.py), in layer order;
    io_activations=False leaves the embedding's and head's caches out of the memory ledger
    (the data- and tensor-parallel recipes' formulas count the blocks only). hooks: who supplies
    each layer's parameters and takes its gradients (default Accumulate(params)): every layer
    runs  pre_forward -> forward -> post_forward ... pre_backward -> backward -> post_backward,
    and ``start(kind, mb, layers)`` announces each action's layers in the order it runs them.
    -> (hooks.result() - by default the grads summed over micro-batches -, this stage's share
        of the loss, the executed actions, peak live micro-batch units).
    """
    ctx = SINGLE if ctx is None else ctx
    hooks = Accumulate(params) if hooks is None else hooks
    s, p, U = pp.rank, sched.p, sched.p * sched.v
    b, S = mbs[0][0].shape
    dtype = next(iter(params.values())).dtype if dtype is None else dtype
    links = Links(pp, sched, (b, ctx.seq_local(S), cfg.d_model), dtype)
    groups = groups or [None] * len(mbs)
    caches, stash, aux = {}, {}, {}
    io_mem = mem if io_activations else None
    loss, live, peak, done = 0.0, 0, 0, []

    def fwd_params(layer, c):
        p = c["used"][layer] = hooks.pre_forward(layer)
        return p

    def bwd_cache(layer, c):
        """The layer's cache rebound to the parameters pre_backward gives (FSDP re-gathers)."""
        p = hooks.pre_backward(layer)
        table = {id(a): p[n] for n, a in c["used"][layer].items() if p[n] is not a}
        return rebind(c[layer], table) if table else c[layer]

    for a in sched.stages[s]:
        u = sched.virtual(s, a.chunk)
        key, j = (a.mb, a.chunk), a.mb
        blocks = [f"blocks.{i}" for i in split[u]]
        first, last = ["embed"] * (u == 0), ["head"] * (u == U - 1)
        if a.kind == "F":
            hooks.start("F", j, first + blocks + last)
            tok, tgt = mbs[j]
            c = {"used": {}, "blocks": []}
            if u == 0:
                p_ = fwd_params("embed", c)
                with ctx.scope("embed", j, "fwd"):
                    x, c["embed"] = ctx.embed_forward(p_, tok)
                hooks.post_forward("embed")
                _alloc(io_mem, f"mb{j}.embed", c["embed"], p_, EMBED)
            else:
                with scope(f"pp/act/mb{j}"):
                    x = links.recv(("act", j, u), (u - 1) % p)
            for i in split[u]:
                name = f"blocks.{i}"
                bp = block_params(fwd_params(name, c), i)
                kw = {"recompute": recompute, "groups": groups[j], "mem": mem,
                      "name": f"mb{j}.{name}"}  # fmt: skip
                with ctx.scope(name, j, "fwd"):
                    x, c[name] = ctx.block_forward(bp, x, cfg, **kw)
                hooks.post_forward(name)
                c["blocks"].append(i)
                loss += cfg.aux_loss_coef * aux_scales[j] * float(c[name]["aux"])
                aux.setdefault(j, []).append(c[name]["aux"])
                if routing is not None and cfg.is_moe and ctx.decisions(c[name]) is not None:
                    routing.setdefault(j, []).append(ctx.decisions(c[name]))
            if u == U - 1:
                p_ = fwd_params("head", c)
                with ctx.scope("head", j, "fwd"):
                    ce, c["head"] = ctx.head_forward(p_, x, tgt, cfg, denom=ce_denom)
                hooks.post_forward("head")
                _alloc(io_mem, f"mb{j}.head", c["head"], p_, HEAD)
                loss += float(ce)
                c["ce"] = float(ce)
            else:
                with scope(f"pp/act/mb{j}"):
                    links.send(x, ("act", j, u + 1), (u + 1) % p)
            if mb_losses is not None:  # model_forward's expression for this stage's share
                share = cfg.aux_loss_coef * aux_scales[j] * sum(aux.get(j, []))
                mb_losses[j] = mb_losses.get(j, 0.0) + c.get("ce", 0.0) + share
                aux.pop(j, None)
            caches[key] = c
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            hooks.start("B", j, last + blocks[::-1] + ([] if sched.split else first))
            c, daux = caches.pop(key), cfg.aux_loss_coef * aux_scales[j]
            if u == U - 1:  # the split leaves the head whole (small)
                h = bwd_cache("head", c)
                with ctx.scope("head", j, "bwd"):
                    dx, g = ctx.head_backward(1.0, h)
                _free(io_mem, f"mb{j}.head")
                hooks.post_backward("head", g)
            else:
                with scope(f"pp/grad/mb{j}"):
                    dx = links.recv(("grad", j, u), (u + 1) % p)
            deferred = []
            for i in reversed(c["blocks"]):
                name = f"blocks.{i}"
                bc = bwd_cache(name, c)
                with ctx.scope(name, j, "bwd"):
                    if sched.split:  # B only: input gradients now, (x, dy) pairs kept for W
                        dx, st = ctx.block_backward_b(dx, bc, daux)
                        deferred.append((i, st))
                    else:
                        dx, dbp = ctx.block_backward(dx, bc, daux)
                if not sched.split:
                    hooks.post_backward(name, {f"{name}.{n}": d for n, d in dbp.items()})
            if u == 0:
                deferred.append(("embed", (dx, c)))
            else:
                with scope(f"pp/grad/mb{j}"):
                    links.send(dx, ("grad", j, u - 1), (u - 1) % p)
            if sched.split:
                stash[key] = deferred
            else:
                _finish_embed(deferred, hooks, bwd_cache, ctx, io_mem, j)
                live -= 1
        else:  # W: the weight gradients B deferred (Qi et al. 2023, section 2)
            deferred = stash.pop(key)
            hooks.start("W", j, [f"blocks.{i}" for i, _ in deferred if i != "embed"]
                        + ["embed"] * (u == 0))  # fmt: skip
            for i, st in deferred:
                if i != "embed":
                    dbp = ctx.block_backward_w(st)
                    hooks.post_backward(f"blocks.{i}",
                                        {f"blocks.{i}.{n}": d for n, d in dbp.items()})  # fmt: skip
            _finish_embed(deferred, hooks, bwd_cache, ctx, io_mem, j)
            live -= 1
        done.append(a)
    return hooks.result(), loss, done, peak


def _finish_embed(deferred, hooks, bwd_cache, ctx, mem, j):
    for i, st in deferred:
        if i == "embed":
            dx, c = st
            e = bwd_cache("embed", c)
            with ctx.scope("embed", j, "bwd"):
                g = ctx.embed_backward(dx, e)
            _free(mem, f"mb{j}.embed")
            hooks.post_backward("embed", g)


def _alloc(mem, name, cache, params, names):
    """Charge a layer's cache, the layer's own parameters (``names``, the ones its forward
    reads) not counted: excluding the stage's other tensors too would change nothing but the
    cost (saved_nbytes walks every excluded array's base chain)."""
    if mem is not None:
        own = [params[n] for n in names if n in params]
        mem.alloc("activations", name, saved_nbytes(cache, exclude=own))


def _free(mem, name):
    if mem is not None:
        mem.free("activations", name)
