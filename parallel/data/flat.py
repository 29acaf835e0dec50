"""Flat padded buffers: the memory layout shared by DDP buckets, ZeRO partitions and FSDP units.

A group of named parameters is laid out back to back in one 1-D buffer of `padded` elements,
`numel` of them real and the rest zeros, with `padded` the next multiple of the data-parallel
degree D. Then every ring chunk is exactly `padded / D` elements, so the reduce-scatter /
all-gather byte counts are exactly `padded (D-1)/D * itemsize` (collectives/cost.py) and rank r
owns the contiguous slice `[r * shard, (r+1) * shard)`, as in FSDP's FlatParameter (Zhao et al.
2023, "PyTorch FSDP", section 3.2.1) and DeepSpeed's partitioned flat groups (ZeRO, section 5).

Buckets follow PyTorch DDP (Li et al. 2020, "PyTorch Distributed", section 3.2.3): parameters in
reverse registration order (the order the backward produces their gradients), a new bucket
started once the current one holds >= bucket_cap bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np

from emulator.precision import arith_dtype, down, up


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """Where each named parameter lives in one flat buffer of `padded` elements."""

    index: int
    names: tuple
    shapes: tuple
    offsets: tuple  # start of each name; offsets[i] + size(shapes[i]) is its end
    numel: int  # real elements
    padded: int  # numel rounded up to a multiple of D
    D: int

    @property
    def shard(self) -> int:
        return self.padded // self.D

    @property
    def padding(self) -> int:
        return self.padded - self.numel

    def owned(self, rank: int) -> slice:
        return slice(rank * self.shard, (rank + 1) * self.shard)

    @functools.cached_property
    def slots(self) -> dict:
        """{name: slice of the flat buffer}, computed once (the hooks ask per gradient)."""
        return {n: slice(o, o + math.prod(s)) for n, o, s in zip(self.names, self.offsets,
                                                                 self.shapes)}  # fmt: skip

    def slot(self, name: str) -> slice:
        return self.slots[name]

    def flatten(self, arrays: dict, dtype, part: slice | None = None) -> np.ndarray:
        """(padded,) buffer holding arrays[name] for every name, zeros in the padding (cast as
        an assignment casts); ``part``: only the elements [part.start, part.stop) of it (a
        rank's owned slice), built from the pieces of the arrays that fall there."""
        lo, hi = (0, self.padded) if part is None else (part.start, part.stop)
        pieces = []
        for n, o, shape in zip(self.names, self.offsets, self.shapes):
            size = math.prod(shape)
            if o < hi and o + size > lo:
                a = np.ravel(arrays[n])
                if a.size != size:
                    raise ValueError(f"flatten: {n!r} has {a.size} elements, its slot {size}")
                pieces.append(a if lo <= o and o + size <= hi else
                              a[max(lo - o, 0) : min(hi - o, size)])  # fmt: skip
        if hi > max(lo, self.numel):
            pieces.append(np.zeros(hi - max(lo, self.numel), dtype))
        if not pieces:
            return np.zeros(hi - lo, dtype)
        return np.concatenate(pieces, dtype=dtype, casting="unsafe")

    def blank(self, dtype) -> np.ndarray:
        """(padded,) buffer whose real elements are unset (np.empty) and padding zero, for a
        caller that writes every real element next."""
        flat = np.empty(self.padded, dtype=dtype)
        flat[self.numel :] = 0
        return flat

    def views(self, flat: np.ndarray) -> dict:
        """{name: view of flat with the parameter's shape} (writes go to the buffer)."""
        slots = self.slots
        return {n: flat[slots[n]].reshape(s) for n, s in zip(self.names, self.shapes)}


def make_layout(index: int, shapes: dict, D: int) -> FlatLayout:
    names = tuple(shapes)
    sizes = [math.prod(shapes[n]) for n in names]
    offsets = tuple(int(o) for o in itertools.accumulate(sizes[:-1], initial=0)) if names else ()
    numel = int(sum(sizes))
    padded = -(-max(numel, 1) // D) * D  # ceil to a multiple of D (never empty)
    return FlatLayout(index, names, tuple(shapes[n] for n in names), offsets, numel, padded, D)


def make_buckets(shapes: dict, D: int, bucket_cap_mb: float, itemsize: int) -> list:
    """PyTorch's rule: reverse order, close a bucket once it holds >= cap bytes."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 (megabytes per bucket), got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    groups, cur, nbytes = [], {}, 0
    for name in reversed(list(shapes)):
        cur[name] = shapes[name]
        nbytes += math.prod(shapes[name]) * itemsize
        if nbytes >= cap:
            groups.append(cur)
            cur, nbytes = {}, 0
    if cur:
        groups.append(cur)
    return [make_layout(i, g, D) for i, g in enumerate(groups)]


def fsdp_units(shapes: dict, D: int) -> list:
    """One unit per transformer block, plus a root unit (embeddings, final norm, head), in
    forward order: root first (its embedding runs first), then blocks.0 .. blocks.L-1."""
    units: dict[str, dict] = {"root": {}}
    for name, shape in shapes.items():
        key = ".".join(name.split(".")[:2]) if name.startswith("blocks.") else "root"
        units.setdefault(key, {})[name] = shape
    return [make_layout(i, g, D) for i, g in enumerate(units.values())]


def unit_of(layouts: list) -> dict:
    """{parameter name: its layout}."""
    return {n: lay for lay in layouts for n in lay.names}


class GradAccumulator:
    """Full (padded) flat gradient buffers per layout, filled as the backward produces grads.

    `add` sums a gradient into its slot (in the arithmetic dtype, stored in the buffer's dtype,
    as the reference accumulates micro-batches) and returns the layout when its last gradient of
    this micro-batch has arrived - the moment DDP / ZeRO-2 / FSDP launch its collective.
    A buffer is a sum that starts at zero, but it is not filled with zeros (np.zeros: a memset
    of Psi elements per rank and step, and a read of them): its first micro-batch stores
    g + 0.0 - the bits of 0 + g, as IEEE addition commutes (-0.0 becomes +0.0 either way).
    """

    def __init__(self, layouts: list, dtype):
        self.layouts, self.dtype = layouts, np.dtype(dtype)
        self.in_place = arith_dtype(self.dtype) == self.dtype  # no up/down cast (not bf16)
        self.of = unit_of(layouts)
        self.flats: dict[int, np.ndarray] = {}
        self.seen: dict[int, set] = {}
        self.fresh: set = set()  # layouts whose buffer is in its first micro-batch

    def add(self, name: str, grad) -> FlatLayout | None:
        lay = self.of.get(name)
        if lay is None:
            raise KeyError(f"gradient for {name!r}, which is not a parameter of this group")
        seen = self.seen.setdefault(lay.index, set())
        if name in seen:
            raise ValueError(f"gradient of {name!r} arrived twice in one micro-batch")
        seen.add(name)
        flat = self.flats.get(lay.index)
        if flat is None:  # zeros, but for the real elements, which the first pass sets
            flat = self.flats[lay.index] = lay.blank(self.dtype)
            self.fresh.add(lay.index)
        s, g = lay.slots[name], np.asarray(grad).reshape(-1)
        first = lay.index in self.fresh  # the slot stands for zeros: 0 + g, as g + 0.0
        if self.in_place and g.dtype == self.dtype:  # float32/64: the same sum, in place
            if first:
                np.add(g, 0.0, out=flat[s])
            else:
                np.add(flat[s], g, out=flat[s])
        else:  # bf16: fp32 arithmetic, stored back as bf16
            flat[s] = down(up(g) + 0.0 if first else up(flat[s]) + up(g), self.dtype)
        if len(seen) < len(lay.names):
            return None
        del self.seen[lay.index]  # complete: the next micro-batch starts afresh
        self.fresh.discard(lay.index)
        return lay

    def pop(self, index: int) -> np.ndarray:
        return self.flats.pop(index)


class FlatGrads:
    """A group of one's summed gradients laid out as its layouts (D = 1: no padding), in buffers
    reused every step: one copy per bucket, so AdamW runs per bucket (parallel/data/replica.py)
    instead of once per tensor (69 at H 64: 0.9 ms against 0.3 ms per rank, copy included)."""

    def __init__(self, layouts: list):
        self.layouts, self.flats = layouts, [None] * len(layouts)

    def gather(self, grads: dict) -> list:
        """[flat gradient per layout] from {name: gradient}, in the gradients' own dtype."""
        for i, lay in enumerate(self.layouts):
            (dt,) = {grads[n].dtype for n in lay.names}  # one dtype, as DDP's buckets have
            flat = self.flats[i]
            if flat is None or flat.dtype != dt:
                flat = self.flats[i] = lay.blank(dt)
            np.concatenate([np.ravel(grads[n]) for n in lay.names], out=flat[: lay.numel])
        return list(self.flats)
