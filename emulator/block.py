"""One transformer block, forward and backward, with the three activation-recompute modes.

Shape letters: B batch, S sequence, H d_model, A heads, F d_ff. ``bp`` is the block's parameter
dict with local names ("ln1.gain", "attn.wq", "mlp.w1", "moe.router", ...).

Recompute modes (Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4):
  none       keep every cached tensor
  selective  drop the (B, A, S, S) attention probabilities; attention_backward recomputes them
  full       keep only the block input x; the backward reruns the whole block forward first
All three run the same arithmetic in the same order, so the gradients are bitwise identical.
"""

from __future__ import annotations

import contextlib

from emulator.halves import deferred
from emulator.memory import saved_nbytes
from emulator.moe import moe_backward, moe_forward
from emulator.ops import (
    attention_backward,
    attention_forward,
    layernorm_backward,
    layernorm_forward,
    linear_backward,
    linear_forward,
    linear_gelu_backward,
    linear_gelu_forward,
    linears_backward,
    linears_forward,
)
from emulator.precision import add, arith_dtype

RECOMPUTE = ("none", "selective", "full")
ATTENTION = (attention_forward, attention_backward)  # the single-rank core (default attention=)
MOE = (moe_forward, moe_backward)  # the single-rank MoE block (the default of moe_fn=)


def fused(x):
    """One hand-off for the row-wise ops in the block (halves.deferred) when nothing is cast
    between them (bf16 casts read the values: the ops then run one by one)."""
    return deferred() if x.dtype == arith_dtype(x.dtype) else contextlib.nullcontext()


def _whole(x, cfg, attention):
    """One hand-off for the whole dense block (halves.deferred) when nothing is cast and the
    attention core is the single-rank one (a layout's may read values: communication; so may
    the MoE router): it splits the batch in halves, the token rows' halves when B is even."""
    dense = not cfg.is_moe and attention is ATTENTION and x.shape[0] % 2 == 0
    return dense and x.dtype == arith_dtype(x.dtype)


def _forward(bp, x, cfg, groups, keep_probs, attention, moe_fn):
    """-> (x_out, aux, cache). The computation shared by every mode."""
    with deferred() if _whole(x, cfg, attention) else contextlib.nullcontext():
        return _forward_parts(bp, x, cfg, groups, keep_probs, attention, moe_fn)


def _forward_parts(bp, x, cfg, groups, keep_probs, attention, moe_fn):
    c = {}
    with fused(x):  # LN1 and the three projections, on the same rows
        a, c["ln1"] = layernorm_forward(x, bp["ln1.gain"], bp["ln1.bias"], cfg.ln_eps)  # (B, S, H)
        qkv = [(bp[f"attn.w{n}"], bp[f"attn.b{n}"]) for n in "qkv"]
        (q, c["q"]), (k, c["k"]), (v, c["v"]) = linears_forward(a, qkv)  # the three share input a
    n_heads = cfg.n_heads * bp["attn.wq"].shape[1] // cfg.d_model  # fewer under tensor parallel
    o, c["attn"] = attention[0](q, k, v, n_heads, keep_probs=keep_probs)
    with fused(x):  # the projection, LN2 and the MLP, on the same rows
        x, c["o"] = linear_forward(o, bp["attn.wo"], bp["attn.bo"], residual=x)  # x + o wo + bo
        m, c["ln2"] = layernorm_forward(x, bp["ln2.gain"], bp["ln2.bias"], cfg.ln_eps)
        if not cfg.is_moe:
            h, (c["gelu"], c["w1"]) = linear_gelu_forward(
                m, bp["mlp.w1"], bp["mlp.b1"]
            )  # (B, S, F)
            x, c["w2"] = linear_forward(h, bp["mlp.w2"], bp["mlp.b2"], residual=x)
    if not cfg.is_moe:
        return x, 0.0, c
    mp = {n[4:]: bp[n] for n in ("moe.router", "moe.w1", "moe.b1", "moe.w2", "moe.b2")}
    kw = {"top_k": cfg.moe_top_k, "capacity_factor": cfg.capacity_factor}
    y, aux, c["moe"] = moe_fn[0](mp, m, groups, **kw)
    return add(x, y), aux, c  # an MoE block's y may be held by its cache (moe_fn's own)


def block_forward(bp, x, cfg, *, recompute="none", groups=None, mem=None, name="block",
                  attention=None, moe_fn=None):  # fmt: skip
    """x (B, S, H) -> (x_out (B, S, H), cache); the MoE aux loss is ``cache["aux"]`` (0 if dense).

    ``attention``: the (forward, backward) pair of the attention core, default emulator.ops's
    (context parallelism passes its own: parallel.context.attention).
    ``moe_fn``: a (forward, backward) pair with moe_forward / moe_backward's signatures that
    replaces the single-rank MoE block (expert parallelism: parallel/expert/layer.py); None = MOE.

    With ``mem``, the bytes the cache holds (excluding parameters) are allocated as
    ``activations/<name>`` now and freed by block_backward.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTE}")
    attention = ATTENTION if attention is None else attention
    moe_fn = MOE if moe_fn is None else moe_fn
    out, aux, inner = _forward(bp, x, cfg, groups, recompute == "none", attention, moe_fn)
    saved = {"x": x} if recompute == "full" else inner  # full: everything else is dropped
    cache = {"mode": recompute, "saved": saved, "aux": aux, "bp": bp, "cfg": cfg}
    cache.update(groups=groups, mem=mem, name=name, attention=attention, moe_fn=moe_fn)
    if mem is not None:
        mem.alloc("activations", name, saved_nbytes(saved, exclude=bp.values()))
    return out, cache


def _backward_parts(dx, dm, c, g, cfg, attention):
    """The backward from the MLP's (dm: the MoE block's, None when dense) -> dx_in; the
    gradients go in g. Each fused() region is one hand-off of row-wise jobs (the dx chain), then
    one of their weight gradients (every row of dy: halves.together_then); under _whole's
    deferred, one of each for the whole block."""
    with fused(dx):
        if dm is None:
            dz, g["mlp.w2"], g["mlp.b2"] = linear_gelu_backward(dx, c["w2"], c["gelu"])
            dm, g["mlp.w1"], g["mlp.b1"] = linear_backward(dz, c["w1"])
        # residual: the gradient reaches x directly and through LN2 (dx + dln2, in dln2's buffer)
        dx, g["ln2.gain"], g["ln2.bias"] = layernorm_backward(dm, c["ln2"], residual=dx)
        do, g["attn.wo"], g["attn.bo"] = linear_backward(dx, c["o"])
    dq, dk, dv = attention[1](do, c["attn"])
    with fused(dx):
        da, dqkv = linears_backward((dq, dk, dv), (c["q"], c["k"], c["v"]))  # (da_q + da_k) + da_v
        for n, (dw, db) in zip("qkv", dqkv, strict=True):
            g[f"attn.w{n}"], g[f"attn.b{n}"] = dw, db
        dx, g["ln1.gain"], g["ln1.bias"] = layernorm_backward(da, c["ln1"], residual=dx)
    return dx


def block_backward(dx, cache, daux=None):
    """dx (B, S, H) = dloss/dx_out; daux = dloss/daux (default cfg.aux_loss_coef)
    -> (dx_in (B, S, H), dbp with the local names, in bp's order)."""
    bp, cfg, mem, name = cache["bp"], cache["cfg"], cache["mem"], cache["name"]
    daux = cfg.aux_loss_coef if daux is None else daux
    c = cache["saved"]
    if cache["mode"] == "full":  # rerun the forward from the kept input (Chen et al. 2016)
        _, _, c = _forward(
            bp, c["x"], cfg, cache["groups"], True, cache["attention"], cache["moe_fn"]
        )
        if mem is not None:
            mem.alloc("activations", name + ".recomputed", saved_nbytes(c, exclude=bp.values()))
    g, dm = {}, None
    if cfg.is_moe:
        dm, dmp = cache["moe_fn"][1](dx, c["moe"], daux)
        g.update({"moe." + n: d for n, d in dmp.items()})
    with deferred() if _whole(dx, cfg, cache["attention"]) else contextlib.nullcontext():
        dx = _backward_parts(dx, dm, c, g, cfg, cache["attention"])
    if mem is not None:
        if cache["mode"] == "full":
            mem.free("activations", name + ".recomputed")
        mem.free("activations", name)
    return dx, {n: g[n] for n in bp}
