"""PyTorch eager peer of `python -m emulator bench model` (not part of the package or its tests).

The same model shape and step (forward + backward + AdamW) written in PyTorch eager, for the
ratio in the README. Needs torch, which this project does not depend on:

    pip install torch && python benchmarks/torch_peer_model.py 1      # 1 intra-op thread
    OPENBLAS_NUM_THREADS=1 python -m emulator bench model               # ours, 1 BLAS thread
"""

import math
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
V, T, H, A, L, B, S = 512, 128, 256, 4, 4, 8, 128
F = 4 * H


def run(dtype):
    g = torch.Generator().manual_seed(0)
    P = lambda *s: torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype) * 0.02)
    Z = lambda *s: torch.nn.Parameter(torch.zeros(*s, dtype=dtype))
    O = lambda *s: torch.nn.Parameter(torch.ones(*s, dtype=dtype))
    tok, pos = P(V, H), P(T, H)
    blocks = [
        {
            "g1": O(H),
            "b1": Z(H),
            "wq": P(H, H),
            "bq": Z(H),
            "wk": P(H, H),
            "bk": Z(H),
            "wv": P(H, H),
            "bv": Z(H),
            "wo": P(H, H),
            "bo": Z(H),
            "g2": O(H),
            "b2": Z(H),
            "w1": P(H, F),
            "c1": Z(F),
            "w2": P(F, H),
            "c2": Z(H),
        }
        for _ in range(L)
    ]
    gf, bf, head = O(H), Z(H), P(H, V)
    params = [tok, pos, gf, bf, head] + [p for b in blocks for p in b.values()]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    x_tok = torch.randint(0, V, (B, S))
    y = torch.randint(0, V, (B, S))
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)

    def step():
        x = tok[x_tok] + pos[:S]
        for b in blocks:
            a = torch.nn.functional.layer_norm(x, (H,), b["g1"], b["b1"], 1e-5)
            q = (a @ b["wq"] + b["bq"]).view(B, S, A, H // A).transpose(1, 2)
            k = (a @ b["wk"] + b["bk"]).view(B, S, A, H // A).transpose(1, 2)
            v = (a @ b["wv"] + b["bv"]).view(B, S, A, H // A).transpose(1, 2)
            sc = (q @ k.transpose(-1, -2)) / math.sqrt(H // A)
            sc = sc.masked_fill(mask, float("-inf"))
            o = (torch.softmax(sc, -1) @ v).transpose(1, 2).reshape(B, S, H)
            x = x + o @ b["wo"] + b["bo"]
            m = torch.nn.functional.layer_norm(x, (H,), b["g2"], b["b2"], 1e-5)
            x = (
                x
                + torch.nn.functional.gelu(m @ b["w1"] + b["c1"], approximate="tanh") @ b["w2"]
                + b["c2"]
            )
        x = torch.nn.functional.layer_norm(x, (H,), gf, bf, 1e-5)
        loss = torch.nn.functional.cross_entropy((x @ head).view(-1, V), y.view(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return min(ts)


for dt in (torch.float32, torch.float64):
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} {dt}: {run(dt) * 1e3:.1f} ms"
    )
