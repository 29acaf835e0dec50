"""ModelConfig and the named parameters: shapes, counts, initialisation, state_dict.

The definition (docs/model.md, "Configuration" and "Parameters") fixes every name, shape and
the order of the random draws; this file is that table as code. Re-exported by emulator.model.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from emulator.precision import DTYPES, master_dtype


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int  # V
    max_seq_len: int  # T
    d_model: int  # H
    n_heads: int  # A
    n_layers: int  # L
    d_ff: int | None = None  # F, None -> 4 * H
    n_experts: int = 0  # E; 0 = dense MLP in every block, > 0 = MoE in every block
    moe_top_k: int = 1  # K
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    ln_eps: float = 1e-5
    init_std: float = 0.02
    dtype: str = "float64"  # "float64" | "float32" | "mixed" (bf16 compute, fp32 master)

    def __post_init__(self):
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        bad = []
        for f in ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_layers", "d_ff"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                bad.append(f"{f}={v!r} must be an int >= 1")
        if not bad and self.d_model % self.n_heads:
            bad.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if not isinstance(self.n_experts, (int, np.integer)) or self.n_experts < 0:
            bad.append(f"n_experts={self.n_experts!r} must be an int >= 0")
        elif self.n_experts > 0 and not 1 <= self.moe_top_k <= self.n_experts:
            bad.append(f"moe_top_k={self.moe_top_k} must satisfy 1 <= K <= E={self.n_experts}")
        for f in ("capacity_factor", "aux_loss_coef", "init_std"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                bad.append(f"{f}={v!r} must be a finite number >= 0")
        if not (isinstance(self.ln_eps, (int, float)) and self.ln_eps > 0):
            bad.append(f"ln_eps={self.ln_eps!r} must be > 0")
        if self.dtype not in DTYPES:
            bad.append(f"dtype={self.dtype!r} must be one of {DTYPES}")
        if bad:
            raise ValueError("invalid ModelConfig: " + "; ".join(bad))

    @property
    def head_dim(self) -> int:  # D
        return self.d_model // self.n_heads

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


def block_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Local names of one block in init / state_dict order."""
    H, F, E = cfg.d_model, cfg.d_ff, cfg.n_experts
    shapes = {"ln1.gain": (H,), "ln1.bias": (H,)}
    for n in "qkvo":
        shapes[f"attn.w{n}"] = (H, H)
        shapes[f"attn.b{n}"] = (H,)
    shapes.update({"ln2.gain": (H,), "ln2.bias": (H,)})
    if cfg.is_moe:
        shapes.update(
            {"moe.router": (H, E), "moe.w1": (E, H, F), "moe.b1": (E, F)}
            | {"moe.w2": (E, F, H), "moe.b2": (E, H)}
        )
    else:
        shapes.update({"mlp.w1": (H, F), "mlp.b1": (F,), "mlp.w2": (F, H), "mlp.b2": (H,)})
    return shapes


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter name -> shape, in the spec's order; allocates nothing."""
    H, V, T = cfg.d_model, cfg.vocab_size, cfg.max_seq_len
    shapes = {"embed.tok": (V, H), "embed.pos": (T, H)}
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.{n}": s for n, s in block_param_shapes(cfg).items()})
    shapes.update({"final_ln.gain": (H,), "final_ln.bias": (H,), "head.w": (H, V)})
    return shapes


_NORMAL = {"tok", "pos", "wq", "wk", "wv", "wo", "w1", "w2", "router", "w"}


def init_kind(name: str) -> str:
    """'normal' for matrices, embeddings and the router; 'ones' for LN gains; else 'zeros'."""
    leaf = name.rsplit(".", 1)[-1]
    return "normal" if leaf in _NORMAL else ("ones" if leaf == "gain" else "zeros")


def n_params(cfg: ModelConfig) -> int:
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def init_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """rng = default_rng(seed); normal tensors draw rng.normal(0, init_std, shape) in float64 in
    state_dict order (ones/zeros draw nothing); then cast. "mixed" returns the fp32 master."""
    rng = np.random.default_rng(seed)
    dt = master_dtype(cfg.dtype)
    out = {}
    for name, shape in param_shapes(cfg).items():
        kind = init_kind(name)
        if kind == "normal":
            a = rng.normal(0.0, cfg.init_std, shape)
        else:
            a = np.ones(shape) if kind == "ones" else np.zeros(shape)
        out[name] = a.astype(dt)
    return out


def state_dict(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An ordered copy of the parameters (the checkpoint format)."""
    return {n: np.array(a, copy=True) for n, a in params.items()}


def load_state_dict(cfg: ModelConfig, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Validate names and shapes against ``cfg`` and return parameters in the master dtype."""
    want = param_shapes(cfg)
    missing, extra = [n for n in want if n not in sd], [n for n in sd if n not in want]
    if missing or extra:
        raise KeyError(f"state_dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    wrong = [f"{n}: {np.shape(sd[n])} != {s}" for n, s in want.items() if np.shape(sd[n]) != s]
    if wrong:
        raise ValueError("state_dict shape mismatch: " + "; ".join(wrong[:5]))
    return {n: np.array(sd[n], dtype=master_dtype(cfg.dtype), copy=True) for n in want}
