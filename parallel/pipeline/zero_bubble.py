"""The backward split into B (input gradient) and W (weight gradient), for zero-bubble schedules.

Qi et al. 2023, section 2: for a linear y = x W + b the backward is dx = dy W^T (needed at once
by the previous stage: B) and dW = x^T dy, db = sum dy (needed only by the optimizer step: W).
B walks a block backward computing only input gradients and stashes (x, dy) of every linear and
(xhat, dy) of every LayerNorm; W turns the stash into the parameter gradients later.

The formulas are ops.py's, term for term and in the same dtype steps, so B then W is bitwise
block_backward (tests/parallel/pipeline/test_zero_bubble.py). An MoE block's backward (moe.py) is not
split: its B computes the expert and router gradients too and W only hands them over.
Shape letters: B batch, S sequence, H d_model, F d_ff, N = B*S.
"""

from __future__ import annotations

from emulator.memory import saved_nbytes
from emulator.moe import moe_backward
from emulator.ops import attention_backward, gelu_backward
from emulator.precision import add, down, up


def linear_dx(dy, cache):
    """dx = dy @ W^T (ops.linear_backward's first output)."""
    x, w, _ = cache
    dy2 = up(dy.reshape(-1, dy.shape[-1]))  # (N, out)
    return down((dy2 @ up(w).T).reshape(x.shape), x.dtype)


def linear_dw(dy, cache):
    """(dW = x^T dy, db = sum dy or None) (ops.linear_backward's other outputs)."""
    x, w, has_b = cache
    dy2 = up(dy.reshape(-1, dy.shape[-1]))
    dw = down(up(x.reshape(-1, x.shape[-1])).T @ dy2, w.dtype)  # (in, out)
    return dw, down(dy2.sum(axis=0), w.dtype) if has_b else None


def layernorm_dx(dy, cache):
    xhat_s, rstd, gain = cache
    d, xhat = up(dy), up(xhat_s)
    dxhat = d * up(gain)
    dx = rstd * (
        dxhat
        - dxhat.mean(axis=-1, keepdims=True)
        - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
    )
    return down(dx, dy.dtype)


def layernorm_dw(dy, cache):
    xhat_s, _, gain = cache
    d, xhat = up(dy), up(xhat_s)
    H = d.shape[-1]
    dgain = (d * xhat).reshape(-1, H).sum(axis=0)
    return down(dgain, gain.dtype), down(d.reshape(-1, H).sum(axis=0), gain.dtype)


def block_backward_b(dx, cache, daux=None):
    """B of one block: -> (dx_in (B, S, H), stash for block_backward_w). Frees the block's
    activations in the ledger and accounts the (smaller) stash as `<name>.w` instead."""
    bp, cfg, mem, name = cache["bp"], cache["cfg"], cache["mem"], cache["name"]
    if cache["mode"] == "full":
        raise ValueError("the B/W split needs the block's cache: use recompute 'none'/'selective'")
    daux = cfg.aux_loss_coef if daux is None else daux
    c, st = cache["saved"], {"bp": bp, "mem": mem, "name": name}
    # the block's attention / MoE pairs (emulator/block.py: a layout's drop-ins or emulator's)
    attention_bwd = cache.get("attention", (None, attention_backward))[1]
    if cfg.is_moe:
        dm, dmp = cache.get("moe_fn", (None, moe_backward))[1](dx, c["moe"], daux)
        st["done"] = {"moe." + n: d for n, d in dmp.items()}
    else:
        st["w2"] = (dx, c["w2"])
        dz = gelu_backward(linear_dx(dx, c["w2"]), c["gelu"])
        st["w1"] = (dz, c["w1"])
        dm = linear_dx(dz, c["w1"])
    st["ln2"] = (dm, c["ln2"])
    dx = add(dx, layernorm_dx(dm, c["ln2"]))
    st["o"] = (dx, c["o"])
    dq, dk, dv = attention_bwd(linear_dx(dx, c["o"]), c["attn"])
    st.update(q=(dq, c["q"]), k=(dk, c["k"]), v=(dv, c["v"]))
    da = down(up(linear_dx(dq, c["q"])) + up(linear_dx(dk, c["k"])) + up(linear_dx(dv, c["v"])),
              dx.dtype)  # fmt: skip
    st["ln1"] = (da, c["ln1"])
    dx = add(dx, layernorm_dx(da, c["ln1"]))
    if mem is not None:
        mem.free("activations", name)
        mem.alloc("activations", name + ".w", saved_nbytes(st, exclude=bp.values()))
    return dx, st


LINEARS = {"w2": "mlp.w2", "w1": "mlp.w1", "o": "attn.wo", "q": "attn.wq", "k": "attn.wk",
           "v": "attn.wv"}  # fmt: skip


def block_backward_w(st):
    """W of one block: the parameter gradients {local name: grad} in bp's order."""
    g = dict(st.get("done", {}))
    for key, pname in LINEARS.items():
        if key in st:
            bname = pname[:-2] + "b" + pname[-1]  # attn.wq -> attn.bq, mlp.w1 -> mlp.b1
            g[pname], g[bname] = linear_dw(*st[key])
    for ln in ("ln1", "ln2"):
        g[f"{ln}.gain"], g[f"{ln}.bias"] = layernorm_dw(*st[ln])
    if st["mem"] is not None:
        st["mem"].free("activations", st["name"] + ".w")
    return {n: g[n] for n in st["bp"]}
