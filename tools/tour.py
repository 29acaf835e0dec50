"""`python -m emulator tour`: run every example on virtual ranks and print one verdict per run.

Each example checks itself (against the single-rank reference, NumPy's definition or a formula)
and ends with "VERDICT: PASS - <what was checked>" or "VERDICT: FAIL - <what failed>"
(emulator.check.verdict), exiting non-zero when a check fails. A run passes when it exits 0 and
its last verdict says PASS. The tour runs each in its own process (in a scratch directory, so
the files a run writes - 05's Chrome trace - do not land in yours), so one failure cannot hide
another, prints each row as it finishes, and exits non-zero if any failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# (script, virtual ranks, arguments): the tour's runs, in reading order.
RUNS = [
    ("01_collectives.py", 8, []),
    ("02_train_reference.py", 1, []),
    ("03_data_parallel.py", 4, ["--stage", "ddp"]),
    ("03_data_parallel.py", 4, ["--stage", "1"]),
    ("03_data_parallel.py", 4, ["--stage", "2"]),
    ("03_data_parallel.py", 4, ["--stage", "3"]),
    ("03_data_parallel.py", 4, ["--stage", "3", "--dtype", "mixed", "--prefetch"]),
    ("03_data_parallel.py", 3, ["--stage", "3", "--no-reshard", "--batch", "12"]),
    ("03_data_parallel.py", 4, ["--stage", "2", "--dtype", "float32"]),
    ("03_data_parallel.py", 4, ["--stage", "1", "--dtype", "mixed", "--moe"]),
    ("04_tensor_parallel.py", 4, ["--tp", "4", "--sequence-parallel"]),
    ("04_tensor_parallel.py", 4, ["--tp", "2", "--dp", "2"]),
    ("04_tensor_parallel.py", 4, ["--tp", "2", "--dp", "2", "--dp-stage", "1", "--dtype", "mixed"]),
    ("04_tensor_parallel.py", 4, ["--tp", "4", "--moe", "--top-k", "4", "--dtype", "mixed"]),
    (
        "04_tensor_parallel.py",
        4,
        ["--tp", "2", "--dp", "2", "--moe", "--top-k", "4", "--dtype", "mixed"],
    ),  # K = E: never flips, every number compared
    ("05_pipeline.py", 4, ["--pp", "4", "--microbatches", "8", "--schedule", "gpipe"]),
    ("05_pipeline.py", 4, ["--pp", "4", "--microbatches", "8", "--schedule", "1f1b"]),
    ("05_pipeline.py", 4, ["--pp", "4", "--microbatches", "8", "--schedule", "interleaved"]),
    ("05_pipeline.py", 4, ["--pp", "4", "--microbatches", "8", "--schedule", "zb-h1"]),
    ("05_pipeline.py", 4, ["--pp", "2", "--dp", "2", "--dp-mode", "zero1", "--schedule", "zb-h1"]),
    ("05_pipeline.py", 4, ["--pp", "4", "--microbatches", "2", "--schedule", "zb-h1"]),
    ("05_pipeline.py", 4, ["--dtype", "mixed", "--max-norm", "0", "--schedule", "interleaved"]),
    ("05_pipeline.py", 4, ["--pp", "2", "--dp", "2", "--schedule", "1f1b", "--svg", "pp.svg"]),
    ("06_nd_mesh.py", 8, ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1"]),
    (
        "06_nd_mesh.py",
        8,
        ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "3", "--sequence-parallel"],
    ),
    ("06_nd_mesh.py", 8, ["--zero", "2", "--schedule", "interleaved", "--chunks", "2", "--moe"]),
    ("06_nd_mesh.py", 8, ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "2", "--svg", "nd.svg"]),
    ("06_nd_mesh.py", 8, ["--dp", "4", "--ep", "2", "--tp", "1", "--zero", "3"]),  # ZeRO x ep
    ("06_nd_mesh.py", 8, ["--dp", "2", "--ep", "2", "--cp", "2", "--tp", "1", "--zero", "1"]),
    ("07_expert_parallel.py", 4, ["--ep", "4", "--experts", "8", "--top-k", "2"]),
    ("07_expert_parallel.py", 4, ["--ep", "4", "--dispatch", "padded"]),
    ("07_expert_parallel.py", 8, ["--dp", "2", "--ep", "4", "--top-k", "3", "--grad-sync", "ddp"]),
    ("07_expert_parallel.py", 4, ["--ep", "2", "--top-k", "8", "--dtype", "mixed"]),  # K = E
    ("07_expert_parallel.py", 8, ["--dp", "2", "--ep", "2", "--tp", "2"]),  # dp x ep x tp
    ("07_expert_parallel.py", 8, ["--dp", "2", "--ep", "2", "--pp", "2", "--dispatch", "padded"]),
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "ring", "--balance", "zigzag"]),
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "all-gather"]),
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "ulysses"]),
    ("08_context_parallel.py", 2, ["--cp", "2", "--balance", "contiguous", "--recompute", "full"]),
    ("08_context_parallel.py", 4, ["--cp", "2", "--dp", "2", "--moe", "--method", "ring"]),
    (
        "08_context_parallel.py",
        8,
        ["--cp", "4", "--tp", "2", "--method", "ring", "--sequence-parallel"],
    ),
]


def tour(only: str | None = None, timeout: float = 600.0) -> int:
    """Run the RUNS whose script name contains `only` (all by default), each in its own process
    with `timeout` seconds; print each row as it finishes. -> 0 if all passed."""
    if not EXAMPLES.is_dir():
        print(
            f"tour: no examples folder at {EXAMPLES}; run from a source checkout (pip install -e)"
        )
        return 2
    runs = [r for r in RUNS if (EXAMPLES / r[0]).exists() and (not only or only in r[0])]
    if not runs:
        names = sorted({r[0] for r in RUNS if (EXAMPLES / r[0]).exists()})
        print(f"tour: error: argument --only: no example name contains {only!r}; the examples "
              f"are {', '.join(names)}", file=sys.stderr)  # fmt: skip
        return 2
    with tempfile.TemporaryDirectory(prefix="distemu-tour-") as scratch:  # files runs write
        return _tour(runs, timeout, scratch)


def _tour(runs, timeout: float, cwd: str) -> int:
    failed = 0
    for script, n, args in runs:
        path = EXAMPLES / script
        cmd = [sys.executable, "-m", "emulator", "run", "-n", str(n), str(path), *args]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True,
                                  timeout=timeout, cwd=cwd, env=_env())  # fmt: skip
            out, code = proc.stdout + proc.stderr, proc.returncode
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT:")]
            verdict = lines[-1][len("VERDICT:") :].strip() if lines else "(no verdict printed)"
        except subprocess.TimeoutExpired as exc:
            out = (_text(exc.stdout) + _text(exc.stderr)) or ""
            code, verdict = -1, f"(timed out after {timeout:g} s; tour --timeout raises it)"
        dt = time.perf_counter() - t0
        ok = code == 0 and verdict.startswith("PASS - ")
        verdict = verdict.removeprefix("PASS - ")  # the PASS/FAIL column says it
        failed += not ok
        label = " ".join([script, f"-n {n}", *args])
        status = "PASS" if ok else "SKIP" if verdict.startswith("SKIP - ") else "FAIL"
        print(f"{status}  {label:<60} {dt:6.1f} s  {verdict}", flush=True)  # SKIP: not passed
        if not ok and out.strip():
            tail = out.strip().splitlines()[-15:]
            print("      " + "\n      ".join(tail), flush=True)
    print(f"tour: {len(runs) - failed} of {len(runs)} runs passed", flush=True)
    return 1 if failed else 0


def _env() -> dict:
    """This process's environment, with the repository on PYTHONPATH (the runs start elsewhere)."""
    root = str(EXAMPLES.parent)
    path = os.environ.get("PYTHONPATH", "")
    parts = [os.path.abspath(p) for p in path.split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, *parts])}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
