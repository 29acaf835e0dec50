"""Where a layout step's time goes: cProfile categories per rank, and the byte ledger's recording
and the collective call check as a share of the step (`python -m emulator bench layouts --costs`).

Profile: every rank thread runs under its own cProfile.Profile (cProfile sees one thread); the
ranks' stats are merged and each function's own time (tottime) is put in one category by its
file. NumPy's operators run inside the Python function that uses them, so "model NumPy" is the
model's arithmetic; "waiting" is time blocked on a lock or Condition (a rank waiting for a
message or for the GIL-holding rank to send it).

Ledger / check share: three variants of the same step, interleaved per round - as shipped;
spawn(check=False) (no cross-rank call check); and check=False with Comm._record replaced by a
no-op for this benchmark only (patched here, never in library code: the runs then ledger no
bytes). share = (t_real - t_variant) / t_real per round; min / median / max printed. The shares
are small differences of noisy times (a 150 ms step varies +-30% on this machine), so the < 5%
verdict is the profile's own time of the recording (Comm._record, Record.__init__, Ledger.add)
and check functions as a share of all ranks' time; the timed shares are printed beside it.
"""

from __future__ import annotations

import collections
import cProfile
import pstats
import threading
from unittest import mock

import emulator
from emulator.comm import Comm
from emulator.ledger import format_table

from .layouts import batches_for, config, load, spread, timed

CATEGORIES = [  # (name, predicate on (file, function)); the first that matches wins
    ("waiting (lock / Condition)", lambda f, n: "acquire" in n or f.endswith("threading.py")),
    ("ledger recording", lambda f, n: n == "_record" or (f.endswith("ledger.py") and n == "add")),
    ("ledger queries", lambda f, n: f.endswith("ledger.py")),
    ("call check", lambda f, n: n in ("_check", "signature", "describe", "check_call")
     or f.endswith("emulator/rank.py")),
    ("message path (emulator/, collectives/)", lambda f, n: "/collectives/" in f
     or f.endswith(("emulator/local.py", "emulator/comm.py", "emulator/mesh.py"))),
    ("model NumPy (ops, block, model, optim)", lambda f, n: f.endswith((
        "ops.py", "block.py", "model.py", "optim.py", "precision.py", "moe.py", "attention.py"))
     or "numpy" in f or n.startswith(("<method", "<built-in method numpy", "{method"))),
    ("layout Python (parallel/)", lambda f, n: "/parallel/" in f),
]  # fmt: skip


def category(file: str, name: str) -> str:
    return next((c for c, pred in CATEGORIES if pred(file, name)), "other Python")


def profile(case, size: str) -> tuple[dict, int]:
    """Own time per category summed over the ranks, and ledger records per rank, one step."""
    cfg = config(size, case.moe)
    batches = batches_for(cfg)
    profs, lock = [], threading.Lock()

    def rank(comm):
        pr = cProfile.Profile()
        pr.enable()
        try:
            case.run(comm, cfg, batches)
        finally:
            pr.disable()
            with lock:
                profs.append(pr)
        return len(comm.ledger.records)

    emulator.spawn(lambda c: case.run(c, cfg, batches), case.ranks, timeout=600)  # warm-up
    records = emulator.spawn(rank, case.ranks, timeout=600)
    stats = pstats.Stats(profs[0])
    for pr in profs[1:]:
        stats.add(pr)
    out = collections.Counter()
    for (file, _line, name), (_cc, _nc, tt, _ct, callers) in stats.stats.items():
        if file == "<string>" and name == "__init__":  # dataclass inits: Record's is recording
            rec = sum(v[2] for k, v in callers.items() if k[2] == "_record")
            out["ledger recording"] += rec
            tt -= rec
        out[category(file, name)] += tt
    return dict(out), max(records)


def variants(case, size: str):
    cfg = config(size, case.moe)
    batches = batches_for(cfg)

    def real():
        emulator.spawn(lambda c: case.run(c, cfg, batches), case.ranks, timeout=600)

    def no_check():
        emulator.spawn(lambda c: case.run(c, cfg, batches), case.ranks, timeout=600, check=False)

    def neither():
        with mock.patch.object(Comm, "_record", lambda self, direction, peer, nbytes: None):
            no_check()

    return real, no_check, neither


def costs(sizes, chosen, rounds: int) -> None:
    for size in sizes:
        prof_rows, share_rows = [], []
        print(f"\n== size {size}; load average before {load()}")
        for case in chosen:
            cats, n_rec = profile(case, size)
            total = sum(cats.values())
            prof_rows.append([case.label, n_rec] + [
                f"{100 * cats.get(c, 0.0) / total:.0f}%" for c, _ in CATEGORIES
            ] + [f"{100 * cats.get('other Python', 0.0) / total:.0f}%"])  # fmt: skip
            real, no_check, neither = variants(case, size)
            real(), no_check(), neither()  # warm-up
            t = {"real": [], "check": [], "both": [], "v1": [], "v2": []}
            for _ in range(rounds):
                a, b, c = timed(real)[0], timed(no_check)[0], timed(neither)[0]
                t["real"].append(a)
                t["v1"].append(b)
                t["v2"].append(c)
                t["check"].append((a - b) / a)
                t["both"].append((a - c) / a)
            best = 1 - min(t["v2"]) / min(t["real"])
            led = cats.get("ledger recording", 0.0) / total
            chk = cats.get("call check", 0.0) / total
            share_rows.append([case.label, spread(t["real"], scale=1e3),
                               spread(t["check"], "{:+.1%}"), spread(t["both"], "{:+.1%}"),
                               f"{best:+.1%}",
                               f"{led:.1%} + {chk:.1%}",
                               "yes" if led + chk < 0.05 else "no"])  # fmt: skip
        print("cProfile own time by category, summed over the ranks (one step, after a warm-up)")
        print(format_table(["layout", "records / rank"] + [c for c, _ in CATEGORIES]
                           + ["other Python"], prof_rows))  # fmt: skip
        print(f"\nledger + call check share of the step, {rounds} interleaved rounds")
        print(format_table(["layout", "step ms min/med/max", "call check share min/med/max",
                            "ledger + check share min/med/max", "1 - min/min",
                            "profile: ledger + check",
                            "< 5%"], share_rows))  # fmt: skip
        print(f"load average after {load()}")
