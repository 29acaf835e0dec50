"""Bitwise fingerprints of the model step, to compare two trees: `bench model --digest`.

A speed change to emulator/ops.py, block.py or moe.py must leave every result bit-for-bit the
same. This prints one SHA-256 per case - the loss, every gradient and the parameters after two
AdamW steps, as raw bytes - for float64 / float32 / mixed x recompute none / selective / full x
dense / MoE (top-2 with dropped tokens and two routing groups), at a small shape and at the
benchmark's shape. Run it in both trees and compare the lines:

    python -m emulator bench model --digest > new.txt
    (cd OLD_TREE && python -m emulator bench model --digest) > old.txt && diff old.txt new.txt

The digests are of this machine's BLAS and CPU (another machine may round a matmul otherwise), so
they compare two trees on one machine; they are not golden values for a test.
"""

from __future__ import annotations

import hashlib

import numpy as np

from emulator.data import synthetic_batch
from emulator.model import ModelConfig, init_params, model_backward, model_forward
from emulator.optim import AdamW
from emulator.precision import DTYPES

SMALL = {"vocab_size": 61, "max_seq_len": 24, "d_model": 32, "n_heads": 4, "n_layers": 2}
MOE = {"n_experts": 4, "moe_top_k": 2, "capacity_factor": 0.75}
RECOMPUTE = ("none", "selective", "full")


def step_digest(cfg: ModelConfig, batch: int, recompute: str, groups=None) -> str:
    """SHA-256 (16 hex digits) of two steps' losses, the gradients and the parameters."""
    params = init_params(cfg, 0)
    opt = AdamW(params)
    h = hashlib.sha256()
    for step in range(2):
        tokens, targets = synthetic_batch(0, step, batch, cfg.max_seq_len, cfg.vocab_size)
        loss, cache = model_forward(params, tokens, targets, cfg, recompute=recompute,
                                    groups=groups)  # fmt: skip
        grads = model_backward(cache)
        h.update(np.float64(loss).tobytes())
        for n in grads:
            h.update(n.encode() + np.ascontiguousarray(grads[n]).tobytes())
        opt.step(params, grads)
    for n, p in params.items():
        h.update(n.encode() + p.tobytes())
    return h.hexdigest()[:16]


def cases():
    """(label, cfg, batch, recompute, groups) for every case the digest covers."""
    B, S = 3, SMALL["max_seq_len"]
    halves = [np.arange(0, B * S, 2), np.arange(1, B * S, 2)]  # two routing groups
    for dt in DTYPES:
        for rc in RECOMPUTE:
            yield f"small dense {dt} {rc}", ModelConfig(**SMALL, dtype=dt), B, rc, None
            yield f"small moe   {dt} {rc}", ModelConfig(**SMALL, **MOE, dtype=dt), B, rc, halves
    from benchmarks.model import SHAPE

    for dt in DTYPES:
        for rc in ("none", "selective"):
            yield f"bench dense {dt} {rc}", ModelConfig(**SHAPE, dtype=dt), 8, rc, None


def main() -> int:
    total = hashlib.sha256()
    for label, cfg, batch, rc, groups in cases():
        d = step_digest(cfg, batch, rc, groups)
        total.update(d.encode())
        print(f"{label:32s} {d}", flush=True)
    print(f"{'all':32s} {total.hexdigest()[:16]}")
    return 0
