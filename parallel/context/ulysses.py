"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling
Training of Extreme Long Sequence Transformer Models"): an all-to-all turns q, k, v
from sequence-sharded (B, S_local, H) into head-sharded (B, S, H / C); each rank runs the
single-rank attention (emulator.ops) on the whole sequence for its A / C heads; an all-to-all
turns the output back. The backward is the same with the roles swapped: dO in, dQ/dK/dV out.

Shape letters: B batch, S global sequence, S_local = S / C, H = A D, Hc = H / C, C cp ranks.
Heads are consecutive D-column blocks (as in ops), so rank j takes heads j A/C .. (j+1) A/C - 1.
The gathered rows are in rank order; a permutation by the positions table puts them in sequence
order, where the single-rank causal attention applies unchanged.
"""

from __future__ import annotations

import numpy as np

from collectives import all_to_all
from emulator.ops import attention_backward, attention_forward


def check_heads(A: int, C: int) -> None:
    if A % C:
        raise ValueError(
            f"ulysses: n_heads={A} is not divisible by cp={C}; every cp rank takes A / cp whole "
            f"heads. Use cp dividing {A}, or method='ring' / 'all-gather'"
        )


def _to_heads(comm, x, order):
    """(B, S_local, H) sequence-sharded -> (B, S, Hc) head-sharded, rows in sequence order."""
    C, (B, S_l, H) = comm.size, x.shape
    blocks = x.reshape(B, S_l, C, H // C).transpose(2, 0, 1, 3)  # (C, B, S_local, Hc): j -> rank j
    y = all_to_all(comm, np.ascontiguousarray(blocks))  # block j: rank j's tokens, my heads
    return y.transpose(1, 0, 2, 3).reshape(B, C * S_l, H // C)[:, order]  # (B, S, Hc)


def _to_sequence(comm, y, flat):
    """(B, S, Hc) head-sharded in sequence order -> (B, S_local, H) sequence-sharded."""
    C, (B, S, Hc) = comm.size, y.shape
    blocks = y[:, flat].reshape(B, C, S // C, Hc).transpose(1, 0, 2, 3)  # j: rank j's tokens
    x = all_to_all(comm, np.ascontiguousarray(blocks))  # (C, B, S_local, Hc): j = head group j
    return x.transpose(1, 2, 0, 3).reshape(B, S // C, C * Hc)


def ulysses_forward(comm, q, k, v, A, pos, *, keep_probs=True):
    """q, k, v (B, S_local, H) of rank r, positions table pos (C, S_local) -> (o, cache)."""
    check_heads(A, comm.size)
    flat = pos.reshape(-1)  # rank-order row i holds global position flat[i]
    order = np.argsort(flat)  # sequence position s sits at rank-order row order[s]
    qs, ks, vs = (_to_heads(comm, t, order) for t in (q, k, v))
    o, inner = attention_forward(qs, ks, vs, A // comm.size, keep_probs=keep_probs)
    return _to_sequence(comm, o, flat), {"inner": inner, "pos": pos, "comm": comm}


def ulysses_backward(do, cache):
    """-> (dq, dk, dv), each (B, S_local, H)."""
    comm, flat = cache["comm"], cache["pos"].reshape(-1)
    dos = _to_heads(comm, do, np.argsort(flat))
    grads = attention_backward(dos, cache["inner"])  # (B, S, Hc) each
    return tuple(_to_sequence(comm, g, flat) for g in grads)
