"""DDP: every rank holds the whole (local) model; gradients are summed over dp in buckets.

PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB): gradients are grouped into buckets of ~bucket_cap_mb in reverse parameter order
(section 3.2.3), and a bucket's all-reduce is launched the moment the backward has produced its
last gradient, so communication of late layers overlaps the backward of early ones. `no_sync()`
(section 3.2.4) skips the all-reduces for the first k-1 micro-batches of an accumulation window:
one all-reduce per optimizer step, not per micro-batch.

Each bucket is a flat buffer padded to a multiple of D, so the ring all-reduce moves exactly
2 (D-1)/D * padded * itemsize bytes per rank (collectives/cost.py ring_all_reduce).
The ledger tag `dp/grads/bucket{i}@{where}` records where in the backward the bucket became
ready (e.g. "@bwd:blocks.2"): the overlap DDP relies on can be read off the order of records.
Gradients are summed, not averaged (docs/CONTRACTS.md: each rank's loss is its share).

Initial parameters: as torch DDP's constructor (_sync_module_states), rank 0's parameters are
broadcast to every rank, so replicas built from different seeds start identical instead of
silently diverging. One binomial-tree broadcast of the flat concatenation of the local
parameters (Psi elements, their own itemsize m), once at construction, under the ledger tag
"ddp/init_broadcast": rank r receives Psi m (r > 0) and sends children(r) Psi m
(collectives/cost.py tree_broadcast; parallel/data/cost.py init_broadcast_bytes). The per-step
byte formulas are unchanged: the broadcast is not part of any step.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from collectives import all_reduce, broadcast
from emulator import scope
from emulator.precision import compute_dtype
from parallel.data.flat import GradAccumulator, make_buckets


@dataclasses.dataclass(frozen=True)
class Bucket:
    index: int
    names: tuple
    numel: int
    padded: int


class DDP:
    """Bucketed gradient synchronisation over `dp_comm` for a rank-local dict of parameters."""

    def __init__(self, dp_comm, local_params: dict, *, bucket_cap_mb=25.0, dtype="float64",
                 mem=None, broadcast_init=True, label="", layouts=None, flats=None):  # fmt: skip
        """``label``: prefix of the buckets' memory-ledger names (two DDPs on a rank: "edp.").
        ``layouts``: the buckets, when the caller made them already (make_buckets with the
        same arguments); ``flats``: local_params laid out in them (parallel/data/replica.py),
        so the initial broadcast moves their real elements instead of a concatenation."""
        self.comm, self.mem, self.label = dp_comm, mem, label
        self.dtype = compute_dtype(dtype)  # gradients (and the wire) in the compute dtype
        shapes = {n: tuple(p.shape) for n, p in local_params.items()}
        self.position = {n: i for i, n in enumerate(shapes)}  # parameter order
        if layouts is None:
            layouts = make_buckets(shapes, dp_comm.size, bucket_cap_mb, self.dtype.itemsize)
        self.layouts = layouts
        if broadcast_init and flats is not None:
            broadcast_flats(dp_comm, [(f, lay.numel) for f, lay in zip(flats, layouts)])
        elif broadcast_init:
            broadcast_params(dp_comm, local_params)
        self.buckets = [Bucket(b.index, b.names, b.numel, b.padded) for b in self.layouts]
        self.acc = GradAccumulator(self.layouts, self.dtype)
        self.sync = True
        self.reduced: dict[int, object] = {}
        self.events: list[tuple[int, str]] = []  # (bucket, where) in the order they fired
        self.closed = False
        if mem is not None:  # bucket buffers live for the whole run (PyTorch allocates them once)
            for b in self.layouts:
                mem.alloc(
                    "grads", f"{self.label}ddp.bucket{b.index}", b.padded * self.dtype.itemsize
                )

    def close(self) -> None:
        """Free the bucket buffers in the memory ledger (idempotent); `with DDP(...) as ddp:`."""
        if self.mem is not None and not self.closed:
            for b in self.layouts:
                self.mem.free("grads", f"{self.label}ddp.bucket{b.index}")
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next micro-batch outside the block synchronises."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def grad_ready(self, name: str, grad, where: str = "") -> None:
        lay = self.acc.add(name, grad)
        if lay is not None and self.sync:
            flat = self.acc.flats[lay.index]
            with scope(f"dp/grads/bucket{lay.index}@{where}"):
                # ring, never "auto": the tree would break the 2 (D-1)/D volume and the overlap
                flat = all_reduce(self.comm, flat, op="sum", algorithm="ring")
            # the sum is a new array of this rank's own (the ring gathers into a fresh buffer):
            # it becomes the bucket's buffer instead of being copied back into the old one
            self.acc.flats[lay.index] = self.reduced[lay.index] = flat
            self.events.append((lay.index, where))

    def finish(self) -> dict:
        """{name: summed gradient} as views into the bucket buffers (bucket order)."""
        out = {}
        for lay, flat in zip(self.layouts, self.flats()):
            out.update(lay.views(flat))
        return out

    def flats(self) -> list:
        """The summed bucket buffers in bucket order (what finish() returns views into)."""
        late = [b.index for b in self.layouts if b.index not in self.reduced]
        if late:
            raise RuntimeError(
                f"DDP.finish: bucket(s) {late} were never all-reduced; run the last micro-batch "
                f"of the step outside no_sync() and call grad_ready for every parameter"
            )
        return [self.reduced[lay.index] for lay in self.layouts]

    def zero_grad(self) -> None:
        self.acc = GradAccumulator(self.layouts, self.dtype)
        self.reduced, self.events = {}, []


def broadcast_params(comm, params: dict, tag: str = "ddp/init_broadcast") -> None:
    """In place: every rank's ``params`` become rank 0's (one flat tree broadcast; all arrays
    must share a dtype, and a rank with other names or shapes is a CollectiveMismatch)."""
    if comm.size == 1 or not params:
        return
    flat = np.concatenate([np.ravel(p) for p in params.values()])  # (Psi,)
    with scope(tag):
        flat = broadcast(comm, flat, root=0)
    start = 0
    for p in params.values():
        p[...] = flat[start : start + p.size].reshape(p.shape)
        start += p.size


def broadcast_flats(comm, flats: list, tag: str = "ddp/init_broadcast") -> None:
    """broadcast_params for parameters laid out in flat buffers: [(buffer, numel)], the real
    elements first (parallel/data/flat.py). The message is their real elements back to back:
    the same Psi elements, dtype and tree as broadcast_params' concatenation (in bucket
    order instead of parameter order, which no rank's result depends on), one copy per buffer
    instead of one per tensor, and none on rank 0, whose buffers already hold the values.
    One buffer (the usual case): received straight into it (`broadcast(out=)`), no copy at all
    but the messages'; several: the receivers copy the message back into each."""
    if comm.size == 1 or not flats:
        return
    if len(flats) == 1:  # the buffer's real elements are the message, received in place
        f, n = flats[0]
        with scope(tag):
            broadcast(comm, f[:n], root=0, out=f[:n])
        return
    if comm.rank == 0:  # (Psi,): the real elements back to back
        payload = np.concatenate([f[:n] for f, n in flats])
    else:  # the tree fills it
        payload = np.empty(sum(n for _, n in flats), flats[0][0].dtype)
    with scope(tag):
        got = broadcast(comm, payload, root=0, out=payload)
    if comm.rank == 0:
        return
    start = 0
    for f, n in flats:
        f[:n] = got[start : start + n]
        start += n
