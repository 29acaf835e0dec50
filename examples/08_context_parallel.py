"""Context parallelism - ring attention, all-gather K/V, Ulysses - checked against the reference.

    python -m emulator run -n 4 examples/08_context_parallel.py --cp 4 --method ring --balance zigzag
    python -m emulator run -n 4 examples/08_context_parallel.py --cp 4 --method all-gather
    python -m emulator run -n 4 examples/08_context_parallel.py --cp 4 --method ulysses
    python -m emulator run -n 4 examples/08_context_parallel.py --cp 2 --dp 2 --moe
    python -m emulator run -n 2 examples/08_context_parallel.py --cp 2 --balance contiguous
    mpiexec -n 4 python examples/08_context_parallel.py --cp 4
    python -m emulator run -n 4 examples/08_context_parallel.py --cp 2 --tp 2 --sequence-parallel
    mpiexec -n 8 python examples/08_context_parallel.py --cp 4 --tp 2 --method ring --sequence-parallel

Every sequence is split over the cp ranks (contiguous, or zigzag: rank r holds chunks r and
2cp-1-r of 2cp); everything outside attention runs on the local tokens, the position embedding
takes the rows of their global positions, and the weights' gradients are summed over dp x cp.
--tp splits the heads (and MLP, vocabulary) first, cp attention runs on each tp rank's heads;
--sequence-parallel also cuts each cp rank's S/cp tokens into tp slices between the TP regions
(parallel/context/layout.sp_table), all-gathered back before attention.
Trains --steps steps through parallel.train (Layout dp x cp x tp) with --method and checks loss,
every gradient and the parameters on every rank against emulator.reference.reference_train
(float64, 1e-12), and every rank's bytes per axis against parallel/nd_cost.rank_bytes. Then, on
the cp group, runs one attention layer of each method on random q, k, v (the training
micro-batch's shape, the tp rank's heads) and checks each rank's output against the single-rank
emulator.ops attention. Printed: the positions each rank holds; the ring's work per rank per
step, contiguous vs zigzag (ledger of computed blocks == work.py); bytes per rank per layer
forward and backward of all three methods beside their formulas (parallel/context/cost.py); the
training run's bytes per axis per rank; the attention cache and the block activations per rank
beside theirs; the verdict. Exits 1 on any mismatch.
"""

from __future__ import annotations

import sys

import numpy as np

import parallel
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.ledger import format_table
from emulator.model import ModelConfig
from emulator.ops import attention_backward, attention_forward
from emulator.reference import reference_train
from parallel import Layout, nd_cost
from parallel.context import cost, layout, work
from parallel.context.attention import (
    METHODS,
    cache_nbytes,
    cp_attention_backward,
    cp_attention_forward,
)
from parallel.context.train import routing_groups
from parallel.context.ulysses import check_heads
from tools import args as cli
from tools.run import progress, record, run_example, say_verdict

PARSER = cli.parser(__doc__)
PARSER.add_argument("--cp", type=cli.positive_int, default=4, help="context-parallel degree")
PARSER.add_argument("--dp", type=cli.positive_int, default=1, help="data-parallel degree")
PARSER.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel degree")
PARSER.add_argument("--sequence-parallel", action="store_true",
                    help="SP on the tp group (tp > 1): S/(cp tp) tokens per rank between blocks")  # fmt: skip
PARSER.add_argument("--method", choices=METHODS, default="ring")
PARSER.add_argument("--balance", choices=layout.BALANCES, default="zigzag")
PARSER.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
PARSER.add_argument("--moe", action="store_true", help="MoE blocks: a routing group per cp rank")
PARSER.add_argument("--microbatches", type=cli.positive_int, default=1)
PARSER.add_argument("--batch", type=cli.positive_int, default=None,
                    help="global batch B, a multiple of dp x microbatches (default 2 dp k)")  # fmt: skip
cli.add_common(PARSER, model={"vocab": 32, "seq": 32, "d_model": 32, "heads": 8, "layers": 2},
               steps=3)  # fmt: skip


def parse(argv=None):
    """The flags (--seq is the sequence length S = T); bad values exit 2 with one line."""
    a = cli.parse(PARSER, argv)
    cli.refuse_unless(PARSER, a, "--sequence-parallel", False, a.tp > 1,
                      "with --tp 1 (SP cuts the sequence over the tp group)")  # fmt: skip
    a.batch = a.batch or 2 * a.dp * a.microbatches
    return a


def make_layout(a) -> Layout:
    return Layout(dp=a.dp, cp=a.cp, tp=a.tp, sequence_parallel=a.sequence_parallel,
                  cp_method=a.method, cp_balance=a.balance, microbatches=a.microbatches,
                  recompute=a.recompute)  # fmt: skip


def make_cfg(a) -> ModelConfig:
    return ModelConfig(**cli.model_kwargs(a), d_ff=64, n_experts=4 if a.moe else 0, moe_top_k=2)


def attention_alone(cp_comm, method, b, S, H, A, balance, keep):
    """One layer of `method` on random inputs: (max |diff| vs ops, fwd bytes, bwd bytes,
    cache bytes, ring work) of this rank."""
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((b, S, H)) for _ in range(4))  # same on every rank
    o_ref, c = attention_forward(q, k, v, A)
    g_ref = attention_backward(do, c)
    tab = layout.table(S, cp_comm.size, balance)
    p, L = tab[cp_comm.rank], cp_comm.ledger
    mark = L.mark()
    o, cache = cp_attention_forward(cp_comm, q[:, p], k[:, p], v[:, p], A, positions=tab,
                                    method=method, keep_probs=keep)  # fmt: skip
    held = cache_nbytes(cache)
    g = cp_attention_backward(do[:, p], cache)
    diff = max(np.abs(x - y[:, p]).max() for x, y in zip((o, *g), (o_ref, *g_ref)))
    recs = L.since(mark)
    fb = [(L.sent(recs, tag=f"cp-attn/{d}"), L.received(recs, tag=f"cp-attn/{d}")) for d in
          ("fwd", "bwd")]  # fmt: skip
    return float(diff), fb[0], fb[1], held, cache["inner"].get("work")


def make_main(a):
    S, C, D, t, k = a.seq, a.cp, a.dp, a.tp, a.microbatches
    cfg, lay = make_cfg(a), make_layout(a)
    B = a.batch
    b, nl = B // (D * k), cfg.n_layers
    H, A = cfg.d_model // t, cfg.n_heads // t  # attention width and heads of one tp rank
    methods = [m for m in METHODS if m != "ulysses" or A % C == 0]
    sp = a.sequence_parallel

    def batches(step):
        return synthetic_batch(11 + a.seed, step, B, S, cfg.vocab_size)

    def main(comm) -> int:
        if comm.size != lay.world:
            raise ValueError(f"08: the world has {comm.size} ranks but --cp {C} x --dp {D} x "
                             f"--tp {t} = {lay.world}; run with -n {lay.world}")  # fmt: skip
        mesh = lay.mesh(comm)
        c, tab = mesh.coord("cp"), layout.table(S, C, a.balance)
        groups_fn = (lambda st, mb, bb, ss: routing_groups(bb, ss, tab)) if a.moe else None
        ref = reference_train(cfg, a.seed, batches, a.steps, microbatches=D * k, groups_fn=groups_fn,
                              recompute=a.recompute, max_norm=1.0)  # fmt: skip
        mark = comm.ledger.mark()
        run = parallel.train(comm, lay, cfg, progress(batches, a.steps), a.steps, a.seed,
                             max_norm=1.0)  # fmt: skip
        recs = comm.ledger.since(mark)
        worst, problems = compare_run(run, ref, 1e-12)
        want = cost.attention_bytes(a.method, b, S, H, A, C, 8)
        fwd = nl * k * want["forward"] * (2 if a.recompute == "full" else 1)
        bwd = nl * k * want["backward"]
        for s in range(a.steps):
            got = {d: tuple(sum(r.nbytes for r in recs if r.step == s and r.direction == x
                                and f"cp-attn/{d}" in r.tag) for x in ("send", "recv"))
                   for d in ("fwd", "bwd")}  # fmt: skip
            if got["fwd"] != (fwd, fwd) or got["bwd"] != (bwd, bwd):
                problems.append(f"rank {comm.rank} step {s}: attention bytes {got} != {fwd}/{bwd}")
        axes = nd_cost.rank_bytes(cfg, lay, B, S, run.coords)  # every axis, this rank's share
        for s, got in enumerate(run.step_bytes):
            if got != axes:
                problems.append(f"rank {comm.rank} step {s}: bytes by axis {got} != {axes}")
        act = block_formula(run.coords["cp"])
        if set(run.act_bytes.values()) != {act}:
            problems.append(f"rank {comm.rank}: block activations {run.act_bytes} != {act}")
        alone = {}
        for m in methods:
            for bal in layout.BALANCES:
                for keep in (True, False):
                    r = alone[m, bal, keep] = attention_alone(mesh["cp"], m, b, S, H, A, bal, keep)
                    problems += check_alone(m, bal, keep, r, c, comm.rank)
        every = comm.allgather_object((comm.rank, mesh.coords, alone, problems, run.act_bytes,
                                       run.step_bytes[-1], axes))  # fmt: skip
        if comm.rank == 0:
            report(every)
            failures = list(dict.fromkeys(x for e in every for x in e[3]))
            for x in failures:
                print("MISMATCH:", x)
            attn = max(r[0] for e in every for r in e[2].values())
            record(
                attention_alone_max_diff=attn,
                worst_vs_reference=worst,
                block_activation_bytes={e[0]: sorted(set(e[4].values())) for e in every},
                bytes_by_axis={e[0]: e[5] for e in every},
            )
            say_verdict(failures, f"cp={C} dp={D} tp={t}{' sp' if sp else ''} {a.method} "
                          f"{a.balance}{' moe' if a.moe else ''} recompute={a.recompute}: "
                          f"loss/grads/params vs reference {max(worst.values()):.1e}; attention "
                          f"alone vs ops {attn:.1e} ({len(methods)} methods x 2 balancings x "
                          f"keep/recompute); bytes per layer fwd/bwd and per axis, ring work, "
                          f"attention cache and block activations == formulas on {len(every)} "
                          f"ranks")  # fmt: skip
        return 0 if not problems else 1

    def block_formula(cp_rank: int) -> int:
        """One block's activation bytes on cp rank `cp_rank` (context/cost.py)."""
        kw = {"recompute": a.recompute, "balance": a.balance, "rank": cp_rank}
        if t == 1:
            return cost.block_activation_bytes(cfg, a.method, b, S, C, **kw)
        return cost.tp_block_activation_bytes(cfg, a.method, b, S, C, t, sp=sp, **kw)

    def check_alone(m, bal, keep, r, c, rank):
        diff, f, bw, held, steps = r
        want = cost.attention_bytes(m, b, S, H, A, C, 8)
        held_want = cost.cache_nbytes(m, b, S, H, A, C, 8, keep_probs=keep, balance=bal, rank=c)
        where = f"rank {rank} {m} {bal} keep_probs={keep}"
        bad = [f"{where}: attention vs ops {diff:.2e} > 1e-12"] if not diff <= 1e-12 else []
        if f != (want["forward"],) * 2 or bw != (want["backward"],) * 2:
            bad.append(f"{where}: bytes {f}/{bw} != {want}")
        if held != held_want:
            bad.append(f"{where}: cache {held} != {held_want}")
        if m == "ring" and [(x[1], x[2]) for x in steps] != work.steps(S, C, bal)[c]:
            bad.append(f"{where}: ring work {steps} != work.py {work.steps(S, C, bal)[c]}")
        return bad

    def report(every):
        per_tp = f" = d_model/tp, A={A} heads per tp rank" if t > 1 else ""
        print(f"mesh dp={D} x cp={C} x tp={t}{' + SP' if sp else ''}; model H={cfg.d_model} "
              f"A={cfg.n_heads} L={nl} F={cfg.d_ff}{' MoE E=4 K=2' if a.moe else ''}, float64; "
              f"micro-batch b={b} S={S}, k={k}; training: {a.method}, {a.balance}, "
              f"recompute={a.recompute}")  # fmt: skip
        print("\nglobal positions each cp rank holds")
        rows = [[bal, r, " ".join(map(str, layout.positions(S, C, r, bal)))]
                for bal in layout.BALANCES for r in range(C)]  # fmt: skip
        print(format_table(["balance", "cp rank", "positions"], rows))
        if sp:
            tab = layout.sp_table(S, C, t, a.balance)
            print(f"\nsequence parallel ({a.balance}): the positions each (cp, tp) rank holds "
                  f"between the TP regions, its slice of the cp rank's (sp_table); the SP "
                  f"all-gather before attention restores the cp rank's {S // C}")  # fmt: skip
            rows = [[r, j, " ".join(map(str, tab[r, j]))] for r in range(C) for j in range(t)]
            print(format_table(["cp rank", "tp rank", "positions"], rows))
        S_l = S // C
        print(f"\nring attention work per rank per step, in blocks of S_local^2 = {S_l * S_l} score"
              f" entries per (batch, head); 0 = fully masked, skipped (ledger == work.py)")  # fmt: skip
        for bal in layout.BALANCES:
            sm, got = work.summary(S, C, bal), {}
            for _, coords, alone, *_ in every:
                got[coords["cp"]] = [x[1] * x[2] for x in alone["ring", bal, True][4]]
            rows = [[r, *(_frac(e, S_l * S_l) for e in got[r]), _frac(sum(got[r]), S_l * S_l),
                     sm["skipped"][r], "yes" if got[r] == sm["entries"][r] else "NO"]
                    for r in range(C)]  # fmt: skip
            head = ["cp rank", *(f"step {j}" for j in range(C)), "total", "skipped", "== formula"]
            print(f"{bal}: critical path {_frac(sm['critical_path'], S_l * S_l)} blocks, "
                  f"max/mean {sm['imbalance']:.2f}")  # fmt: skip
            print(format_table(head, rows))
        print(f"all-gather and Ulysses compute every score entry of their rows, masked ones too (as"
              f" emulator.ops does): S_local x S per head per rank = {C} blocks, balanced by "
              f"construction")  # fmt: skip
        print(f"\nbytes per rank per layer (micro-batch b={b}, S={S}, H={H}{per_tp}, x=y=8 B), "
              f"sent = received, every rank; ledger / formula")  # fmt: skip
        rows = []
        for m in methods:
            want = cost.attention_bytes(m, b, S, H, A, C, 8)
            got = {(e[2][m, a.balance, True][1], e[2][m, a.balance, True][2]) for e in every}
            (f, bw), *rest = sorted(got)
            same = "" if not rest else " (ranks differ!)"
            rows.append([m, f"{f[0]}{same}", want["forward"], cost.FORMULAS[m][0], bw[0],
                         want["backward"], cost.FORMULAS[m][1]])  # fmt: skip
        print(format_table(["method", "fwd", "formula", "fwd formula", "bwd", "formula",
                            "bwd formula"], rows))  # fmt: skip
        names = list(every[0][6])
        print(f"\ntraining run ({a.method}): bytes each rank sent per step, by axis, ledger == "
              f"parallel/nd_cost.rank_bytes ('!= n' names a formula it missed); dp: DDP on the "
              f"dp x cp group")  # fmt: skip
        rows = [[e[0], e[1]["dp"], e[1]["cp"], e[1]["tp"],
                 *(f"{e[5][x]}" + ("" if e[5][x] == e[6][x] else f" != {e[6][x]}") for x in names)]
                for e in every]  # fmt: skip
        print(format_table(["rank", "dp", "cp", "tp", *names], rows))
        print(f"\nattention cache per cp rank, {a.balance}: bytes kept for the backward (ledger == "
              f"cost.cache_nbytes); single-rank ops attention: {8 * b * S * (3 * H + A * S)} / "
              f"{24 * b * S * H}")  # fmt: skip
        rows = []
        for m in methods:
            for keep in (True, False):
                held = {e[1]["cp"]: e[2][m, a.balance, keep][3] for e in every
                        if not e[1]["dp"] and not e[1]["tp"]}  # fmt: skip
                rows.append([m, "keep" if keep else "recompute", *(held[r] for r in range(C))])
        print(format_table(["method", "probs", *(f"cp {r}" for r in range(C))], rows))
        fn = "block_activation_bytes" if t == 1 else "tp_block_activation_bytes"
        rows = [[e[0], e[1]["cp"], e[1]["tp"], " ".join(map(str, sorted(set(e[4].values())))),
                 block_formula(e[1]["cp"])] for e in every]  # fmt: skip
        print(f"\ntraining run ({a.method}, recompute={a.recompute}): activation bytes per block")
        print(format_table(["rank", "cp rank", "tp rank", "ledger", f"cost.{fn}"], rows))

    return main


def _frac(n: int, unit: int) -> str:
    """n / unit as '3', '1/2', '5/2' or '0'."""
    from fractions import Fraction

    f = Fraction(n, unit)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def check_args(a) -> None:
    """The flags together -> a ValueError naming them, before any rank starts."""
    try:
        if a.sequence_parallel:  # each cp rank's S/cp into tp slices too
            layout.check_sp(a.seq, a.cp, a.tp, a.balance)
        else:
            layout.check(a.seq, a.cp, a.balance)
    except ValueError as e:
        sp = f" / --tp {a.tp} --sequence-parallel" if a.sequence_parallel else ""
        raise ValueError(
            f"argument --seq {a.seq} / --cp {a.cp}{sp} / --balance {a.balance}: {e}"
        ) from None
    if a.method == "ulysses" and a.heads % a.tp == 0:
        try:
            check_heads(a.heads // a.tp, a.cp)
        except ValueError as e:
            per = f" (heads per tp rank: {a.heads} / --tp {a.tp})" if a.tp > 1 else ""
            raise ValueError(f"argument --heads {a.heads} / --cp {a.cp} (ulysses){per}: "
                             f"{e}") from None  # fmt: skip
    if a.batch % (a.dp * a.microbatches):
        dk = a.dp * a.microbatches
        raise ValueError(f"argument --batch: {a.batch} is not a multiple of --dp {a.dp} x "
                         f"--microbatches {a.microbatches} = {dk}; choose --batch "
                         f"{dk * max(1, a.batch // dk)}")  # fmt: skip
    bad = make_layout(a).problems(None, make_cfg(a), (a.batch, a.seq))  # tp's divisibility, ...
    if bad:
        raise ValueError(f"arguments --tp {a.tp} / --cp {a.cp}: {'; '.join(bad)}")


if __name__ == "__main__":
    args = parse()
    try:
        check_args(args)
    except ValueError as e:
        PARSER.error(str(e))
    world = args.cp * args.dp * args.tp
    cli.check_world(PARSER, world, f"--cp {args.cp} x --dp {args.dp} x --tp {args.tp}")
    sys.exit(run_example(make_main(args), args, world_size=world))
