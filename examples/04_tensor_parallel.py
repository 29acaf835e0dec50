"""Tensor parallelism (Megatron) and sequence parallelism, checked against the reference.

    python -m emulator run -n 4 examples/04_tensor_parallel.py --tp 4
    python -m emulator run -n 4 examples/04_tensor_parallel.py --tp 4 --sequence-parallel
    python -m emulator run -n 4 examples/04_tensor_parallel.py --tp 2 --dp 2 [--dp-stage 1]
    mpiexec -n 4 python examples/04_tensor_parallel.py --tp 4

Trains a small model with wq/wk/wv and w1 column-parallel, wo and w2 row-parallel (Shoeybi et
al. 2019, section 3), a vocabulary-parallel embedding and cross-entropy, optionally sequence
parallel regions (Korthikanti et al. 2022, section 4.2.2) and data parallelism on a dp x tp mesh.
Then checks: loss, every gradient and parameter vs emulator.reference.reference_train; per rank,
the bytes of each layer (four all-reduces of B S H, or the same bytes as all-gathers and
reduce-scatters), of the embedding, head, SP gradient sum and clip norm, and the activation
bytes of each block, each beside its formula (parallel/tp_cost.py). Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys

import emulator
from emulator.check import compare_run, verdict
from emulator.data import synthetic_batch
from emulator.flops import megatron_activation_bytes
from emulator.ledger import format_table
from emulator.model import ModelConfig, param_shapes
from emulator.precision import compute_dtype
from emulator.reference import reference_train
from parallel import tp_cost
from parallel.dp_check import step_bytes as dp_step_bytes
from parallel.flat import make_buckets
from parallel.shard import describe, local_shape
from parallel.tensor import megatron_plan
from parallel.tp_train import tp_train

TEXT = {  # the formulas of parallel/tp_cost.py, per rank, k micro-batches, w bytes per element
    "blocks": "k (4 x 2(t-1)/t b s h w) [+ SP regather 2 (t-1)/t b s h w]",
    "embed": "k (2(t-1)/t b s h w)",
    "head": "k (2(t-1)/t b s h w + ring AR of b s and 2 b s fp)",
    "sp/grads": "SP: ring AR of L 6h + 2h + T h",
    "clip": "ring AR of one float64",
    "dp": "DDP 2 (D-1)/D P_pad w; ZeRO-1 RS + AG, the same (dp_check.step_bytes)",
}
RTOL = {"float64": 1e-12, "float32": 1e-4, "mixed": 0.1}  # not bitwise: sums in another order
# attn.bk's gradient is 0 up to rounding (emulator.check.compare): ~1e-19 of the largest gradient
# in float64, ~1e-11 in float32, ~1e-6 in bf16, where the smallest real one (attn.bq) is ~3e-4
NOISE = {"float64": 1e-6, "float32": 1e-6, "mixed": 1e-4}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--dp-stage", choices=["ddp", "1"], default="ddp")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--no-regather", action="store_true", help="SP: keep gathered inputs")
    p.add_argument("--moe", action="store_true", help="experts split like the dense MLP")
    p.add_argument("--dtype", choices=list(RTOL), default="float64")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=2)
    return p.parse_args(argv)


def make_main(a):
    cfg = ModelConfig(vocab_size=32, max_seq_len=16, d_model=32, n_heads=8, n_layers=2,
                      n_experts=4 if a.moe else 0, moe_top_k=2, dtype=a.dtype)  # fmt: skip
    B, S, k, sp, rg = 4 * a.dp, 8, a.microbatches, a.sequence_parallel, not a.no_regather
    b = B // (a.dp * k)  # the micro-batch one rank runs

    def batches(step):
        return synthetic_batch(11, step, B, S, cfg.vocab_size)

    def main(comm) -> int:
        mesh = emulator.Mesh(comm, dp=a.dp, tp=a.tp)
        plan = megatron_plan(cfg)
        t, r = a.tp, mesh.coord("tp")
        ref = reference_train(cfg, 0, batches, a.steps, microbatches=a.dp * k, max_norm=1.0)
        run = tp_train(mesh, cfg, 0, batches, a.steps, sequence_parallel=sp, regather=rg,
                       microbatches=k, max_norm=1.0, dp_stage=a.dp_stage)  # fmt: skip
        atol = None if a.dtype == "float64" else 2 * 1e-3 * a.steps  # 2 lr per step, see there
        worst, problems = compare_run(  # the same on every rank: full-shape, gathered
            run, ref, RTOL[a.dtype], param_atol=atol, noise_floor=NOISE[a.dtype]
        )
        L, last = comm.ledger, a.steps - 1
        got = {f"blocks.{i}": L.sent(L.select(tag=f"blocks.{i}/*", step=last)) for i in range(2)}
        got |= {
            x: L.sent(L.select(tag=f"{x}*", step=last))
            for x in ("embed", "head", "sp/grads", "clip")
        }
        want = tp_cost.step_bytes(cfg, b * k, S, t, sp=sp, regather=rg, microbatches=k, rank=r)
        want_layer = k * tp_cost.layer_bytes(cfg, b, S, t, sp=sp, regather=rg, rank=r)
        zero = a.dp > 1 and a.dp_stage == "1"
        if zero:  # ZeRO-1 takes the clip norm over dp and tp itself ("dp/clip", its formula)
            want["clip"] = 0
        got["dp"] = L.sent(L.select(tag="dp/grads*", step=last)) + L.sent(
            L.select(tag="dp/params*", step=last))  # fmt: skip
        shapes = {n: local_shape(x, plan[n], t, n) for n, x in param_shapes(cfg).items()}
        layouts = make_buckets(shapes, a.dp, 25.0, compute_dtype(cfg.dtype).itemsize)
        want["dp"] = sum(dp_step_bytes(a.dp_stage, layouts, cfg.dtype, k).values())
        rows, bad = [], []  # bad: this rank's bytes that differ from their formula
        for key, w in [("blocks.0", want_layer), ("blocks.1", want_layer)] + [
            (x, want[x]) for x in ("embed", "head", "sp/grads", "clip", "dp")
        ]:
            if got[key] != w:
                bad.append(f"rank {comm.rank}: {key} bytes {got[key]} != formula {w}")
            rows.append(
                [key, got[key], w, TEXT[key.split(".")[0]], "ok" if got[key] == w else "BAD"]
            )
        act = tp_cost.block_activation_bytes(cfg, b, S, t, sp=sp, regather=rg)
        act_got = run.act_bytes[f"mb{k - 1}.blocks.0"]
        if any(v != act for v in run.act_bytes.values()):
            bad.append(f"rank {comm.rank}: activation bytes {run.act_bytes} != {act} per block")
        every = comm.allgather_object((comm.rank, mesh.coords, rows, act_got, act, bad))
        problems += [msg for e in every for msg in e[-1]]
        if comm.rank == 0:
            print(f"mesh dp={a.dp} x tp={t}, sequence_parallel={sp}, regather={rg}, "
                  f"moe={a.moe}, dtype={a.dtype}, micro-batch b={b} S={S} H={cfg.d_model}")  # fmt: skip
            print(describe(megatron_plan(cfg), dict(list(param_shapes(cfg).items())[:16]), t))
            table = [[g, c["dp"], c["tp"], *row] for g, c, rws, *_ in every for row in rws]
            print(f"\nbytes sent per rank in the last step ({k} micro-batches; received is equal)")
            print(format_table(["rank", "dp", "tp", "what", "ledger", "formula", "", ""], table))
            one = megatron_activation_bytes(b, S, cfg.d_model, cfg.n_heads)
            modes = {"no SP": (False, True), "SP": (True, True), "SP kept": (True, False)}
            side = {m: tp_cost.block_activation_bytes(cfg, b, S, t, sp=x, regather=y)
                    for m, (x, y) in modes.items()}  # fmt: skip
            print("\nactivation bytes per block per rank by formula: " + ", ".join(
                f"{m} {v}" for m, v in side.items()))  # fmt: skip
            print(f"\nactivation bytes per block per rank: ledger {every[0][3]}, formula "
                  f"{every[0][4]} (single rank: {tp_cost.block_activation_bytes(cfg, b, S, 1)}; "
                  f"Megatron's 16-bit s b h (34 + 5 a s / h) at t=1 would be {one:.0f})")  # fmt: skip
            for msg in problems:
                print("MISMATCH:", msg)
            param = f"param {worst['param']:.1e}"
            if atol is not None:
                param = f"param max |diff| {worst['param']:.1e} (<= {atol:.0e})"
            checked = (
                f"tp={t} dp={a.dp} sp={sp} {a.dtype}, {a.steps} steps: max rel diff vs reference "
                f"(rtol {RTOL[a.dtype]:.0e}) loss {worst['loss']:.1e}, grad {worst['grad']:.1e}, "
                f"{param}; layer/embed/head/SP/clip/dp bytes ({sum(r[2] for r in rows)} B/step "
                f"sent by rank 0) and activation bytes ({act}/block) == formulas on {len(every)} "
                "ranks"
            )
            print(verdict(problems, checked))
        return 0 if not problems else 1

    return main


if __name__ == "__main__":
    args = parse()
    sys.exit(emulator.launch(make_main(args), world_size=args.tp * args.dp))
