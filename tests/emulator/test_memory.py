"""MemoryLedger semantics, and the activation-byte formulas against the ledger, exactly."""

import numpy as np
import pytest

from emulator import flops
from emulator.memory import CATEGORIES, MemoryLedger, saved_nbytes
from emulator.model import RECOMPUTE, ModelConfig, init_params, model_backward, model_forward


def test_alloc_free_current_peak():
    m = MemoryLedger()
    m.alloc("params", "w", 100)
    m.alloc("activations", "a", 50)
    m.alloc("activations", "b", 30)
    assert m.current() == 180 and m.current("activations") == 80 and m.peak() == 180
    assert m.free("activations", "a") == 50
    m.alloc("grads", "g", 10)
    assert m.current() == 140 and m.peak() == 180 and m.peak("activations") == 80
    m.reset_peak()
    assert m.peak() == 140 and m.peak("activations") == 30
    snap = m.snapshot()
    assert set(snap["current"]) == set(CATEGORIES) == set(snap["peak"])
    assert snap["current"]["params"] == 100 and snap["peak_total"] == 140
    assert m.live("activations") == {"b": 30}


def test_errors_are_loud():
    m = MemoryLedger()
    m.alloc("params", "w", 1)
    with pytest.raises(KeyError, match="double alloc"):
        m.alloc("params", "w", 1)
    with pytest.raises(KeyError, match="not live"):
        m.free("params", "nope")
    with pytest.raises(ValueError, match="non-negative"):
        m.alloc("params", "x", -1)
    with pytest.raises(ValueError, match="unknown memory category"):
        m.alloc("weights", "x", 1)
    m.alloc("grads", "w", 0)  # the same name in another category is a different allocation


def test_saved_nbytes_counts_views_once_and_skips_params():
    a, w = np.zeros((4, 5)), np.ones(3)
    cache = {"x": a, "view": a[1:], "t": (a.T, w), "n": [np.zeros(2, np.float32)], "s": 3.0}
    assert saved_nbytes(cache) == 160 + 24 + 8
    assert saved_nbytes(cache, exclude=[w]) == 160 + 8


CASES = [
    {},
    {"n_experts": 3, "moe_top_k": 2, "capacity_factor": 1.25},
    {"n_experts": 4, "moe_top_k": 1, "capacity_factor": 0.5},
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "mixed"])
@pytest.mark.parametrize("kw", CASES)
def test_activation_formula_equals_ledger(kw, dtype):
    cfg = ModelConfig(
        vocab_size=11, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, dtype=dtype, **kw
    )
    p = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    B, S = 3, 5
    tokens, targets = rng.integers(0, 11, (B, S)), rng.integers(0, 11, (B, S))
    groups = [np.arange(0, 15, 2), np.arange(1, 15, 2)] if cfg.is_moe else None
    sizes = [8, 7] if cfg.is_moe else None
    for mode in RECOMPUTE:
        mem = MemoryLedger()
        _, cache = model_forward(p, tokens, targets, cfg, recompute=mode, groups=groups, mem=mem)
        live = mem.live("activations")
        want = flops.activation_bytes_per_block(cfg, B, S, mode, group_sizes=sizes)
        assert live["blocks.0"] == live["blocks.1"] == want, (mode, live)
        assert live["embed"] + live["head"] == flops.head_activation_bytes(cfg, B, S)
        peak_before = mem.peak("activations")
        assert peak_before == 2 * want + flops.head_activation_bytes(cfg, B, S)
        model_backward(cache)
        assert mem.current("activations") == 0
        if mode == "full":  # the rerun block's activations are live during its backward
            assert mem.peak() == peak_before + flops.activation_bytes_per_block(
                cfg, B, S, "none", sizes
            )


def test_against_megatron():
    """Ours in bf16: 32 sbh + 8 sb + 2 as^2 b; Megatron (eq. 1): 34 sbh + 5 as^2 b.
    Differences: no dropout masks (-sbh attention, -sbh MLP, -as^2 b), no dropout output
    (-2 as^2 b), and the two LayerNorms keep their fp32 rstd (+2 * 4 sb)."""
    B, S, H, A = 1, 64, 32, 4
    cfg = ModelConfig(vocab_size=8, max_seq_len=S, d_model=H, n_heads=A, n_layers=1, dtype="mixed")
    ours = flops.activation_bytes_per_block(cfg, B, S)
    mega = flops.megatron_activation_bytes(B, S, H, A)
    assert ours == 32 * S * B * H + 8 * S * B + 2 * A * S * S * B
    assert mega - ours == 2 * S * B * H + 3 * A * S * S * B - 8 * S * B
