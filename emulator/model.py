"""The single-rank reference model: forward, backward and loss (definition: docs/model.md).

Shape letters: B batch, S sequence used (1 <= S <= T), H d_model, V vocab, L layers.

loss = CE_sum / ce_denom + aux_loss_coef * aux_scale * sum over blocks of block aux
  ce_denom defaults to B*S (the spec's mean) and aux_scale to 1; gradient accumulation and
  data-parallel layouts pass a global token count and their share of the routing groups instead
  (see reference.py and docs/model.md).
"""

from __future__ import annotations

import numpy as np

from emulator.block import RECOMPUTE, block_backward, block_forward, fused
from emulator.config import (  # re-exported: emulator.model is the public face
    ModelConfig,
    block_param_shapes,
    init_params,
    load_state_dict,
    n_params,
    param_shapes,
    state_dict,
)
from emulator.memory import saved_nbytes
from emulator.ops import (
    cross_entropy_sum_backward,
    cross_entropy_sum_forward,
    embedding_backward,
    embedding_forward,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
)
from emulator.precision import compute_dtype, down

__all__ = [
    "RECOMPUTE", "ModelConfig", "block_backward", "block_forward", "block_param_shapes",
    "block_params", "check_inputs", "embed_backward", "embed_forward", "head_backward",
    "head_forward", "init_params", "load_state_dict", "model_backward", "model_forward",
    "n_params", "param_shapes", "state_dict", "to_compute",
]  # fmt: skip


def check_inputs(tokens, targets, cfg: ModelConfig):
    """tokens, targets: integer (B, S) arrays with values in [0, V), 1 <= S <= T."""
    out = []
    for what, a in (("tokens", tokens), ("targets", targets)):
        a = np.asarray(a)
        if a.dtype.kind not in "iu":
            raise TypeError(f"{what} must be an integer array, got dtype {a.dtype}")
        if a.ndim != 2 or a.shape[0] < 1:
            raise ValueError(f"{what} must have shape (B, S) with B >= 1, got {a.shape}")
        if not 1 <= a.shape[1] <= cfg.max_seq_len:
            raise ValueError(f"{what}: need 1 <= S <= T={cfg.max_seq_len}, got S={a.shape[1]}")
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"{what} values must lie in [0, {cfg.vocab_size}), got [{lo}, {hi}]")
        out.append(a)
    if out[0].shape != out[1].shape:
        raise ValueError(f"tokens {out[0].shape} and targets {out[1].shape} differ in shape")
    return out


def to_compute(params, cfg: ModelConfig):
    """The compute copy: bf16 in mixed mode (a new array), the same arrays otherwise."""
    dt = compute_dtype(cfg.dtype)
    return {n: down(a, dt) for n, a in params.items()}


def block_params(params, i: int):
    """Block i's sub-dict with local names (views of the same arrays, no copies)."""
    prefix = f"blocks.{i}."
    return {n[len(prefix) :]: a for n, a in params.items() if n.startswith(prefix)}


def embed_forward(params, tokens, positions=None):
    """-> (x (B, S, H), cache); positions: the columns' global positions (None = 0..S-1)."""
    return embedding_forward(tokens, params["embed.tok"], params["embed.pos"], positions)


def embed_backward(dx, cache):
    dtok, dpos = embedding_backward(dx, cache)
    return {"embed.tok": dtok, "embed.pos": dpos}


def head_forward(params, x, targets, cfg: ModelConfig, *, denom=None):
    """Final LN, logits = xf @ head.w (B, S, V), CE summed then divided by ``denom``
    (default B*S, the mean) -> (ce, cache)."""
    with fused(x):  # one hand-off for the LN and the logits' GEMM on the same rows
        xf, ln = layernorm_forward(x, params["final_ln.gain"], params["final_ln.bias"], cfg.ln_eps)
        logits, lin = linear_forward(xf, params["head.w"])  # no bias
    total, count, ce = cross_entropy_sum_forward(logits, targets)
    denom = count if denom is None else denom
    return total / denom, {"ln": ln, "lin": lin, "ce": ce, "denom": denom}


def head_backward(dce, cache):
    """-> (dx (B, S, H), grads of final_ln.gain, final_ln.bias, head.w)."""
    with fused(cache["ce"][0]):  # the row chain in one hand-off, dw and the LN sums in another
        dlogits = cross_entropy_sum_backward(dce / cache["denom"], cache["ce"])
        dxf, dw, _ = linear_backward(dlogits, cache["lin"])
        dx, dgain, dbias = layernorm_backward(dxf, cache["ln"])
    return dx, {"final_ln.gain": dgain, "final_ln.bias": dbias, "head.w": dw}


def model_forward(
    params, tokens, targets, cfg, *, recompute="none", groups=None, mem=None, ce_denom=None,
    aux_scale=1.0, mem_prefix="",
):  # fmt: skip
    """-> (loss: float, cache). ``groups``: MoE routing groups (flat indices b*S + s), shared
    by every MoE block; None = one group of all B*S tokens. ``mem`` accounts the activations
    of the embedding, each block and the head under names prefixed by ``mem_prefix``."""
    tokens, targets = check_inputs(tokens, targets, cfg)
    p = to_compute(params, cfg)
    x, ecache = embed_forward(p, tokens)
    blocks = []
    for i in range(cfg.n_layers):
        kw = {"recompute": recompute, "groups": groups, "mem": mem}
        x, c = block_forward(block_params(p, i), x, cfg, name=f"{mem_prefix}blocks.{i}", **kw)
        blocks.append(c)
    ce, hcache = head_forward(p, x, targets, cfg, denom=ce_denom)
    aux = [c["aux"] for c in blocks]
    loss = float(ce) + cfg.aux_loss_coef * aux_scale * sum(aux)
    cache = {"embed": ecache, "blocks": blocks, "head": hcache, "cfg": cfg, "params": p}
    cache.update(ce=float(ce), aux=aux, daux=cfg.aux_loss_coef * aux_scale, mem=mem)
    cache["mem_names"] = (f"{mem_prefix}embed", f"{mem_prefix}head")
    if mem is not None:
        skip = list(p.values())
        mem.alloc("activations", cache["mem_names"][0], saved_nbytes(ecache, exclude=skip))
        mem.alloc("activations", cache["mem_names"][1], saved_nbytes(hcache, exclude=skip))
    return loss, cache


def model_backward(cache):
    """-> grads: {name: array} in state_dict order, in the compute dtype (bf16 when mixed)."""
    grads = {}
    dx, g = head_backward(1.0, cache["head"])
    grads.update(g)
    for i in reversed(range(cache["cfg"].n_layers)):
        dx, dbp = block_backward(dx, cache["blocks"][i], daux=cache["daux"])
        grads.update({f"blocks.{i}.{n}": d for n, d in dbp.items()})
    grads.update(embed_backward(dx, cache["embed"]))
    if cache["mem"] is not None:
        for n in cache["mem_names"]:
            cache["mem"].free("activations", n)
    return {n: grads[n] for n in cache["params"]}
