"""ZeRO stages 1, 2 and 3 as one code path keyed on `stage` (Rajbhandari et al. 2020, "ZeRO:
Memory Optimizations Toward Training Trillion Parameter Models", section 5).

Parameters are grouped into flat padded buffers (parallel/data/flat.py: DDP-style buckets, or FSDP
units), and rank r owns slice r of each. Per rank, with Psi_pad the padded element count:
  stage 1 (P_os)      master + Adam moments sharded. Full gradients accumulate locally; at the
                      step they are reduce-scattered (Psi), the owned shard is updated, and the
                      updated compute-dtype parameters are all-gathered (Psi): 2 Psi, as DDP.
  stage 2 (P_os+g)    + gradients sharded: each unit is reduce-scattered as soon as the backward
                      has produced it (per micro-batch) and the full copy freed (section 5.2).
  stage 3 (P_os+g+p)  + parameters sharded: a unit is all-gathered before its forward and again
                      before its backward (parallel/data/fsdp.py), 3 Psi per step (section 7.2.2).
Gradients are summed over dp (docs/CONTRACTS.md). Clipping: the global norm^2 is the owned
shards' sum of squares all-reduced over dp and over `norm_groups` (tp, pp when composed).
Mixed precision: compute-dtype (bf16) parameters and gradients on the wire; fp32 master and
moments only for the owned shard (Micikevicius et al. 2018, section 3).
"""

from __future__ import annotations

import numpy as np

from collectives import all_gather, reduce_scatter
from emulator import affinity, scope
from emulator.guards import check_hyper
from emulator.optim import adamw_update
from emulator.precision import compute_dtype, down, master_dtype, up
from parallel.clip import global_grad_norm, scale_
from parallel.data.common import backward_order
from parallel.data.flat import GradAccumulator, make_buckets, make_layout

STAGES = (1, 2, 3)


def check_stage(stage) -> int:
    if str(stage) not in {"1", "2", "3"}:
        raise ValueError(f"unknown ZeRO stage {stage!r}; choose 1, 2 or 3 (or 'ddp' for DDP)")
    return int(stage)


class ZeroOptimizer:
    def __init__(self, dp_comm, local_params: dict, stage=1, *, dtype="float64", lr=1e-3,
                 betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, max_norm=None, norm_groups=(),
                 norm_weights=None, bucket_cap_mb=25.0, units=None, mem=None,
                 poison_freed=False, label=""):  # fmt: skip
        """``poison_freed`` (a test mode, off by default): fill a stage-3 gathered unit with NaN
        when it is freed, so a computation that still reads it - a backward using the
        forward's gather instead of its own - produces NaN instead of silently right values.
        ``label``: prefix of this optimizer's memory-ledger names (two on one rank: "edp.")."""
        self.stage, self.comm, self.mem, self.label = check_stage(stage), dp_comm, mem, label
        self.poison_freed = poison_freed
        check_hyper(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_norm=max_norm,
                    where="ZeroOptimizer")  # fmt: skip
        self.hyper = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.max_norm, self.norm_groups = max_norm, tuple(norm_groups)
        self.cdt, self.mdt = compute_dtype(dtype), master_dtype(dtype)
        self.mixed = self.cdt != self.mdt
        D, r = dp_comm.size, dp_comm.rank
        shapes = {n: tuple(p.shape) for n, p in local_params.items()}
        self.position = {n: i for i, n in enumerate(shapes)}  # parameter order
        if units is None:
            units = make_buckets(shapes, D, bucket_cap_mb, self.cdt.itemsize)
        else:  # name lists -> layouts (FSDP units)
            units = [make_layout(i, {n: shapes[n] for n in u}, D) for i, u in enumerate(units)]
        self.layouts = units
        self.full, self.master, self.pshard, self.m, self.v, self.gshard = {}, {}, {}, {}, {}, {}
        self.wshard = {}
        for lay in units:
            i, own = lay.index, lay.owned(r)
            if self.stage < 3:  # full compute copy; float64: the owned master IS a view of it
                full = lay.flatten(local_params, self.mdt)  # (padded,) master dtype
                self.full[i] = down(full, self.cdt) if self.mixed else full
                self.master[i] = full[own].copy() if self.mixed else full[own]
            else:  # the owned slice only: (shard,) master dtype
                self.master[i] = lay.flatten(local_params, self.mdt, own)
                self.pshard[i] = down(self.master[i], self.cdt) if self.mixed else self.master[i]
            self.m[i], self.v[i] = np.zeros(lay.shard, self.mdt), np.zeros(lay.shard, self.mdt)
            self.gshard[i] = np.zeros(lay.shard, self.cdt)
            if norm_weights:
                w = lay.flatten({n: np.full(s, norm_weights.get(n, 1.0)) for n, s in
                                 zip(lay.names, lay.shapes)}, np.float64, own)  # fmt: skip
                self.wshard[i] = w
        self.params = {}
        for lay in units if self.stage < 3 else ():
            self.params.update(lay.views(self.full[lay.index]))
        self.acc = GradAccumulator(units, self.cdt)
        self.gathered: dict[int, np.ndarray] = {}
        self.step_count, self.last_grads, self.reduced = 0, {}, set()
        self._account()

    # -- memory ledger: the static state of this rank, by category -----------------------------
    def _account(self) -> None:
        """Charge the nbytes of the arrays this rank actually holds (not products of sizes and
        the intended itemsizes), so a buffer kept in the wrong dtype - an Adam moment in bf16 -
        shows in the ledger against parallel/data/cost.py's closed forms. Stage 1's full
        gradient is the accumulator every micro-batch adds into: padded x its itemsize."""
        self.statics, self.closed = [], False  # (category, name) allocated; freed by close()
        if self.mem is None:
            return
        for lay in self.layouts:
            i = lay.index
            held = self.full[i] if self.stage < 3 else self.pshard[i]  # compute-dtype params
            entries = [("params", f"{self.label}u{i}.params", held.nbytes)]
            if self.mixed:
                entries.append(("params", f"{self.label}u{i}.master", self.master[i].nbytes))
            grads = (
                lay.padded * self.gshard[i].itemsize if self.stage == 1 else self.gshard[i].nbytes
            )
            entries.append(("grads", f"{self.label}u{i}.grads", grads))
            entries.append(
                ("optimizer", f"{self.label}u{i}.adam", self.m[i].nbytes + self.v[i].nbytes)
            )
            for cat, name, nbytes in entries:
                self.mem.alloc(cat, name, nbytes)
                self.statics.append((cat, name))

    def close(self) -> None:
        """Free this optimizer's memory-ledger entries - static state, gathered units, transient
        full gradients - so a later run on the same ranks starts from zero (idempotent)."""
        if self.mem is not None and not self.closed:
            for i in list(self.gathered):
                self.free(i)
            for i in list(self.acc.flats) if self.stage >= 2 else ():
                self.mem.free("grads", f"{self.label}u{i}.full")
            for cat, name in self.statics:
                self.mem.free(cat, name)
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- gradients ------------------------------------------------------------------------------
    def grad_ready(self, name: str, grad, where: str = "") -> None:
        """Add one gradient; stages 2 and 3 reduce-scatter a unit the moment it is complete."""
        lay = self.acc.of.get(name)
        fresh = lay is not None and lay.index not in self.acc.flats
        if self.stage >= 2 and fresh and self.mem is not None:  # a unit's transient full grad
            self.mem.alloc(
                "grads", f"{self.label}u{lay.index}.full", lay.padded * self.cdt.itemsize
            )
        lay = self.acc.add(name, grad)
        if lay is not None and self.stage >= 2:
            self._reduce_scatter(lay, where)

    def _reduce_scatter(self, lay, where: str) -> None:
        i = lay.index
        flat = self.acc.pop(i)
        with scope(f"dp/grads/u{i}@{where}" if where else f"dp/grads/u{i}"):
            part = reduce_scatter(self.comm, flat, op="sum")  # (shard,) of the sum over dp
        self.gshard[i][...] = down(up(self.gshard[i]) + up(part), self.cdt)
        self.reduced.add(i)
        if self.mem is not None and self.stage >= 2:
            self.mem.free("grads", f"{self.label}u{i}.full")

    def step(self, local_grads: dict | None = None) -> float:
        """Reduce-scatter (stage 1) -> clip -> AdamW on the owned shards -> all-gather (1, 2).
        Returns the global gradient norm before clipping: reduce, the norm over dp and
        ``norm_groups``, apply."""
        sq = self.reduce(local_grads)
        norm, coef = global_grad_norm(sq, (self.comm, *self.norm_groups),
                                      max_norm=self.max_norm, tag="dp/clip")  # fmt: skip
        self.apply(coef)
        return norm

    def reduce(self, local_grads: dict | None = None) -> float:
        """The sync half of a step: hand over ``local_grads`` (stage 1: all of them; 2, 3: the
        backward already did), reduce-scatter what is left -> the owned shards' (weighted) sum
        of squares, float64. A caller holding several optimizers (parallel/data/axis.py under
        ep: dense over dp, experts over edp) adds their sums, reduces them over the groups that
        hold distinct shards, and calls ``apply`` on each with the one coefficient."""
        for name in backward_order(local_grads or {}, self.position):
            self.grad_ready(name, local_grads[name], "step")
        if self.acc.seen:
            raise ValueError(f"ZeroOptimizer.step: incomplete gradients for units "
                             f"{sorted(self.acc.seen)}; every parameter needs a gradient")  # fmt: skip
        for lay in self.layouts if self.stage == 1 else ():
            if lay.index in self.acc.flats:
                self._reduce_scatter(lay, "")
        never = [lay.names[0] for lay in self.layouts if lay.index not in self.reduced]
        if never:
            raise ValueError(f"ZeroOptimizer.step: no gradients this step for {never[:3]}...")
        self.reduced = set()
        self.last_grads = {i: g.copy() for i, g in self.gshard.items()}
        sq = 0.0  # the owned shards' squares (padding is 0); weights per element when given
        for i, g in self.gshard.items():
            g64 = g.astype(np.float64)
            sq += float(np.dot(g64, g64 * self.wshard[i] if self.wshard else g64))
        return sq

    def apply(self, coef: float) -> None:
        """The update half: clip the owned gradient shards by ``coef`` (the reference's
        arithmetic), AdamW on the owned master shards, publish the parameters (stage 1/2:
        all-gather; 3: the compute shard)."""
        scale_(self.gshard, coef)
        self.step_count += 1
        for lay in self.layouts:
            i = lay.index
            g = self.gshard[i]
            adamw_update(self.master[i], g, self.m[i], self.v[i], self.step_count, **self.hyper)
            g[...] = 0
            self._publish(lay)

    def _publish(self, lay) -> None:
        """Stage 1/2: all-gather the updated compute-dtype parameters; stage 3: refresh the
        compute-dtype shard only (the next forward gathers it)."""
        i, own = lay.index, lay.owned(self.comm.rank)
        if self.stage == 3:
            if self.mixed:
                self.pshard[i][...] = down(self.master[i], self.cdt)
            return
        if self.mixed:
            self.full[i][own] = down(self.master[i], self.cdt)
        with scope(f"dp/params/u{i}"):
            self.full[i][...] = all_gather(self.comm, self.full[i][own])

    # -- stage 3: gather / free one unit ------------------------------------------------------
    def gather(self, i: int, where: str = "") -> dict:
        if i not in self.gathered:
            with scope(f"dp/params/u{i}@{where}" if where else f"dp/params/u{i}"):
                self.gathered[i] = all_gather(self.comm, self.pshard[i])  # (padded,)
            if self.mem is not None:
                self.mem.alloc("params", f"{self.label}u{i}.gathered", self.gathered[i].nbytes)
        return self.layouts[i].views(self.gathered[i])

    def free(self, i: int) -> None:
        buf = self.gathered.pop(i)
        if self.poison_freed:  # test mode: any later read of this memory shows as NaN
            buf[...] = np.nan
        if self.mem is not None:
            self.mem.free("params", f"{self.label}u{i}.gathered")

    # -- full-shape views for checks (uncounted control plane) ---------------------------------
    def _unshard(self, shards: dict) -> dict:
        """{name: full array}: every rank's shards joined, each layout once per group on virtual
        ranks (affinity.shared_map: the group's ranks share the joined buffers). Each rank gets
        its own views."""
        return self.unshard_many(shards)[0]

    def unshard_many(self, *shards: dict) -> list[dict]:
        """[_unshard(s) for s in shards] in one exchange: one allgather_object of every rank's
        dicts and one shared_map over (dict, layout) instead of two per dict (the end of a run
        unshards the master, the gradients and both moments: 8 control-plane rounds -> 2).
        The same concatenations of the same shards: the same arrays."""
        every = self.comm.allgather_object(list(shards))
        keys = [(k, lay.index) for k in range(len(shards)) for lay in self.layouts]
        flats = affinity.shared_map(
            self.comm, keys, lambda key: np.concatenate([e[key[0]][key[1]] for e in every])
        )  # (padded,)
        outs = []
        for k in range(len(shards)):
            out = {}
            for lay in self.layouts:
                out.update(lay.views(flats[k, lay.index]))  # views of it: no second copy
            outs.append(out)
        return outs

    def final_state(self) -> tuple[dict, dict, dict]:
        """(master_params(), full_grads(), state_dict()) in one unshard_many (a run's end)."""
        params, grads, m, v = self.unshard_many(self.master, self.last_grads, self.m, self.v)
        return params, grads, {"step": self.step_count, "m": m, "v": v}

    def master_params(self) -> dict:
        return self._unshard(self.master)

    def full_grads(self) -> dict:
        """The last step's summed gradient, before clipping."""
        return self._unshard(self.last_grads)

    def state_dict(self) -> dict:
        return {"step": self.step_count, "m": self._unshard(self.m), "v": self._unshard(self.v)}
