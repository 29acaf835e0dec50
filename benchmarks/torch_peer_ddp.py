"""PyTorch peer of `python -m emulator bench ddp`: DDP over gloo on 2 processes (needs torch).

    python benchmarks/torch_peer_ddp.py --steps 3 --batch 8     # one JSON line: medians, s

The model and step of benchmarks/torch_peer_model.py (V=512 T=128 H=256 A=4 L=4, S=128, AdamW)
as an nn.Module, float32, one intra-op thread per process. T_single: one process, the whole
global batch, before the process group exists. T_ddp: torch.nn.parallel.DistributedDataParallel
(default 25 MB buckets, gradients averaged) on 2 processes over gloo, half the batch each.
Per-step times after one warm-up step; the median of --steps.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

V, T, H, A, L = 512, 128, 256, 4, 4
F = 4 * H


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.w1, self.w2 = nn.Linear(H, F), nn.Linear(F, H)

    def forward(self, x, mask):
        B, S, _ = x.shape
        a = self.ln1(x)
        q, k, v = (f(a).view(B, S, A, H // A).transpose(1, 2) for f in (self.q, self.k, self.v))
        sc = (q @ k.transpose(-1, -2)) / math.sqrt(H // A)
        o = torch.softmax(sc.masked_fill(mask, float("-inf")), -1) @ v
        x = x + self.o(o.transpose(1, 2).reshape(B, S, H))
        return x + self.w2(nn.functional.gelu(self.w1(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok = nn.Parameter(torch.randn(V, H, generator=g) * 0.02)
        self.pos = nn.Parameter(torch.randn(T, H, generator=g) * 0.02)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens, targets):
        S = tokens.shape[1]
        mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)
        x = self.tok[tokens] + self.pos[:S]
        for b in self.blocks:
            x = b(x, mask)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.view(-1, V), targets.view(-1))


def _batches(n: int, batch: int):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, V, (batch, T), generator=g), torch.randint(0, V, (batch, T), generator=g))
        for _ in range(n)
    ]


def _steps(model, batches, steps: int) -> float:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    ts = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        model(*batches[i]).backward()
        opt.step()
        if i:  # the first step warms up
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _ddp(rank: int, port: int, steps: int, batch: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    half = batch // 2
    mine = [(x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half])
            for x, y in _batches(steps + 1, batch)]  # fmt: skip
    model = nn.parallel.DistributedDataParallel(GPT())
    dist.barrier()
    t = _steps(model, mine, steps)
    dist.barrier()
    if rank == 0:
        out.put(t)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    single = _steps(GPT(), _batches(args.steps + 1, args.batch), args.steps)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_ddp, args=(r, port, args.steps, args.batch, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    ddp = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
    if any(p.exitcode for p in procs):
        print(f"torch DDP peer: a process failed: {[p.exitcode for p in procs]}", file=sys.stderr)
        return 1
    print(json.dumps({"single": single, "ddp": ddp}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
