"""The data-parallel axis of any layout: DDP or ZeRO-1/2/3 on this rank's LOCAL parameters (the
TP shards of its pipeline stage), acting through the executor's layer hooks.

The executor (parallel/pipeline/executor.py) runs every layer as
    pre_forward -> forward -> post_forward ... pre_backward -> backward -> post_backward
and this class answers those calls (docs/CONTRACTS.md, "driver"):
  zero 0 (DDP)  every rank holds the local compute parameters; gradients are summed over the
                micro-batches locally (the reference's order) and handed to DDP's buckets once,
                at the end of the step (tag dp/grads/bucket<i>@step), then AdamW per bucket
                (parallel/data/replica.py); dp = 1: the same, on local flat gradient buffers
  zero 1        the same local sum, then ZeroOptimizer.step: reduce-scatter, AdamW on the
                owned slice, all-gather (parallel/data/zero.py)
  zero 2        one FSDP-style unit per layer (embed, each block, head: `layer_units`); a
                layer's gradients go to ZeroOptimizer.grad_ready as its backward produces them,
                so each unit is reduce-scattered once per micro-batch and never held whole
  zero 3        + the unit is all-gathered before the layer's forward and again before its
                backward, freed after each (reshard_after_forward; False keeps it from the
                forward to the backward), the next layer of the action prefetched if asked
One unit per layer (not FSDP's root unit of embed + head) because under a pipeline, and
interleaved chunks, the embedding and the head are on different stages or chunks: a unit must
complete its gradients within one layer's backward. `start(kind, mb, layers)` tells the hooks the
current action's layers, so prefetch gathers the next layer of the same action.

Parts (expert parallelism, parallel/expert/nd.py): the tensors may be split into parts, each
synchronised over its own group by its own DDP / ZeroOptimizer (an "engine") - the dense ones
over dp (x cp), the experts over edp (x cp), the second engine's traffic under the scope "edp"
(tags edp/dp/...) and its memory names prefixed "edp.". A layer's unit (zero 2/3) is then one
unit per engine (a block's dense and expert tensors), gathered together; ONE global norm: under
ZeRO every engine's owned shards' squares (ZeroOptimizer.reduce) summed, reduced over ``dp`` -
the group whose ranks hold distinct shards of every part - and ``norm_groups``, then each
engine's apply(coef); under DDP the summed gradients' squares over ``norm_groups`` (weighted).
"""

from __future__ import annotations

import contextlib
import dataclasses

from emulator import scope
from emulator.model import to_compute
from emulator.precision import compute_dtype
from parallel.clip import global_grad_norm, scale_
from parallel.data.common import backward_order
from parallel.data.ddp import DDP
from parallel.data.flat import FlatGrads, make_buckets
from parallel.data.replica import BucketAdamW
from parallel.data.replica_check import replica_mismatch
from parallel.data.zero import ZeroOptimizer
from parallel.pipeline.executor import Accumulate


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: "embed", "blocks.<i>" or "head"."""
    if name.startswith("blocks."):
        return ".".join(name.split(".")[:2])
    return "embed" if name.startswith("embed.") else "head"


def layer_units(names) -> list[list[str]]:
    """One unit per layer present in ``names`` (parameter order), in forward order."""
    units: dict[str, list] = {}
    for n in names:
        units.setdefault(layer_of(n), []).append(n)
    order = sorted(units, key=lambda k: (k != "embed", k == "head", int(k.split(".")[1])
                                         if k.startswith("blocks.") else 0))  # fmt: skip
    return [units[k] for k in order]


@dataclasses.dataclass(frozen=True)
class Part:
    """Tensors synchronised over one group: ``label`` "" (ledger tags dp/..., memory names as
    before) or e.g. "edp" (tags edp/dp/..., memory names "edp.<name>")."""

    group: object  # a Comm
    names: tuple
    label: str = ""

    def scope(self):
        return scope(self.label) if self.label else contextlib.nullcontext()


class DataAxis(Accumulate):
    def __init__(self, dp, master: dict, zero: int, cfg, *, hyper: dict, max_norm=None,
                 norm_groups=(), norm_weights=None, bucket_cap_mb=25.0,
                 reshard_after_forward=True, prefetch=False, partial=None,
                 mem=None, parts=None):  # fmt: skip
        """``parts``: None (every tensor over ``dp``) or [Part, ...] covering ``master``."""
        super().__init__(None)
        self.dp, self.master, self.zero, self.cfg, self.mem = dp, master, zero, cfg, mem
        self.max_norm, self.norm_groups, self.weights = max_norm, tuple(norm_groups), norm_weights
        self.reshard, self.prefetch, self.partial = reshard_after_forward, prefetch, partial
        self.D, self.statics, self.opt = dp.size, [], None
        self.parts = parts or [Part(dp, tuple(master))]
        self.part = {n: k for k, p in enumerate(self.parts) for n in p.names}
        listed = [n for p in self.parts for n in p.names]
        if sorted(listed) != sorted(master):
            missing = sorted(set(master) - set(listed))
            twice = sorted({n for n in listed if listed.count(n) > 1} | (set(listed) - set(master)))
            raise ValueError(f"DataAxis: the parts must cover every tensor exactly once; missing "
                             f"{missing}, twice or unknown {twice}")  # fmt: skip
        self.ddps, self.engines, self.units = [], [], []
        self.order: list = []
        self.last_grads: dict = {}  # no step yet: no gradient
        self.part_flats = self.last_flats = None  # per part: the buffers of master / last_grads
        n, c = sum(p.size for p in master.values()), compute_dtype(cfg.dtype).itemsize
        buckets = None  # zero 0: [layouts per part] (a group of one: D = 1, no padding)
        if zero == 0:
            buckets = [make_buckets({k: master[k].shape for k in part.names}, part.group.size,
                                    bucket_cap_mb, c) for part in self.parts]  # fmt: skip
            # the master in the buckets' flat layout, AdamW per bucket (parallel/data/replica.py)
            # each part's DDP broadcasts its group rank 0's buffers over the others: theirs
            # start unset instead of holding a copy of the same values first
            fill = [part.group.rank == 0 for part, b in zip(self.parts, buckets) for _ in b]
            self.opt = BucketAdamW([lay for b in buckets for lay in b], master, **hyper,
                                   fill=fill)  # fmt: skip
            self.master = master = self.opt.params
        at = 0  # the part's first buffer in self.opt.flats
        for i, part in enumerate(self.parts):
            mine = {k: master[k] for k in part.names}
            lab = f"{part.label}." if part.label else ""
            if buckets is not None:
                lays, at = buckets[i], at + len(buckets[i])
                self.part_flats = (self.part_flats or []) + [self.opt.flats[at - len(lays) : at]]
                if part.group.size > 1:
                    self.ddps.append(DDP(part.group, mine, label=lab, mem=mem, dtype=cfg.dtype,
                                         layouts=lays, flats=self.part_flats[-1]))  # fmt: skip
                    continue
                self.ddps.append(FlatGrads(lays))  # a group of one: no DDP, a gradient buffer
                size = sum(p.size for p in mine.values())
                self.statics.append(("grads", f"{lab}grads", size * c))
                continue
            units = layer_units(mine) if zero >= 2 else None
            self.engines.append(ZeroOptimizer(part.group, mine, zero, dtype=cfg.dtype,
                                              norm_weights=norm_weights, units=units,
                                              bucket_cap_mb=bucket_cap_mb, mem=mem, label=lab,
                                              **hyper))  # fmt: skip
            self.units.append({layer_of(lay.names[0]): lay.index
                               for lay in self.engines[-1].layouts})  # fmt: skip
        if zero == 0:
            self.statics += [("params", "master", sum(p.nbytes for p in master.values())),
                             ("optimizer", "adamw", self.opt.nbytes())]  # fmt: skip
            if cfg.dtype == "mixed":  # the compute copy: Psi c
                self.statics.append(("params", "compute_copy", n * c))
            for cat, name, nbytes in self.statics if mem is not None else ():
                mem.alloc(cat, name, nbytes)
        self.layouts = [lay for d in self.ddps if isinstance(d, DDP) for lay in d.layouts]
        self.layouts += [lay for e in self.engines for lay in e.layouts]

    # ---- one step -----------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.grads = {}
        if self.zero == 0:
            self.params = to_compute(self.master, self.cfg)
        elif self.zero < 3:
            self.params = {k: v for e in self.engines for k, v in e.params.items()}

    def finish_step(self) -> float:
        """Sync, clip and update -> the global gradient norm before clipping."""
        if self.zero >= 1:
            sq = 0.0
            for part, engine in zip(self.parts, self.engines):
                with part.scope():
                    grads = None if self.zero >= 2 else {n: self.grads[n] for n in part.names}
                    sq += engine.reduce(grads)
            norm, coef = global_grad_norm(sq, (self.dp, *self.norm_groups),
                                          max_norm=self.max_norm, tag="dp/clip")  # fmt: skip
            for part, engine in zip(self.parts, self.engines):
                with part.scope():
                    engine.apply(coef)
            return norm
        grads = {n: self.grads[n] for n in self.master}  # parameter order
        flats, per_part = [], []  # the DDPs' summed buckets (and a group of one's gradients)
        for part, ddp in zip(self.parts, self.ddps):
            if isinstance(ddp, FlatGrads):  # a group of one: its gradients copied into flat
                flats += ddp.gather(grads)  # buffers, in their own dtype (the clip scales them)
                per_part.append(None)  # not last_grads' buffers: the per-tensor check
                continue
            with part.scope():
                for n in backward_order({k: grads[k] for k in part.names}, ddp.position):
                    ddp.grad_ready(n, grads[n], where="step")
            grads |= ddp.finish()  # views of the buckets zero_grad lets go of
            per_part.append(ddp.flats())
            flats += per_part[-1]
            ddp.zero_grad()
        # summed (replicated) over each part's group after DDP: the norm reduces over the
        # other axes only (weights count a replica once)
        norm, coef = global_grad_norm(grads, self.norm_groups, max_norm=self.max_norm,
                                      weights=self.weights, tag="dp/clip")  # fmt: skip
        # the unclipped gradients for the check: the buckets themselves, copied if clipped
        self.last_grads = grads if coef >= 1.0 else {n: g.copy() for n, g in grads.items()}
        self.last_flats = per_part if coef >= 1.0 else None  # clipped: not last_grads' buffers
        scale_(flats, coef)  # elementwise: each tensor's bits; the padding stays zero
        self.opt.step(flats)
        return norm

    # ---- the executor's hooks --------------------------------------------------------------
    def start(self, kind: str, mb: int, layers: list) -> None:
        self.order, self.mb = list(layers), mb

    def _gather_layer(self, layer: str, where: str) -> dict:
        out = {}
        for part, engine, unit in zip(self.parts, self.engines, self.units):
            if layer in unit:
                with part.scope():
                    out |= engine.gather(unit[layer], where)
        return out

    def _gather(self, layer: str, tag: str) -> dict:
        params = self._gather_layer(layer, f"{tag}:{layer}")
        k = self.order.index(layer) + 1
        if self.prefetch and k < len(self.order):  # the next layer's unit, before computing
            self._gather_layer(self.order[k], f"prefetch@{tag}:{layer}")
        return params

    def _free(self, layer: str) -> None:
        for engine, unit in zip(self.engines, self.units):
            if layer in unit:
                engine.free(unit[layer])

    def pre_forward(self, layer: str) -> dict:
        return self._gather(layer, "fwd") if self.zero == 3 else self.params

    def post_forward(self, layer: str) -> None:
        if self.zero == 3 and self.reshard:
            self._free(layer)

    def pre_backward(self, layer: str) -> dict:
        return self._gather(layer, "bwd") if self.zero == 3 else self.params

    def post_backward(self, layer: str, grads: dict) -> None:
        if self.partial is not None:  # SP: sum the tp-partial gradients of this layer first
            grads = self.partial(layer, self.mb, grads)
        if self.zero < 2:
            return super().post_backward(layer, grads)
        for k, (part, engine) in enumerate(zip(self.parts, self.engines)):
            mine = {n: g for n, g in grads.items() if self.part[n] == k}
            with part.scope():
                for name in backward_order(mine, engine.position):
                    engine.grad_ready(name, mine[name], f"bwd:{layer}")
        if self.zero == 3:
            self._free(layer)

    def result(self) -> None:
        return None

    # ---- state for the check (uncounted) -------------------------------------------------
    def local_state(self) -> tuple[dict, dict]:
        """(master params, the last step's summed gradient before clipping): this rank's local
        arrays (gathered over each part's group under ZeRO, uncounted)."""
        if self.engines:
            params, grads = {}, {}
            for engine in self.engines:  # one unshard of both (parallel/data/zero.py)
                if engine.step_count:
                    p, g = engine.unshard_many(engine.master, engine.last_grads)
                    params, grads = params | p, grads | g
                else:
                    params |= engine.master_params()
            return {n: params[n] for n in self.master}, grads
        if isinstance(self.opt, BucketAdamW):  # views of its buffers: no step writes them now
            return dict(self.master), self.last_grads
        return {n: p.copy() for n, p in self.master.items()}, self.last_grads

    def replicas(self) -> tuple[dict, dict]:
        """(params, grads) this rank holds as its OWN copy of tensors replicated over its
        part's group: DDP the master params and the summed gradients; ZeRO-1/2 the all-gathered
        compute parameters (the gradient shards are distinct); ZeRO-3 nothing."""
        if self.zero == 0:
            return self.master, self.last_grads
        return (self.params if self.zero < 3 else {}), {}

    def replica_mismatch(self) -> list[str]:
        """ "param|grad <name> over <group>" for every replicated tensor whose copies on the
        ranks of its part's group are not bitwise equal (uncounted; collective over each
        part's group): parallel/data/replica_check.py, the buffers first where the tensors
        are views of them (DDP with BucketAdamW; the gradients only while unclipped)."""
        params, grads = self.replicas()
        flats = None
        if self.zero == 0 and self.part_flats is not None:
            grad_flats = self.last_flats or [None] * len(self.parts)
            flats = [None if g is None and grads else (p, g or [])
                     for p, g in zip(self.part_flats, grad_flats)]  # fmt: skip
        return replica_mismatch(self.parts, params, grads, flats)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        for ddp in self.ddps:
            if isinstance(ddp, DDP):
                ddp.close()
        for cat, name, _ in self.statics if self.mem is not None else ():
            with contextlib.suppress(KeyError):
                self.mem.free(cat, name)
        self.statics = []
