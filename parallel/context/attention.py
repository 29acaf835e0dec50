"""Context-parallel attention core, a drop-in for emulator.ops.attention_forward / backward:

    o, cache = cp_attention_forward(cp_comm, q, k, v, n_heads, positions=table, method="ring")
    dq, dk, dv = cp_attention_backward(do, cache)

on each cp rank's local (B, S_local, H_local) tensors (heads already split by tensor parallelism,
if any). ``positions`` is the (C, S_local) table of every cp rank's global positions
(layout.table); the causal mask comes from it. Methods: "ring" (ring.py), "all-gather"
(allgather.py), "ulysses" (ulysses.py); keep_probs as in ops (False = selective recompute).
Traffic is tagged "cp-attn/fwd" and "cp-attn/bwd" inside the caller's scopes (cost.py has it).
Each call is one checked collective "cp_attention" on the cp group: ranks that disagree on the
method, the shapes, the heads or the positions table raise CollectiveMismatch instead of hanging.
"""

from __future__ import annotations

import zlib

import numpy as np

from emulator.memory import saved_nbytes
from emulator.rank import scope
from parallel.context.allgather import allgather_backward, allgather_forward
from parallel.context.layout import check_table
from parallel.context.ring import ring_backward, ring_forward
from parallel.context.ulysses import ulysses_backward, ulysses_forward

METHODS = ("ring", "all-gather", "ulysses")
_IMPL = {
    "ring": (ring_forward, ring_backward),
    "all-gather": (allgather_forward, allgather_backward),
    "ulysses": (ulysses_forward, ulysses_backward),
}


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"context parallel: method={method!r} must be one of {METHODS}")
    return method


def cp_attention_forward(cp_comm, q, k, v, n_heads, *, positions, method="ring", keep_probs=True):
    """q, k, v (B, S_local, H_local) of this cp rank -> (o (B, S_local, H_local), cache)."""
    check_method(method)
    q, k, v = (np.asarray(t) for t in (q, k, v))
    if not (q.shape == k.shape == v.shape) or q.ndim != 3:
        raise ValueError(
            f"context parallel: q, k, v must share one (B, S_local, H) shape; got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if q.shape[-1] % n_heads:
        raise ValueError(f"attention: H_local={q.shape[-1]} not divisible by n_heads={n_heads}")
    pos, digest = _table(positions, cp_comm.size, q.shape[1])
    fwd, _ = _IMPL[method]
    extra = f"forward, heads={n_heads}, keep_probs={keep_probs}, {digest}"
    with scope("cp-attn/fwd"), cp_comm.collective("cp_attention", method, q, extra=extra):
        o, inner = fwd(cp_comm, q, k, v, n_heads, pos, keep_probs=keep_probs)
    return o, {"method": method, "inner": inner, "positions": pos, "comm": cp_comm,
               "digest": digest}  # fmt: skip


def cp_attention_backward(do, cache):
    """-> (dq, dk, dv), each (B, S_local, H_local), this rank's tokens."""
    method, comm = cache["method"], cache["comm"]
    _, bwd = _IMPL[method]
    extra = f"backward, {cache['digest']}"
    with scope("cp-attn/bwd"), comm.collective("cp_attention", method, do, extra=extra):
        return bwd(do, cache["inner"])


_TABLES: dict = {}  # (C, S_local, shape, dtype, bytes) -> the digest of a table that passed
_MAX_TABLES = 64


def _table(positions, C: int, s_local: int) -> tuple:
    """(check_table(positions, C, s_local), its _digest): every layer of every step passes the
    same table, so a table that passed once is looked up by its bytes, not sorted and hashed
    again (a table that fails is never kept: it raises the same error each time)."""
    pos = np.asarray(positions)
    key = (C, s_local, pos.shape, pos.dtype.str, pos.tobytes())
    digest = _TABLES.get(key)
    if digest is not None:
        return pos.astype(np.int64, copy=False), digest
    pos = check_table(pos, C, s_local)
    digest = _digest(pos)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    _TABLES[key] = digest
    return pos, digest


def _digest(pos) -> str:
    """The positions table in a few characters, so ranks with different tables disagree."""
    return f"positions {pos.shape} crc {zlib.crc32(np.ascontiguousarray(pos).tobytes()):08x}"


def cache_nbytes(cache) -> int:
    """Bytes the attention cache holds for the backward (the positions table excluded: static
    metadata); cost.cache_nbytes gives the same number by formula."""
    return saved_nbytes(cache, exclude=(cache["positions"],))
