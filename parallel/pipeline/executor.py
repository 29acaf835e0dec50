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

from emulator.memory import saved_nbytes
from emulator.model import (
    block_backward,
    block_forward,
    block_params,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
    param_shapes,
)
from emulator.precision import down, up
from parallel.pipeline.zero_bubble import block_backward_b, block_backward_w

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
    mine = {i for u in range(s, U, p) for i in split[u]}
    owned = (lambda n: n in EMBED and s == 0, lambda n: n in HEAD and (U - 1) % p == s)
    return [
        n
        for n in param_shapes(cfg)
        if (n.startswith("blocks.") and int(n.split(".")[1]) in mine) or any(f(n) for f in owned)
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


def run_schedule(pp, sched, split, params, mbs, cfg, *, ce_denom, aux_scales, groups=None,
                 recompute="none", mem=None):  # fmt: skip
    """Execute this stage's actions for one optimizer step.

    params: this stage's compute-dtype parameters; mbs: the m (tokens, targets) micro-batches;
    aux_scales[j]: micro-batch j's share of the step's routing groups (MoE aux weight);
    groups[j]: its routing groups (flat indices b*S + s) or None (one group).
    -> (grads summed over micro-batches in ascending order - as reference_train sums them -,
        this stage's share of the loss, the executed actions, peak live micro-batch units).
    """
    s, p, U = pp.rank, sched.p, sched.p * sched.v
    b, S = mbs[0][0].shape
    links = Links(pp, sched, (b, S, cfg.d_model), next(iter(params.values())).dtype)
    groups = groups or [None] * len(mbs)
    caches, stash, grads = {}, {}, {}
    loss, live, peak, done = 0.0, 0, 0, []

    def add(name, g):  # acc = acc + g, the reference's order and dtype steps
        grads[name] = g if name not in grads else down(up(grads[name]) + up(g), g.dtype)

    for a in sched.stages[s]:
        u = sched.virtual(s, a.chunk)
        key = (a.mb, a.chunk)
        if a.kind == "F":
            tok, tgt = mbs[a.mb]
            c = {"blocks": []}
            if u == 0:
                x, c["embed"] = embed_forward(params, tok)
                _alloc(mem, f"mb{a.mb}.embed", c["embed"], params)
            else:
                x = links.recv(("act", a.mb, u), (u - 1) % p)
            for i in split[u]:
                kw = {"recompute": recompute, "groups": groups[a.mb], "mem": mem,
                      "name": f"mb{a.mb}.blocks.{i}"}  # fmt: skip
                x, bc = block_forward(block_params(params, i), x, cfg, **kw)
                c["blocks"].append((i, bc))
                loss += cfg.aux_loss_coef * aux_scales[a.mb] * float(bc["aux"])
            if u == U - 1:
                ce, c["head"] = head_forward(params, x, tgt, cfg, denom=ce_denom)
                _alloc(mem, f"mb{a.mb}.head", c["head"], params)
                loss += float(ce)
            else:
                links.send(x, ("act", a.mb, u + 1), (u + 1) % p)
            caches[key] = c
            live += 1
            peak = max(peak, live)
        elif a.kind == "B":
            c, daux = caches.pop(key), cfg.aux_loss_coef * aux_scales[a.mb]
            if u == U - 1:
                dx, g = head_backward(1.0, c["head"])  # the split leaves the head whole (small)
                _free(mem, f"mb{a.mb}.head")
                for n, d in g.items():
                    add(n, d)
            else:
                dx = links.recv(("grad", a.mb, u), (u + 1) % p)
            deferred = []
            for i, bc in reversed(c["blocks"]):
                if sched.split:  # B only: input gradients now, (x, dy) pairs kept for W
                    dx, st = block_backward_b(dx, bc, daux=daux)
                    deferred.append((i, st))
                else:
                    dx, dbp = block_backward(dx, bc, daux=daux)
                    for n, d in dbp.items():
                        add(f"blocks.{i}.{n}", d)
            if u == 0:
                deferred.append(("embed", (dx, c["embed"])))
            else:
                links.send(dx, ("grad", a.mb, u - 1), (u - 1) % p)
            if sched.split:
                stash[key] = deferred
            else:
                _finish_embed(deferred, add, mem, a.mb)
                live -= 1
        else:  # W: the weight gradients B deferred (Qi et al. 2023, section 2)
            deferred = stash.pop(key)
            for i, st in deferred:
                if i != "embed":
                    for n, d in block_backward_w(st).items():
                        add(f"blocks.{i}.{n}", d)
            _finish_embed(deferred, add, mem, a.mb)
            live -= 1
        done.append(a)
    return grads, loss, done, peak


def _finish_embed(deferred, add, mem, mb):
    for i, st in deferred:
        if i == "embed":
            for n, d in embed_backward(*st).items():
                add(n, d)
            _free(mem, f"mb{mb}.embed")


def _alloc(mem, name, cache, params):
    if mem is not None:
        mem.alloc("activations", name, saved_nbytes(cache, exclude=params.values()))


def _free(mem, name):
    if mem is not None:
        mem.free("activations", name)
