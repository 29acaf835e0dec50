"""Attention of a block of queries on a block of keys, masked by GLOBAL positions.

Shape letters: B batch, A heads (local), Sq queries in the block, Sk keys in the block,
D head dim. Query at global position i may see key at global position j iff j <= i (causal), so
the mask of any pair of blocks - whatever positions the ranks hold - comes from the positions,
never from local indices. Everything here is in the arithmetic dtype (precision.up).
"""

from __future__ import annotations

import math

import numpy as np

from emulator.ops import _heads as heads  # noqa: F401 - (B, S, H) -> (B, A, S, D), as ops does
from emulator.ops import _merge as merge  # noqa: F401 - (B, A, S, D) -> (B, S, H)


def visible(qpos, kpos) -> np.ndarray:
    """(Sq, Sk) bool: key j visible to query i under the causal mask of global positions."""
    return kpos[None, :] <= qpos[:, None]


def scores(qh, kh, qpos, kpos) -> np.ndarray:
    """q k^T / sqrt(D), -inf where masked -> (B, A, Sq, Sk)."""
    return block_scores(qh, kh, ~visible(qpos, kpos))


def block_scores(qh, kh, hidden) -> np.ndarray:
    """q k^T / sqrt(D), -inf where hidden (Sq, Sk) bool is True; hidden=None: nothing masked."""
    s = qh @ kh.transpose(0, 1, 3, 2)  # (B, A, Sq, Sk)
    s *= 1.0 / math.sqrt(qh.shape[-1])
    if hidden is not None:
        s[..., hidden] = -np.inf
    return s


def softmax_rows(s) -> np.ndarray:
    """In-place softmax over the keys of scores whose every row has a visible key."""
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s


def probs_backward(p, qh, kh, vh, doh, delta=None):
    """Gradients of one block given its (globally normalised) probabilities p (B, A, Sq, Sk).

    delta (B, A, Sq) = sum_j p_ij dp_ij over ALL keys of row i; when the block holds every key
    of its rows it can be computed here (delta=None), otherwise the caller passes
    rowsum(dO * O), which is the same number (Dao et al. 2022, FlashAttention, appendix B).
    -> (dq (B, A, Sq, D), dk (B, A, Sk, D), dv (B, A, Sk, D)).
    """
    dv = p.transpose(0, 1, 3, 2) @ doh  # (B, A, Sk, D)
    dp = doh @ vh.transpose(0, 1, 3, 2)  # (B, A, Sq, Sk)
    if delta is None:
        delta = (dp * p).sum(axis=-1)
    ds = np.subtract(dp, delta[..., None], out=dp)  # softmax backward p (dp - delta), in dp's
    ds *= p  # buffer (x * p = p * x bitwise); masked p = 0
    ds *= 1.0 / math.sqrt(doh.shape[-1])
    return ds @ kh, ds.transpose(0, 1, 3, 2) @ qh, dv
