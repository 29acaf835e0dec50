"""PyTorch eager peer of `python -m emulator bench model`: the same model, batch and step, side by side.

The peer is the same transformer written in PyTorch eager (V=512 T=128 H=256 A=4 L=4 B=8, biases,
causal softmax attention, tanh GELU, mean cross-entropy, torch.optim.AdamW with the spec's
hyper-parameters), started from our init_params and our batch, so the two compute the same
function: the first loss of each is printed and compared (float64: equal to ~1e-12).

    python -m benchmarks.torch_peer_model [--threads 1 2] [--dtype float32 float64] [--rounds 5]
    python -m emulator bench torch ...                  # the same

Each round runs ours and the peer once each, A B then B A (neither always second), every run in
a fresh child process with that many threads (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS /
MKL_NUM_THREADS in its environment, plus torch.set_num_threads and blas.limit): separate
processes, so neither side's idle thread pools spin against the other. A child takes the median
of ``--steps`` steps after two warm-up steps, in wall time, in CPU time (the process's, all its
threads: on a shared machine the one-thread CPU ratio is the steadier figure) and in the main
thread's CPU time (spin-waits count: BLAS and OpenMP workers spin there); the ratio ours /
torch is per round, and min / median / max are printed. torch is not a dependency of this project: without it the
benchmark says so and exits 0 (it is never run by the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from tools import args as cli

DTYPES = ("float32", "float64")


def our_step(dtype: str, batch: int):
    """-> (step() -> loss, first-loss) for emulator.model on benchmarks.model's SHAPE."""
    from benchmarks.model import SHAPE
    from emulator.data import synthetic_batch
    from emulator.model import ModelConfig, init_params, model_backward, model_forward
    from emulator.optim import AdamW

    cfg = ModelConfig(**SHAPE, dtype=dtype)
    params = init_params(cfg, 0)
    opt = AdamW(params)
    tokens, targets = synthetic_batch(0, 0, batch, cfg.max_seq_len, cfg.vocab_size)

    def step():
        loss, cache = model_forward(params, tokens, targets, cfg)
        opt.step(params, model_backward(cache))
        return loss

    return step


def torch_step(dtype: str, batch: int):
    """The same model in PyTorch eager, from the same initial parameters and batch."""
    import torch
    import torch.nn.functional as fn

    from benchmarks.model import SHAPE
    from emulator.data import synthetic_batch
    from emulator.model import ModelConfig, init_params

    cfg = ModelConfig(**SHAPE, dtype=dtype)
    V, H, A, L = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_layers
    p = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in init_params(cfg, 0).items()}
    tokens, targets = (
        torch.from_numpy(t) for t in synthetic_batch(0, 0, batch, cfg.max_seq_len, V)
    )
    B, S = tokens.shape
    opt = torch.optim.AdamW(p.values(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)  # key j > query i

    def heads(t):
        return t.view(B, S, A, H // A).transpose(1, 2)  # (B, A, S, D)

    def step():
        x = p["embed.tok"][tokens] + p["embed.pos"][:S]
        for i in range(L):
            b = {n[len(f"blocks.{i}.") :]: a for n, a in p.items() if n.startswith(f"blocks.{i}.")}
            a = fn.layer_norm(x, (H,), b["ln1.gain"], b["ln1.bias"], cfg.ln_eps)
            q, k, v = (heads(a @ b[f"attn.w{n}"] + b[f"attn.b{n}"]) for n in "qkv")
            sc = (q @ k.transpose(-1, -2)) / (H // A) ** 0.5
            o = (torch.softmax(sc.masked_fill(mask, float("-inf")), -1) @ v).transpose(1, 2)
            x = x + (o.reshape(B, S, H) @ b["attn.wo"] + b["attn.bo"])
            m = fn.layer_norm(x, (H,), b["ln2.gain"], b["ln2.bias"], cfg.ln_eps)
            h = fn.gelu(m @ b["mlp.w1"] + b["mlp.b1"], approximate="tanh")
            x = x + (h @ b["mlp.w2"] + b["mlp.b2"])
        xf = fn.layer_norm(x, (H,), p["final_ln.gain"], p["final_ln.bias"], cfg.ln_eps)
        loss = fn.cross_entropy((xf @ p["head.w"]).view(-1, V), targets.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss)

    return step


def child(side: str, dtype: str, threads: int, batch: int, steps: int) -> dict:
    """One side's timings in this process: two warm-up steps (the first loss kept), then steps."""
    from emulator import blas

    if side == "torch":
        import torch

        torch.set_num_threads(threads)
        step = torch_step(dtype, batch)
    else:
        step = our_step(dtype, batch)
    wall, cpu, main = [], [], []
    with blas.limit(threads):
        first = step()
        step()
        for _ in range(steps):
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
            step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            main.append(time.thread_time() - m0)
    ms = {
        k: statistics.median(v) * 1e3 for k, v in (("ms", wall), ("cpu_ms", cpu), ("main_ms", main))
    }
    return {**ms, "first_loss": first}


def run_child(side, dtype, threads, batch, steps) -> dict:
    env = dict(os.environ)
    env.update({k: str(threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                          "MKL_NUM_THREADS")})  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.torch_peer_model", "--child", side, "--dtype", dtype,
           "--threads", str(threads), "--batch", str(batch), "--steps", str(steps)]  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run(
        cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600, check=False
    )
    if out.returncode:
        raise SystemExit(f"torch_peer_model: the {side} child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _mmm(xs, fmt):
    return "/".join(fmt.format(v) for v in (min(xs), statistics.median(xs), max(xs)))


def main(argv=None) -> int:
    ap = cli.parser(__doc__, prog="python -m emulator bench torch")
    ap.add_argument("--threads", type=cli.positive_int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--rounds", type=cli.positive_int, default=5)
    ap.add_argument("--steps", type=cli.positive_int, default=3, help="timed steps per child")
    ap.add_argument("--batch", type=cli.positive_int, default=8)
    ap.add_argument("--child", choices=("ours", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        res = child(args.child, args.dtype[0], args.threads[0], args.batch, args.steps)
        print(json.dumps(res))
        return 0
    if importlib.util.find_spec("torch") is None:
        print("torch_peer_model: skipped - torch is not installed (it is not a dependency of "
              "this project; install it in a separate environment to compare)")  # fmt: skip
        return 0
    print(f"numpy {np.__version__}; load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    for t in args.threads:
        for dt in args.dtype:
            ours, peer = [], []
            for i in range(args.rounds):
                order = ("ours", "torch") if i % 2 == 0 else ("torch", "ours")
                got = {s: run_child(s, dt, t, args.batch, args.steps) for s in order}
                ours.append(got["ours"])
                peer.append(got["torch"])
            l0, l1 = ours[0]["first_loss"], peer[0]["first_loss"]
            for key, what in (("ms", "wall"), ("cpu_ms", "CPU"), ("main_ms", "main")):
                ratio = [a[key] / b[key] for a, b in zip(ours, peer, strict=True)]
                print(f"{dt} {t} thread(s) {what:4s} ms: ours {_mmm([r[key] for r in ours], '{:.1f}')}"
                      f"  torch {_mmm([r[key] for r in peer], '{:.1f}')}  ours/torch "
                      f"{_mmm(ratio, '{:.3f}')}")  # fmt: skip
            print(f"  (min/median/max over {args.rounds} rounds, median of {args.steps} steps each; "
                  f"first loss {l0:.12g} vs torch {l1:.12g}, |diff| {abs(l0 - l1):.1e})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
