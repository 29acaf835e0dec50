"""Which global sequence positions each context-parallel rank holds.

Shape letters: B batch, S sequence (global), C = cp ranks, S_local = S / C.

  contiguous  rank r holds positions [r S/C, (r+1) S/C). Under a causal mask rank r's queries see
              r + 1/2 blocks of keys, so the last rank does ~2C-1 times the first rank's work.
  zigzag      the sequence is cut into 2C chunks of S/(2C); rank r holds chunks r and 2C-1-r
              (an early chunk and its mirror), so every rank sees the same number of keys.
              This is the load balancing of Brandon et al. 2023 ("Striped Attention", which
              stripes single tokens; the two-chunk zigzag is the variant Megatron-LM CP and
              ring-flash-attention use).

A rank's positions are kept in increasing order, so its local tokens are a sorted subsequence
of the global sequence; the table of every rank's positions (C, S_local) is static metadata
every rank computes identically (no communication).

With sequence parallelism (Korthikanti et al. 2022, section 4.2.2) on a tp group of t ranks, the
cp rank's S_local tokens are cut again, along its LOCAL sequence axis, as parallel/tensor/
sequence.seq_slice cuts any sequence: tp rank j of cp rank c holds local columns
[j S_local/t, (j+1) S_local/t), i.e. the global positions sp_table(S, C, t)[c, j] =
table(S, C)[c, j S_local/t : (j+1) S_local/t]. Zigzag with t = 2: tp rank 0 holds chunk c,
tp rank 1 its mirror 2C-1-c. The SP all-gather before attention restores exactly the cp rank's
S_local tokens in local order, so cp attention and the MoE routing group (the cp rank's tokens)
are unchanged; the embedding adds the position rows of the (cp, tp) rank's slice.
"""

from __future__ import annotations

import math

import numpy as np

BALANCES = ("contiguous", "zigzag")


def check(S: int, cp: int, balance: str) -> None:
    """Clear errors for a split that cannot be made."""
    if balance not in BALANCES:
        raise ValueError(f"context parallel: balance={balance!r} must be one of {BALANCES}")
    if not isinstance(cp, (int, np.integer)) or cp < 1:
        raise ValueError(f"context parallel: cp={cp!r} must be a positive integer")
    parts = 2 * cp if balance == "zigzag" else cp
    if S < 1 or S % parts:
        why = "2 cp chunks (zigzag)" if balance == "zigzag" else "cp chunks"
        raise ValueError(
            f"context parallel: sequence length S={S} does not split into {parts} equal "
            f"{why} for cp={cp}; use S divisible by {parts}"
            + (" or balance='contiguous'" if balance == "zigzag" and S % cp == 0 else "")
        )


def check_sp(S: int, cp: int, tp: int, balance: str) -> None:
    """cp x sequence parallelism: S into cp ranks (zigzag: 2 cp chunks), then each cp rank's
    S / cp positions into tp equal slices -> S a multiple of lcm(cp tp, 2 cp for zigzag)."""
    parts = 2 * cp if balance == "zigzag" else cp
    need = math.lcm(parts, cp * tp)
    if S < 1 or S % need:
        why = f" and of 2 cp = {parts} (zigzag chunks)" if balance == "zigzag" else ""
        raise ValueError(
            f"context x sequence parallel: S={S} does not split into cp={cp} ranks' S/cp "
            f"positions cut into tp={tp} equal slices; S must be a multiple of cp*tp = "
            f"{cp * tp}{why}: use S divisible by {need}"
        )


def sp_table(S: int, cp: int, tp: int, balance: str = "zigzag") -> np.ndarray:
    """(C, t, S/(C t)) int64: [c, j] = the global positions tp rank j of cp rank c holds
    between the tensor-parallel regions under sequence parallelism (its slice of row c)."""
    check(S, cp, balance)
    check_sp(S, cp, tp, balance)
    return table(S, cp, balance).reshape(cp, tp, S // (cp * tp))


def positions(S: int, cp: int, rank: int, balance: str = "zigzag") -> np.ndarray:
    """The global positions rank `rank` of `cp` holds, increasing -> (S_local,) int64."""
    check(S, cp, balance)
    if not 0 <= rank < cp:
        raise ValueError(f"context parallel: rank {rank} is not in 0..{cp - 1}")
    if balance == "contiguous":
        n = S // cp
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int64)
    c = S // (2 * cp)  # chunk length
    first, mirror = rank, 2 * cp - 1 - rank
    return np.concatenate(
        [np.arange(first * c, (first + 1) * c), np.arange(mirror * c, (mirror + 1) * c)]
    ).astype(np.int64)


def table(S: int, cp: int, balance: str = "zigzag") -> np.ndarray:
    """Every rank's positions -> (C, S_local) int64; row r is positions(S, cp, r, balance)."""
    return np.stack([positions(S, cp, r, balance) for r in range(cp)])


def check_table(pos, cp: int, s_local: int) -> np.ndarray:
    """The positions table an attention call is given: (C, S_local) integers that are a
    permutation of 0..S-1 (every position on exactly one rank)."""
    pos = np.asarray(pos)
    if pos.dtype.kind not in "iu" or pos.shape != (cp, s_local):
        raise ValueError(
            f"context parallel: positions must be the ({cp}, {s_local}) integer table of every "
            f"cp rank's global positions (layout.table(S, cp, balance)); got "
            f"{pos.dtype}{list(pos.shape)}"
        )
    if not np.array_equal(np.sort(pos, axis=None), np.arange(pos.size)):
        raise ValueError(
            "context parallel: the positions table is not a permutation of 0..S-1; every "
            "global position must be held by exactly one cp rank"
        )
    return pos.astype(np.int64, copy=False)


def shard(x, pos_r, axis: int = 1):
    """Rank r's local slice of a global (B, S, ...) array: x[:, pos_r]."""
    return np.take(x, pos_r, axis=axis)


def unshard(parts, pos, axis: int = 1):
    """The global array from every rank's local slice (parts[r] holds positions pos[r])."""
    cat = np.concatenate(parts, axis=axis)
    inv = np.argsort(np.concatenate(list(pos)))  # global position -> index in cat
    return np.take(cat, inv, axis=axis)
