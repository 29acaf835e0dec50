"""Sequence parallelism: the regions tensor parallelism leaves replicated, cut along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2. LayerNorms, bias adds and residual adds are pointwise along the sequence, so
between the tensor-parallel blocks each of the R ranks keeps only its S/R consecutive positions.
At the boundaries the paper's conjugate pair g / g-bar replaces Megatron's f / g:

    entering a TP block   g      forward: all-gather along S    backward: reduce-scatter
    leaving a TP block    g-bar  forward: reduce-scatter along S  backward: all-gather

An all-reduce is a reduce-scatter plus an all-gather, so g and g-bar move exactly the bytes of
the four all-reduces, 8 (R-1)/R B S H w per layer per micro-batch, and every activation outside
the TP blocks shrinks by R. The inputs of the column-parallel linears (LN outputs, gathered to
(B, S, H)) are still needed by the backward. Keeping the gathered copies (``regather=False``)
leaves those two tensors at full S: the same bytes as TP, less memory. Megatron's default
(section 4.2.2: store only this rank's sequence slice of such an input and all-gather it again in
the backward) adds 2 all-gathers per layer, (R-1)/R B S H w each (+25% bytes), for every
activation at S/R. parallel/tensor/cost.py counts all three; examples/04 shows them side by
side, measured.

Layout: activations are (B, S, H) and the collectives cut axis 1 (``axis=1``: the ring steps on
the strided (B, S/R, H) chunks, the same messages and bytes as the axis-0 call on the (S, B, H)
transpose, with no transposed copies); rank r owns positions r*S/R .. (r+1)*S/R - 1.
The LayerNorm (and row-parallel bias, and position-embedding) gradients of a rank cover only its
positions, so after the backward they are summed over the group: ``reduce_partial_grads``.
Shape letters: B batch, S full sequence, H d_model, R the tensor-parallel group size;
w the itemsize of the activations.
"""

from __future__ import annotations

import numpy as np

from collectives.api import all_gather, all_reduce, reduce_scatter


def check_sequence(S: int, R: int) -> None:
    if S % R:
        raise ValueError(
            f"sequence parallelism cuts the sequence into {R} equal parts, but S={S} is not "
            f"divisible by {R}; use a sequence length that is a multiple of the tp degree"
        )


def seq_slice(S: int, R: int, rank: int) -> slice:
    """The positions rank ``rank`` owns between the tensor-parallel blocks."""
    check_sequence(S, R)
    n = S // R
    return slice(rank * n, (rank + 1) * n)


def scatter_seq(x: np.ndarray, R: int, rank: int) -> np.ndarray:
    """No communication: this rank's positions of a tensor every rank holds in full."""
    return x[:, seq_slice(x.shape[1], R, rank)]


def gather_seq(tp, x: np.ndarray) -> np.ndarray:
    """All-gather along the sequence: (B, S/R, H) on each rank -> (B, S, H) on every rank."""
    return all_gather(tp, x, axis=1)  # (B, S, H), contiguous: the ring steps on strided chunks


def reduce_scatter_seq(tp, x: np.ndarray) -> np.ndarray:
    """Reduce-scatter along the sequence: partial sums (B, S, H) -> this rank's (B, S/R, H)."""
    check_sequence(x.shape[1], tp.size)
    return reduce_scatter(tp, x, axis=1)  # (B, S/R, H), contiguous


def partial_grad_names(names) -> list[str]:
    """Replicated parameters whose gradient is partial under SP (computed on S/R positions):
    LayerNorms, the biases of row-parallel layers (added after the reduce-scatter), the position
    table. An MoE block's router and expert biases are not: they see the all-gathered sequence."""
    leaves = ("ln1.gain", "ln1.bias", "ln2.gain", "ln2.bias", "attn.bo", "mlp.b2")
    top = ("embed.pos", "final_ln.gain", "final_ln.bias")
    return [n for n in names if n in top or n.endswith(leaves)]


def reduce_partial_grads(tp, grads: dict) -> dict:
    """Sum the SP-partial gradients over the group with one flat all-reduce (a bucket)."""
    names = partial_grad_names(grads)
    if not names:
        return grads
    flat = np.concatenate([grads[n].reshape(-1) for n in names])  # (n_sp,)
    total = all_reduce(tp, flat, algorithm="ring")
    out, off = dict(grads), 0
    for n in names:
        k = grads[n].size
        out[n] = total[off : off + k].reshape(grads[n].shape)
        off += k
    return out
