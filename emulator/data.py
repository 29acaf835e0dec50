"""A deterministic, learnable synthetic task and batch splitting.

Delayed copy: tokens are uniform random ids; the target at position s is the token ``lag``
positions back (position 0 for s < lag). Causal attention can see the answer at every position,
so a tiny model drives the loss from log V towards 0 - it must learn to attend by relative
position, which exercises attention, not just the embeddings.
"""

from __future__ import annotations

import numpy as np


def synthetic_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int, lag=2):
    """-> (tokens, targets), int64 (B, S); a pure function of (seed, step) and the shape."""
    if min(batch_size, seq_len, vocab_size) < 1 or lag < 0:
        raise ValueError(f"synthetic_batch: bad sizes B={batch_size} S={seq_len} V={vocab_size}")
    rng = np.random.default_rng([seed, step])
    tokens = rng.integers(0, vocab_size, (batch_size, seq_len), dtype=np.int64)
    src = np.maximum(np.arange(seq_len) - lag, 0)  # (S,) position each target copies from
    return tokens, tokens[:, src]


def split_microbatches(tokens, targets, n: int):
    """Split the batch axis into ``n`` equal consecutive micro-batches -> list of (tok, tgt)."""
    B = tokens.shape[0]
    if n < 1 or B % n:
        raise ValueError(f"cannot split a batch of B={B} into {n} equal micro-batches")
    b = B // n
    return [(tokens[i * b : (i + 1) * b], targets[i * b : (i + 1) * b]) for i in range(n)]


def shard_batch(tokens, targets, rank: int, world_size: int):
    """The data-parallel shard of ``rank``: consecutive rows B/world_size each."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    return split_microbatches(tokens, targets, world_size)[rank]
