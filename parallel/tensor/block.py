"""Megatron tensor parallelism of one transformer block (Shoeybi et al. 2019, section 3).

Shape letters: B batch, S sequence, H d_model, A heads, F d_ff, R = t the tp group size;
"S_l" is S (replicated regions) or S/R (sequence parallel, parallel/tensor/sequence.py).

Attention: wq, wk, wv column-parallel (rank r owns heads r*A/R .. (r+1)*A/R - 1, whole heads,
so attention itself needs no communication); wo row-parallel. MLP: w1 column-parallel (GeLU is
elementwise, so it applies to each column block alone), w2 row-parallel. A row-parallel layer's
output is a partial sum; its bias is added once, after the reduction (section 3, Figure 3).
The communication is the conjugate pair of section 3, Figure 3, named and visible here:

    f   entering a TP region:  forward identity,   backward all-reduce   (X feeds every rank)
    g   leaving a TP region:   forward all-reduce,  backward identity    (Y = sum_r Y_r)

Two of each per block: four all-reduces of the (B, S, H) hidden state per layer (Figure 4).
With sequence parallelism ``enter``/``leave`` use the all-gather / reduce-scatter pair instead.
The block reuses emulator/ops.py unchanged; only the calls to f, g (enter, leave) are new.
"""

from __future__ import annotations

import functools

import numpy as np

from collectives.api import all_reduce
from emulator import scope
from emulator.config import param_shapes
from emulator.memory import saved_nbytes
from emulator.ops import (
    add_into,
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
from emulator.precision import add, arith_dtype, down, up
from parallel.tensor.moe import tp_moe_backward, tp_moe_forward
from parallel.tensor.sequence import check_sequence, gather_seq, reduce_scatter_seq, scatter_seq
from parallel.tensor.shard import REPLICATE, Placement, validate

COL, ROW = Placement("col", -1), Placement("row", 0)
_BLOCK_PLAN = {
    "attn.wq": COL, "attn.bq": COL, "attn.wk": COL, "attn.bk": COL,
    "attn.wv": COL, "attn.bv": COL, "attn.wo": ROW,
    "mlp.w1": COL, "mlp.b1": COL, "mlp.w2": ROW,
    "moe.w1": COL, "moe.b1": COL, "moe.w2": Placement("row", 1),  # (E, F, H): cut F
}  # fmt: skip
_TOP_PLAN = {"embed.tok": Placement("vocab", 0), "head.w": Placement("vocab", -1)}


def megatron_plan(cfg) -> dict:
    """name -> Placement for every parameter; everything not listed is replicated (LayerNorms,
    row-parallel biases bo / b2, embed.pos, final_ln, the MoE router). A new dict each call."""
    return dict(_plan(cfg))


@functools.lru_cache(maxsize=64)  # every rank of a run asks for the same config's plan
def _plan(cfg) -> dict:
    plan = {}
    for name in param_shapes(cfg):
        leaf = name.split(".", 2)[2] if name.startswith("blocks.") else None
        plan[name] = _BLOCK_PLAN.get(leaf, REPLICATE) if leaf else _TOP_PLAN.get(name, REPLICATE)
    return plan


def check_tp(cfg, t: int, S: int | None = None, sequence_parallel: bool = False) -> None:
    """ValueError naming what t must divide (no padding: a ragged shard is not Megatron's)."""
    if cfg.n_heads % t:
        raise ValueError(
            f"tensor parallel: n_heads={cfg.n_heads} is not divisible by tp={t}; each rank must "
            f"own whole heads - choose tp dividing the number of heads"
        )
    validate(megatron_plan(cfg), param_shapes(cfg), t)  # d_ff, vocabulary (and H) divisible
    if sequence_parallel and S is not None:
        check_sequence(S, t)


# ---- the conjugate operators (Shoeybi et al. 2019, section 3, Figure 3) ------------------------
def f_forward(tp, x):
    return x  # identity: every rank already holds the full input


def f_backward(tp, dx):
    return all_reduce(tp, dx, algorithm="ring")  # sum each rank's contribution to dX


def g_forward(tp, y):
    return all_reduce(tp, y, algorithm="ring")  # Y = sum over ranks of the partial Y_r


def g_backward(tp, dy):
    return dy  # dL/dY_r = dL/dY on every rank


def enter(tp, x, sp: bool):
    """(B, S_l, H) -> (B, S, H): f, or the sequence all-gather under SP."""
    return gather_seq(tp, x) if sp else f_forward(tp, x)


def enter_backward(tp, dx, sp: bool):
    """(B, S, H) partial -> (B, S_l, H): f's all-reduce, or the reduce-scatter under SP."""
    return reduce_scatter_seq(tp, dx) if sp else f_backward(tp, dx)


def leave(tp, y, sp: bool):
    """(B, S, H) partial -> (B, S_l, H): g's all-reduce, or the reduce-scatter under SP."""
    return reduce_scatter_seq(tp, y) if sp else g_forward(tp, y)


def leave_backward(tp, dy, sp: bool):
    """(B, S_l, H) -> (B, S, H): identity, or the sequence all-gather under SP."""
    return gather_seq(tp, dy) if sp else g_backward(tp, dy)


def bias_grad(dy, dtype):
    return down(up(dy).reshape(-1, dy.shape[-1]).sum(axis=0), dtype)


# ---- the block --------------------------------------------------------------------------------
def tp_block_forward(tp, bp, x, cfg, *, sp=False, regather=True, keep_probs=True, groups=None,
                     mem=None, name="block", attention=None, moe=None):  # fmt: skip
    """bp: this rank's shards with local names; x (B, S_l, H) -> (x_out (B, S_l, H), cache).

    ``attention``: a (forward, backward) pair replacing emulator.ops's attention core on this
    rank's heads (as emulator/block.py's; a context-parallel drop-in); None = emulator's.
    ``regather`` (SP only): keep the S/R slice of each column-parallel input and all-gather it
    again in the backward (Korthikanti et al. 2022, section 4.2.2), instead of keeping the
    gathered (B, S, H) copy. It costs two extra all-gathers per layer, tagged "regather".
    ``moe``: an expert-parallel (forward, backward) pair (parallel/expert/nd.py) for an MoE
    block whose experts are replicated over tp: every tp rank runs it on the full (gathered)
    m, so y and dm come out complete - no g / f^T around it, only the local S_l slice taken.
    """
    c, drop = {"sp": sp}, sp and regather
    a, c["ln1"] = layernorm_forward(x, bp["ln1.gain"], bp["ln1.bias"], cfg.ln_eps)
    a_full = _rows(enter(tp, a, sp))  # f  (B, S, H)
    qkv = [(bp[f"attn.w{n}"], bp[f"attn.b{n}"]) for n in "qkv"]  # (B, S, H/R) each: whole heads
    (q, c["q"]), (k, c["k"]), (v, c["v"]) = linears_forward(a_full, qkv)  # one input, three
    attention = (attention_forward, attention_backward) if attention is None else attention
    o, c["attn"] = attention[0](q, k, v, cfg.n_heads // tp.size, keep_probs=keep_probs)
    y, c["o"] = linear_forward(o, bp["attn.wo"])  # (B, S, H) partial: bo comes after g
    x = _residual(x, leave(tp, y, sp), bp["attn.bo"])  # g, then bo once
    m, c["ln2"] = layernorm_forward(x, bp["ln2.gain"], bp["ln2.bias"], cfg.ln_eps)
    m_full = enter(tp, m, sp)  # f
    c["moe_fn"] = moe
    if cfg.is_moe and moe is not None:  # experts over ep, replicated over tp: y complete
        mp = {n[4:]: bp[n] for n in ("moe.router", "moe.w1", "moe.b1", "moe.w2", "moe.b2")}
        kw = {"top_k": cfg.moe_top_k, "capacity_factor": cfg.capacity_factor}
        y, aux, c["moe"] = moe[0](mp, m_full, groups, **kw)  # (B, S, H) complete
        x = add(x, scatter_seq(y, tp.size, tp.rank) if sp else y)  # no communication
    elif cfg.is_moe:
        y, aux, c["moe"] = tp_moe_forward(tp, bp, m_full, cfg, groups)  # (B, S, H) partial
        x = _residual(x, leave(tp, y, sp))  # g
    else:
        h, (c["gelu"], c["w1"]) = linear_gelu_forward(m_full, bp["mlp.w1"], bp["mlp.b1"])  # F/R
        y, c["w2"] = linear_forward(h, bp["mlp.w2"])  # (B, S, H) partial
        x = _residual(x, leave(tp, y, sp), bp["mlp.b2"])  # g, then b2 once
        aux = 0.0
    if drop:  # keep the slices, forget the gathered copies the linear caches point at
        c["a"] = a  # (an MoE block keeps its routed token copies: no regather there)
        for key in ("q", "k", "v") if cfg.is_moe else ("q", "k", "v", "w1"):
            c[key] = (None, *c[key][1:])
        if not cfg.is_moe:
            c["m"] = m
    c.update(aux=aux, regather=drop)
    if mem is not None:  # measured before bp joins the cache: its arrays are excluded anyway
        mem.alloc("activations", name, saved_nbytes(c, exclude=bp.values()))
    c.update(mem=mem, name=name, bp=bp, cfg=cfg, attention=attention)  # holding no activations
    return x, c


def _residual(x, t, b=None):
    """add(x, add(t, b)): the residual add of a row-parallel layer's reduced output t (b its
    bias, added once after the reduction), t the fresh array the collective returned, which
    nothing else holds. Without a cast both adds go into t's buffer (t += b, then add_into:
    IEEE addition commutes, so t + x is x + t bitwise), saving two (B, S_l, H) arrays a call."""
    if not t.flags.writeable:
        return add(x, t if b is None else add(t, b))
    if b is not None:
        t = np.add(t, b, out=t) if t.dtype == b.dtype == arith_dtype(t.dtype) else add(t, b)
    return add_into(x, t)


def _linear_input(tp, c, key, local):
    """The input of the column-parallel linear cached under ``key``, (B, S, H). Under regather
    the forward kept only the S/R slice ``c[local]``: all-gather it again (Korthikanti et al. 2022,
    section 4.2.2). Reads the forward's cache, never writes it."""
    if not c["regather"]:
        return c[key][0]
    with scope("regather"):
        return _rows(enter(tp, c[local], True))


def _rows(x):
    """A gathered (B, S, H) input in (B, S, H) order in memory: one copy at most for all of its
    linear layers, each of which would otherwise copy it to flatten it to (B S, H) rows. The
    SP all-gather (axis=1) returns it contiguous already, so this copies nothing there; a
    view from elsewhere is copied once. The same values in the same layout: the same bits."""
    return np.ascontiguousarray(x)


def tp_block_backward(tp, dx, c, daux=None):
    """dx (B, S_l, H) -> (dx_in (B, S_l, H), grads of this rank's shards, in bp's order)."""
    bp, cfg, sp = c["bp"], c["cfg"], c["sp"]
    daux = cfg.aux_loss_coef if daux is None else daux
    g = {}
    if cfg.is_moe and c.get("moe_fn") is not None:  # complete dy in, complete dm out
        dm, gm = c["moe_fn"][1](leave_backward(tp, dx, sp), c["moe"], daux)
        g.update({"moe." + n: d for n, d in gm.items()})
        dm = scatter_seq(dm, tp.size, tp.rank) if sp else dm
    elif cfg.is_moe:
        dm_exp, dm_router, gm = tp_moe_backward(tp, leave_backward(tp, dx, sp), c["moe"], daux, bp)
        g.update(gm)
        if sp:
            dm_router = scatter_seq(dm_router, tp.size, tp.rank)  # no communication
        dm = add(enter_backward(tp, dm_exp, sp), dm_router)  # f^T on the experts' share only
    else:
        g["mlp.b2"] = bias_grad(dx, bp["mlp.b2"].dtype)  # on S_l positions: partial under SP
        dz, g["mlp.w2"], _ = linear_gelu_backward(leave_backward(tp, dx, sp), c["w2"], c["gelu"])
        m_full = _linear_input(tp, c, "w1", "m")  # (B, S, H)
        dm, g["mlp.w1"], g["mlp.b1"] = linear_backward(dz, (m_full, *c["w1"][1:]))
        dm = enter_backward(tp, dm, sp)  # f^T: sum the ranks' contributions
    dx, g["ln2.gain"], g["ln2.bias"] = layernorm_backward(dm, c["ln2"], residual=dx)  # dx + dln2
    g["attn.bo"] = bias_grad(dx, bp["attn.bo"].dtype)
    do, g["attn.wo"], _ = linear_backward(leave_backward(tp, dx, sp), c["o"])  # g^T
    dq, dk, dv = c["attention"][1](do, c["attn"])
    a_full = _linear_input(tp, c, "q", "a")  # (B, S, H): q, k, v share one input
    caches = [(a_full, *c[n][1:]) for n in "qkv"]
    da, dqkv = linears_backward((dq, dk, dv), caches)  # (da_q + da_k) + da_v
    for n, (dw, db) in zip("qkv", dqkv, strict=True):
        g[f"attn.w{n}"], g[f"attn.b{n}"] = dw, db
    da = enter_backward(tp, da, sp)  # f^T
    dx, g["ln1.gain"], g["ln1.bias"] = layernorm_backward(da, c["ln1"], residual=dx)  # dx + dln1
    if c["mem"] is not None:
        c["mem"].free("activations", c["name"])
    return dx, {n: g[n] for n in bp}
