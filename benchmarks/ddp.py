"""DDP efficiency on 2 MPI ranks, T_single / (2 T_ddp), beside PyTorch DDP over gloo.

    python -m emulator bench ddp [--rounds 3] [--steps 3] [--batch 8]

The model is `bench model`'s (V=512 T=128 H=256 A=4 L=4, S=128, about 3.5 M parameters),
float32, one BLAS / intra-op thread per process. Ours: `parallel.data.train.train_data_parallel`
(stage "ddp": buckets, ring all-reduce, the ledger and the collective check as in any run)
under `mpiexec -n 2`; T_single is the same program on a 1-rank group while the other rank
waits (its poll sleeps), on the same global batch. PyTorch's peer (benchmarks/torch_peer_ddp.py)
runs the same shape and step with torch.nn.parallel.DistributedDataParallel over gloo; T_single
there is one process alone. Efficiency 1.0 means two ranks take exactly half the time of one.
Rounds interleave ours and torch's (A B A B, each a fresh launch); per-step times are the gaps
between steps (the first step is a warm-up), the median per launch. Printed: min / median / max
over the rounds. The run checks itself: the DDP losses equal the single rank's (float32).
Torch is not a dependency: without it (`import torch` fails) its part is skipped with a message.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import args as cli

SHAPE = {"vocab_size": 512, "max_seq_len": 128, "d_model": 256, "n_heads": 4, "n_layers": 4}
ONE_THREAD = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


def _timed_run(comm, cfg, batches, steps: int):
    """(run, seconds of each step after the first): the gaps between the steps' batch calls."""
    from parallel.data.train import train_data_parallel

    marks = []

    def batch(step):
        marks.append(time.perf_counter())
        return batches[step]

    run = train_data_parallel(comm, cfg, 0, batch, steps + 1, stage="ddp")
    marks.append(time.perf_counter())
    return run, [b - a for a, b in itertools.pairwise(marks[1:])]


def worker(args) -> int:
    """Under mpiexec -n 2: one JSON line (rank 0) {"single": s, "ddp": s}, medians per step."""
    from emulator.data import synthetic_batch
    from emulator.model import ModelConfig
    from emulator.mpi import world_comm

    comm = world_comm(timeout=600)
    if comm.size != 2:
        raise SystemExit(f"bench ddp: the worker needs mpiexec -n 2, got {comm.size} ranks")
    cfg = ModelConfig(**SHAPE, dtype="float32")
    batches = [synthetic_batch(0, s, args.batch, SHAPE["max_seq_len"], 512) for s in range(99)]
    single = comm.group([0], name="single") if comm.rank == 0 else None
    comm.barrier()
    if single is not None:
        run1, t1 = _timed_run(single, cfg, batches, args.steps)
    comm.barrier()  # rank 1 waits here while rank 0 runs alone (the wait sleeps after 50 ms)
    run2, t2 = _timed_run(comm, cfg, batches, args.steps)
    comm.barrier()
    if comm.rank == 0:
        bad = [(a, b) for a, b in zip(run1.losses, run2.losses) if abs(a - b) > 1e-5 * abs(a)]
        if bad:
            raise SystemExit(f"bench ddp: DDP losses differ from the single rank's: {bad}")
        print(json.dumps({"single": statistics.median(t1), "ddp": statistics.median(t2)}))
    comm.world.finish(comm)
    return 0


def _launch(cmd: list, what: str, path: str | None = None) -> dict:
    env = {**os.environ, **ONE_THREAD, **({"PYTHONPATH": path} if path else {})}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"bench ddp: {what} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return json.loads(lines[-1])


def _eff(t: dict) -> float:
    return t["single"] / (2 * t["ddp"])


def main(argv=None) -> int:
    ap = cli.parser(__doc__, prog="python -m emulator bench ddp")
    ap.add_argument("--rounds", type=cli.positive_int, default=3, help="interleaved launches")
    ap.add_argument("--steps", type=cli.positive_int, default=3, help="timed steps per launch")
    ap.add_argument("--batch", type=cli.positive_int, default=8, help="global batch (even)")
    ap.add_argument("--worker", action="store_true", help=argparse_hidden())
    ap.add_argument("--before", metavar="CHECKOUT", help="also interleave another checkout's "
                    "emulator (its packages on PYTHONPATH, this worker): before / after")  # fmt: skip
    args = ap.parse_args(argv)
    if args.batch % 2:
        ap.error(f"argument --batch: {args.batch} is odd; 2 ranks need an even global batch")
    if args.worker:
        return worker(args)
    mpiexec = Path(sys.executable).with_name("mpiexec")
    common = ["--steps", str(args.steps), "--batch", str(args.batch)]
    ours_cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", sys.executable]
    ours_cmd += ["-m", "benchmarks.ddp", "--worker", *common]
    peer = Path(__file__).with_name("torch_peer_ddp.py")
    has_torch = importlib.util.find_spec("torch") is not None
    torch_cmd = [sys.executable, str(peer), *common]
    ours, theirs, before = [], [], []
    # this file's worker over the other checkout's packages (run by path: -c keeps the script's
    # folder, whose collectives.py would shadow the package, off sys.path)
    run_here = (
        f"import runpy; runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')"
    )
    before_cmd = ours_cmd[:4] + ["-c", run_here, *ours_cmd[6:]]
    for _ in range(args.rounds):
        if args.before:
            before.append(_launch(before_cmd, "the other checkout's worker", args.before))
        ours.append(_launch(ours_cmd, "our DDP worker"))
        if has_torch:
            theirs.append(_launch(torch_cmd, "the PyTorch DDP peer"))
    print(f"DDP efficiency T_single / (2 T_ddp), 2 ranks, float32, global batch {args.batch}, "
          f"{args.steps} timed steps per launch, {args.rounds} interleaved rounds, "
          f"1 thread per process; load {os.getloadavg()[0]:.1f}")  # fmt: skip
    rows = [("ours (MPI)", ours)] + ([("torch DDP/gloo", theirs)] if has_torch else [])
    rows += [("--before (MPI)", before)] if before else []
    for name, ts in rows:
        e = sorted(_eff(t) for t in ts)
        single = statistics.median(t["single"] for t in ts) * 1e3
        ddp = statistics.median(t["ddp"] for t in ts) * 1e3
        print(f"  {name:15s} efficiency min/median/max {e[0]:.2f} / {statistics.median(e):.2f} "
              f"/ {e[-1]:.2f}   (median T_single {single:.0f} ms, T_ddp {ddp:.0f} ms)")  # fmt: skip
    if has_torch:
        r = sorted(_eff(a) / _eff(b) for a, b in zip(ours, theirs))
        print(f"  ours / torch efficiency per round: min/median/max {r[0]:.2f} / "
              f"{statistics.median(r):.2f} / {r[-1]:.2f} (goal >= 1)")  # fmt: skip
    else:
        print("  torch is not installed here: the PyTorch DDP/gloo peer is skipped "
              "(pip install torch in another environment to compare)")  # fmt: skip
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
