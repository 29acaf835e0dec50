"""FLOP formulas against the matmuls the code really runs (counted by an ndarray subclass that
intercepts np.matmul), against 6N + attention, and against Megatron's closed form."""

from fractions import Fraction

import numpy as np
import pytest

from emulator import flops
from emulator.model import RECOMPUTE, ModelConfig, init_params, model_backward, model_forward


class Counting(np.ndarray):
    """Counts 2 * m * k * n for every np.matmul (the @ operator) touching it."""

    total = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        plain = [np.asarray(x) if isinstance(x, Counting) else x for x in inputs]
        outs = kwargs.get("out")
        if outs:
            kwargs["out"] = tuple(np.asarray(o) if isinstance(o, Counting) else o for o in outs)
        result = getattr(ufunc, method)(*plain, **kwargs)
        if ufunc is np.matmul and method == "__call__":
            Counting.total += 2 * result.size * plain[0].shape[-1]
        if outs:
            return outs[0]
        return result.view(Counting) if isinstance(result, np.ndarray) else result


def _counted(cfg, B, S, recompute):
    p = {n: a.view(Counting) for n, a in init_params(cfg, 0).items()}
    rng = np.random.default_rng(0)
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, S))
    Counting.total = 0
    _, cache = model_forward(p, tokens, targets, cfg, recompute=recompute)
    fwd = Counting.total
    model_backward(cache)
    return fwd, Counting.total - fwd


CFGS = {
    "dense": {"vocab_size": 11, "max_seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": 2},
    "moe": {"vocab_size": 11, "max_seq_len": 8, "d_model": 8, "n_heads": 2, "n_layers": 2}
    | {"n_experts": 3, "moe_top_k": 2, "d_ff": 12, "capacity_factor": 0.9},
}


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("kind", list(CFGS))
def test_formula_equals_counted_matmuls(kind, recompute):
    cfg = ModelConfig(**CFGS[kind])
    fwd, bwd = _counted(cfg, 2, 7, recompute)
    want = flops.step_flops(cfg, 2, 7, recompute=recompute)
    assert fwd == want["forward"]
    assert bwd == want["backward"] + want["recompute"]


def test_six_n_plus_attention_and_megatron():
    for H, A, L, V, S, B in [(8, 2, 2, 11, 7, 2), (256, 4, 4, 512, 128, 8), (64, 8, 3, 100, 33, 1)]:
        cfg = ModelConfig(vocab_size=V, max_seq_len=S, d_model=H, n_heads=A, n_layers=L)
        f = flops.step_flops(cfg, B, S)
        assert f["model"] == flops.six_n_flops(cfg, B, S)
        # Narayanan et al. 2021 eq. 3 without recompute: 72 B S L H^2 (1 + S/6H + V/12HL)
        mega = 72 * B * S * L * H * H * (1 + Fraction(S, 6 * H) + Fraction(V, 12 * H * L))
        assert f["model"] == mega
        full = flops.step_flops(cfg, B, S, recompute="full")
        assert full["hardware"] == 4 * f["forward"] - 2 * B * S * H * V  # 8N-ish: head not rerun
        sel = flops.step_flops(cfg, B, S, recompute="selective")
        assert sel["hardware"] - sel["model"] == L * 2 * B * S * S * H  # only Q K^T is redone


def test_matmul_params_counts_dense_matrices():
    cfg = ModelConfig(**CFGS["dense"])
    p = init_params(cfg, 0)
    mats = [n for n in p if n.endswith(("wq", "wk", "wv", "wo", "w1", "w2", "head.w"))]
    assert flops.matmul_params(cfg) == sum(p[n].size for n in mats)
