"""The functional API, torch.distributed-like: `comm` first, new arrays out, inputs untouched.

    y = all_reduce(comm, x, op="sum", algorithm="auto")     # every rank: the reduction
    y = reduce_scatter(comm, x, op="sum", axis=0)            # rank r: chunk r of axis `axis`
    y = all_gather(comm, x, sizes=None, axis=0)              # concat along axis `axis`
    y = broadcast(comm, x, root=0, out=None)                 # out=: into the caller's buffer
    y = reduce(comm, x, root=0, op="sum")                    # None off root
    y = all_to_all(comm, x); ys = all_to_allv(comm, [x_to_0, x_to_1, ...], recv_counts=None)
    y = gather(comm, x, root=0, sizes=None); y = scatter(comm, chunks, root=0, shape=, dtype=)
    barrier(comm)

Chunking: axis 0 (rows; or reduce_scatter's / all_gather's `axis=`) is split like np.array_split -
with n rows over p ranks the first n % p ranks get one extra row; an all-reduce chunks the
flattened array the same way.
Every call runs inside `comm.collective(op, algorithm, array, extra)`: the ledger labels its
bytes and all ranks are checked to issue the same call (op, algorithm, shape, dtype, extra).
Calls whose inputs legitimately differ per rank (all_to_allv, uneven gathers) check array=None
and put the agreed parameters in `extra` instead. Byte counts: cost.py. Ops/dtypes: ops.py.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from . import alltoall, cost, double_tree, ring, tree
from .ops import check_dtype, check_op, finalize


def _array(x, what: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype not in _DTYPES:  # a dtype check_dtype passed once passes again
        check_dtype(x.dtype, what)
        _DTYPES.add(x.dtype)
    return x


def _op(op: str, dtype, what: str) -> None:
    """check_op(op, dtype, what), skipped for an (op, dtype) pair that passed it before (its
    outcome depends on the pair only: `what` is the error text's prefix)."""
    try:
        if (op, dtype) in _CHECKED:
            return
    except TypeError:  # an unhashable op: the check names it
        pass
    check_op(op, dtype, what)
    _CHECKED.add((op, dtype))


def _flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1)  # a view when x is contiguous; never written


def _choose(what: str, algorithm: str, allowed) -> str:
    if algorithm not in allowed:
        raise ValueError(f"{what}: unknown algorithm {algorithm!r}; choose one of {allowed}")
    return algorithm


def _root(comm, root, what: str) -> int:
    if not isinstance(root, (int, np.integer)) or not 0 <= root < comm.size:
        raise ValueError(
            f"{what}: root {root!r} is not a rank of group {comm.name!r} of size {comm.size}; "
            f"use 0..{comm.size - 1}"
        )
    return int(root)


def _rows(x: np.ndarray, what: str) -> int:
    if x.ndim == 0:
        raise ValueError(f"{what}: needs at least one axis (it splits axis 0); got a 0-d array")
    return x.shape[0]


_ALL_REDUCE = {
    "ring": ring.all_reduce,
    "tree": tree.all_reduce,
    "double_tree": double_tree.all_reduce,
}
_CHECKED: set = set()  # (op, dtype) pairs check_op passed: a repeated call skips the checks
_DTYPES: set = set()  # dtypes check_dtype passed


def all_reduce(comm, x, op: str = "sum", algorithm: str = "auto") -> np.ndarray:
    """Every rank gets the elementwise reduction. Algorithms: "ring", "tree" (binomial),
    "double_tree" (NCCL's two binary trees), "auto" = cost.auto_all_reduce (ring or tree)."""
    x = np.asarray(x)
    try:
        checked = (op, x.dtype) in _CHECKED
    except TypeError:  # an unhashable op: the checks name it
        checked = False
    if not checked:
        check_dtype(x.dtype, "all_reduce")
        check_op(op, x.dtype, "all_reduce")
        _CHECKED.add((op, x.dtype))
    algo = _choose("all_reduce", algorithm, ("auto", "ring", "tree", "double_tree"))
    if algo == "auto":
        algo = cost.auto_all_reduce(x.nbytes, comm.size)
    with comm.collective("all_reduce", algo, x, extra=f"op={op}"):
        if comm.world_size == 1:
            return x.copy()
        if x.ndim == 1 and x.flags.c_contiguous:  # the flat array already: no views to make
            return _ALL_REDUCE[algo](comm, x, op)
        return _ALL_REDUCE[algo](comm, _flat(x), op).reshape(x.shape)


def reduce_scatter(comm, x, op: str = "sum", algorithm: str = "ring", axis: int = 0):
    """Reduce, and keep rows chunk `rank` of axis 0: (n,...) -> (counts[rank], ...).

    ``axis``: the axis to cut instead (negative counts from the end, as in NumPy): rank r
    keeps np.array_split(total, p, axis)[r], a new C-contiguous array. The same messages and
    bytes as the axis-0 call on np.moveaxis(x, axis, 0) (the ring steps on strided chunks; no
    transpose of the whole array), bitwise the same values; the call check includes the axis
    (in `extra`, only when it is not 0, so axis-0 records are unchanged)."""
    x = _array(x, "reduce_scatter")
    _op(op, x.dtype, "reduce_scatter")
    algo = _choose("reduce_scatter", algorithm, ("ring",))
    if axis and (a := _axis(axis, x, "reduce_scatter")):  # (a negative axis may name 0)
        return _reduce_scatter_axis(comm, x, op, algo, a)
    rows, rest = _rows(x, "reduce_scatter"), x.shape[1:]
    with comm.collective("reduce_scatter", algo, x, extra=f"op={op}"):
        rc = cost.chunk_counts(rows, comm.size)
        k = math.prod(rest)  # elements per row (shape entries are ints: exact)
        counts = [c * k for c in rc]
        out = ring.reduce_scatter(comm, _flat(x), counts, op)
        return finalize(op, out, comm.size).reshape((rc[comm.rank], *rest))


def all_gather(comm, x, algorithm: str = "ring", sizes=None, axis: int = 0) -> np.ndarray:
    """Concatenate every rank's x along axis 0. Uneven row counts: pass sizes[j] = rows of j.

    ``axis``: concatenate along that axis instead (negative counts from the end, as in NumPy;
    sizes[j] is then rank j's length along it): np.concatenate(xs, axis), a new C-contiguous
    array. The same messages and bytes as the axis-0 call on np.moveaxis(x, axis, 0), no
    transposes; the call check includes the axis (in `extra`, only when it is not 0)."""
    x = _array(x, "all_gather")
    algo = _choose("all_gather", algorithm, ("ring",))
    if axis and (a := _axis(axis, x, "all_gather")):  # (a negative axis may name 0)
        return _all_gather_axis(comm, x, algo, sizes, a)
    rows, rest = _rows(x, "all_gather"), x.shape[1:]
    rs = _sizes(comm, sizes, rows, "all_gather")
    arr, extra = (x, "") if sizes is None else (None, f"{x.dtype}, row={rest}, sizes={rs}")
    with comm.collective("all_gather", algo, arr, extra=extra):
        k = math.prod(rest)
        counts = (rows * k,) * comm.world_size if sizes is None else [s * k for s in rs]
        out = ring.all_gather(comm, _flat(x), counts)
        return out.reshape((sum(rs), *rest))


def _axis(axis, x: np.ndarray, what: str) -> int:
    """axis normalised to 0..ndim-1 (NumPy's rule for negative axes), or a ValueError."""
    try:
        a = operator.index(axis)
    except TypeError:
        raise ValueError(f"{what}: axis must be an integer; got {axis!r}") from None
    if not -x.ndim <= a < x.ndim:
        use = f"use {-x.ndim}..{x.ndim - 1}" if x.ndim else "it needs at least one axis"
        raise ValueError(f"{what}: axis {a} is out of range for an array with ndim {x.ndim}; {use}")
    return a % x.ndim


def _split3(x: np.ndarray, axis: int):
    """x as (pre, n, post) around `axis` (a view when x's layout allows, as reshape gives)."""
    sh = x.shape
    return x.reshape(math.prod(sh[:axis]), sh[axis], math.prod(sh[axis + 1 :])), sh


def _reduce_scatter_axis(comm, x, op: str, algo: str, axis: int) -> np.ndarray:
    with comm.collective("reduce_scatter", algo, x, extra=f"op={op}, axis={axis}"):
        x3, sh = _split3(x, axis)
        rc = cost.chunk_counts(sh[axis], comm.size)
        out = ring.reduce_scatter_rows(comm, x3, rc, op)
        out = finalize(op, out, comm.size)
        return out.reshape((*sh[:axis], rc[comm.rank], *sh[axis + 1 :]))


def _all_gather_axis(comm, x, algo: str, sizes, axis: int) -> np.ndarray:
    sh = x.shape
    rest = sh[:axis] + sh[axis + 1 :]
    rs = _sizes(comm, sizes, sh[axis], "all_gather", axis)
    arr, extra = (
        (x, f"axis={axis}")
        if sizes is None
        else (None, f"{x.dtype}, row={rest}, sizes={rs}, axis={axis}")
    )
    with comm.collective("all_gather", algo, arr, extra=extra):
        x3, _ = _split3(x, axis)
        out = ring.all_gather_rows(comm, x3, rs)
        return out.reshape((*sh[:axis], sum(rs), *sh[axis + 1 :]))


def _sizes(comm, sizes, rows: int, what: str, axis: int = 0) -> list[int]:
    if sizes is None:
        return [rows] * comm.size
    sizes = [int(s) for s in sizes]
    if len(sizes) != comm.size or min(sizes) < 0:
        raise ValueError(
            f"{what}: sizes must list {comm.size} non-negative row counts; got {sizes}"
        )
    if sizes[comm.rank] != rows:
        raise ValueError(
            f"{what}: rank {comm.rank} has {rows} rows but sizes[{comm.rank}] = "
            f"{sizes[comm.rank]}; sizes must be every rank's axis-{axis} length"
        )
    return sizes


def broadcast(comm, x, root: int = 0, algorithm: str = "tree", out=None) -> np.ndarray:
    """Every rank gets root's x. Non-roots pass an array of the same shape/dtype (ignored).
    ``out``: a C-contiguous ndarray of x's shape and dtype that receives it (and is returned)
    instead of a new array; x itself may be it (the root's x then moves with no copy)."""
    x = _array(x, "broadcast")
    root = _root(comm, root, "broadcast")
    algo = _choose("broadcast", algorithm, ("tree",))
    if out is not None and (  # (a subclass's layout is its own: the dry run's arrays have none)
        not isinstance(out, np.ndarray)
        or out.shape != x.shape
        or out.dtype != x.dtype
        or not (out.flags.c_contiguous or type(out) is not np.ndarray)
    ):
        raise ValueError(
            f"broadcast: out must be a C-contiguous ndarray of x's shape {x.shape} and dtype "
            f"{x.dtype}; got {type(out).__name__} {getattr(out, 'dtype', '')}"
            f"{list(getattr(out, 'shape', ()))}"
        )
    with comm.collective("broadcast", algo, x, extra=f"root={root}"):
        if out is None:
            return tree.broadcast(comm, _flat(x), root).reshape(x.shape)
        tree.broadcast(comm, _flat(x), root, out=out.reshape(-1))
        return out


def reduce(comm, x, root: int = 0, op: str = "sum", algorithm: str = "tree"):
    """The reduction on root (a new array); None on the other ranks."""
    x = _array(x, "reduce")
    _op(op, x.dtype, "reduce")
    root = _root(comm, root, "reduce")
    algo = _choose("reduce", algorithm, ("tree",))
    with comm.collective("reduce", algo, x, extra=f"op={op}, root={root}"):
        out = tree.reduce(comm, _flat(x), op, root)
        return None if out is None else finalize(op, out, comm.size).reshape(x.shape)


def all_to_all(comm, x, algorithm: str = "pairwise") -> np.ndarray:
    """Axis 0 in p equal blocks; block j goes to rank j; block j of the result came from j."""
    x = _array(x, "all_to_all")
    algo = _choose("all_to_all", algorithm, ("pairwise",))
    if _rows(x, "all_to_all") % comm.size:
        raise ValueError(
            f"all_to_all: axis 0 has {x.shape[0]} rows, not divisible by the group size "
            f"{comm.size}; pad it, or use all_to_allv with per-rank lists"
        )
    with comm.collective("all_to_all", algo, x):
        return alltoall.all_to_all(comm, np.ascontiguousarray(x))


def all_to_allv(comm, sends, recv_counts=None, algorithm: str = "pairwise") -> list:
    """sends[j]: rows for rank j, (rows_j, *row); all share dtype and row shape. Returns a list
    whose entry j is what rank j sent here. recv_counts=None: the row counts are first
    exchanged with a counted int64 all-to-all (8 (p-1) bytes each way, see cost.py)."""
    algo = _choose("all_to_allv", algorithm, ("pairwise",))
    sends = [_array(s, "all_to_allv") for s in sends]
    if len(sends) != comm.size:
        raise ValueError(f"all_to_allv: give one array per rank ({comm.size}); got {len(sends)}")
    row, dtype = sends[0].shape[1:], sends[0].dtype
    for j, s in enumerate(sends):
        if s.ndim == 0 or s.shape[1:] != row or s.dtype != dtype:
            raise ValueError(
                f"all_to_allv: sends[{j}] is {s.dtype}{list(s.shape)} but sends[0] is "
                f"{dtype}{list(sends[0].shape)}; every block needs the same dtype and row shape"
            )
    how = "exchanged" if recv_counts is None else "given"
    with comm.collective("all_to_allv", algo, None, extra=f"{dtype}, row={row}, counts {how}"):
        if recv_counts is None:
            recv_counts = alltoall.exchange_counts(comm, [s.shape[0] for s in sends])
        return alltoall.all_to_allv(comm, sends, [int(c) for c in recv_counts], row, dtype)


def gather(comm, x, root: int = 0, sizes=None):
    """Concatenation along axis 0 on root (None elsewhere); uneven rows via sizes."""
    x = _array(x, "gather")
    root = _root(comm, root, "gather")
    rs = _sizes(comm, sizes, _rows(x, "gather"), "gather")
    arr, extra = (x, "") if sizes is None else (None, f"{x.dtype}, row={x.shape[1:]}, sizes={rs}")
    with comm.collective("gather", "linear", arr, extra=f"root={root}, {extra}"):
        return alltoall.gather(comm, x, rs, root)


def scatter(comm, chunks, root: int = 0, shape=None, dtype=None) -> np.ndarray:
    """Rank j gets chunks[j] of root's list of p equal-shape arrays. Non-roots pass chunks=None
    with the chunk's shape and dtype (like torch's preallocated output)."""
    root = _root(comm, root, "scatter")
    if comm.rank == root:
        chunks = [_array(c, "scatter") for c in chunks]
        if len(chunks) != comm.size or any(
            c.shape != chunks[0].shape or c.dtype != chunks[0].dtype for c in chunks
        ):
            raise ValueError(
                f"scatter: root needs {comm.size} chunks of one shape and dtype; got "
                f"{[f'{c.dtype}{list(c.shape)}' for c in chunks]}"
            )
        shape, dtype = chunks[0].shape, chunks[0].dtype
    elif shape is None or dtype is None:
        raise ValueError("scatter: non-root ranks must pass shape= and dtype= of their chunk")
    shape, dtype = tuple(int(s) for s in np.atleast_1d(shape)), check_dtype(dtype, "scatter")
    with comm.collective("scatter", "linear", None, extra=f"root={root}, {dtype}{list(shape)}"):
        return alltoall.scatter(comm, chunks, shape, dtype, root)


def barrier(comm) -> None:
    """A counted barrier: dissemination rounds of 1-byte tokens (cost.dissemination_barrier)."""
    with comm.collective("barrier", "dissemination"):
        alltoall.barrier(comm)
