"""`python -m emulator tour`: run every example on virtual ranks and print one verdict per run.

Each example checks itself (against the single-rank reference, NumPy's definition or a formula)
and ends with "VERDICT: PASS - <what was checked>" or "VERDICT: FAIL - <what failed>"
(emulator.check.verdict), exiting non-zero when a check fails. A run passes when it exits 0 and
its last verdict says PASS. The tour runs each in its own process, so one failure cannot hide
another, and exits non-zero if any did.
"""

from __future__ import annotations

import subprocess
import sys
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
    ("06_nd_mesh.py", 8, ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "1"]),
    (
        "06_nd_mesh.py",
        8,
        ["--dp", "2", "--pp", "2", "--tp", "2", "--zero", "3", "--sequence-parallel"],
    ),
    ("06_nd_mesh.py", 8, ["--zero", "2", "--schedule", "interleaved", "--chunks", "2", "--moe"]),
    ("07_expert_parallel.py", 4, ["--ep", "4", "--experts", "8", "--top-k", "2"]),
    ("07_expert_parallel.py", 4, ["--ep", "4", "--dispatch", "padded"]),
    ("07_expert_parallel.py", 8, ["--dp", "2", "--ep", "4", "--top-k", "3", "--grad-sync", "ddp"]),
    ("07_expert_parallel.py", 4, ["--ep", "2", "--top-k", "8", "--dtype", "mixed"]),  # K = E
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "ring", "--balance", "zigzag"]),
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "all-gather"]),
    ("08_context_parallel.py", 4, ["--cp", "4", "--method", "ulysses"]),
    ("08_context_parallel.py", 2, ["--cp", "2", "--balance", "contiguous", "--recompute", "full"]),
    ("08_context_parallel.py", 4, ["--cp", "2", "--dp", "2", "--moe", "--method", "ring"]),
]


def tour(only: str | None = None) -> int:
    if not EXAMPLES.is_dir():
        print(
            f"tour: no examples folder at {EXAMPLES}; run from a source checkout (pip install -e)"
        )
        return 2
    failed = ran = 0
    for script, n, args in RUNS:
        path = EXAMPLES / script
        if not path.exists() or (only and only not in script):
            continue
        ran += 1
        cmd = [sys.executable, "-m", "emulator", "run", "-n", str(n), str(path), *args]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        dt = time.perf_counter() - t0
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT:")]
        verdict = lines[-1][len("VERDICT:") :].strip() if lines else "(no verdict line printed)"
        ok = proc.returncode == 0 and verdict.startswith("PASS - ")
        verdict = verdict.removeprefix("PASS - ")  # the PASS/FAIL column says it
        failed += not ok
        label = " ".join([script, f"-n {n}", *args])
        status = "PASS" if ok else "SKIP" if verdict.startswith("SKIP - ") else "FAIL"
        print(f"{status}  {label:<60} {dt:6.1f} s  {verdict}")  # SKIP counts as not passed
        if not ok:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            print("      " + "\n      ".join(tail))
    print(f"tour: {ran - failed} of {ran} runs passed")
    return 1 if failed or not ran else 0
