"""Where a layout step's time goes: cProfile categories per rank, and the byte ledger's recording
and the collective call check as a share of the step (`python -m emulator bench layouts --costs`).

Profile: every rank thread runs under its own cProfile.Profile timed by that thread's CPU clock
(time.thread_time), and the reference step under one profile timed the same way; each
function's own time (tottime) goes to one category by its file. CPU, not wall: a wall-clock
profile of threads under one GIL charges a rank's wait for the interpreter to whatever function
it is in (an earlier version of this table read "waiting 15-83%" that way), while the CPU clock
charges each thread only what it ran. Cells read "layout / reference" CPU ms (the layout's
summed over its ranks); the thread-CPU clock makes every profiled call cost a little more on
both sides alike. "waiting" is the CPU of lock and Condition calls themselves.

Ledger / check share: three variants of the same step, interleaved per round - as shipped;
spawn(check=False) (no cross-rank call check); and check=False with Comm._record replaced by a
no-op for this benchmark only (patched here, never in library code: the runs then ledger no
bytes). share = (t_real - t_variant) / t_real per round; min / median / max printed. The shares
are small differences of noisy times (a 150 ms step varies +-30% on this machine), so the < 5%
verdict is the profile's own time of the recording (Comm._record, Record.__init__, Ledger.add)
and check functions as a share of all ranks' time; the timed shares are printed beside it.

Messages free (unprofiled, `MessageClock`): each rank thread's CPU inside the emulator's
communication calls - a collective's whole call frame (both backends open one: OpenCall), a
point-to-point send / recv / sendrecv outside any collective, the control plane (object gathers,
barrier(), group creation) - summed over the ranks, in interleaved rounds (the reference step,
then the layout under the clock). "rest" is the layout's process CPU minus what the clock found
in those calls: its compute, its own Python, the joins of the end-of-run unshard. rest /
reference is the ratio the row would have if every message, check and gather cost nothing:
what no change to the message path can take it below. CPU, not wall: at the small size a
run's rank threads share one core (emulator/affinity.py; cores busy ~1.0), so there the CPU
ratio is the wall ratio's floor too; at the compute size the ranks' GEMMs run on both cores
and the wall ratio is well below the CPU ratio. The clock wraps every communication
call, nested ones included; its cost measured inside the noise (DDP, small: 82.5 against 82.2
ms CPU with and without it, medians of 21 interleaved rounds).
"""

from __future__ import annotations

import collections
import contextlib
import cProfile
import pstats
import statistics
import threading
import time
from unittest import mock

import emulator
from emulator import blas
from emulator.comm import Comm
from emulator.ledger import format_table
from emulator.local import VirtualComm
from emulator.mpi_call import OpenCall
from emulator.reference import reference_train

from .layouts import batches_for, config, load, spread, step_fns, timed

CATEGORIES = [  # (name, predicate on (file, function)); the first that matches wins
    ("waiting (lock / Condition)", lambda f, n: "acquire" in n or f.endswith("threading.py")),
    ("ledger recording", lambda f, n: n == "_record" or (f.endswith("ledger.py") and n == "add")),
    ("ledger queries", lambda f, n: f.endswith("ledger.py")),
    ("call check", lambda f, n: n in ("_check", "signature", "describe", "check_call",
                                      "mismatch_message")),
    ("message path (emulator/, collectives/)", lambda f, n: "/collectives/" in f
     or f.endswith(("emulator/local.py", "emulator/world.py", "emulator/comm.py", "emulator/mesh.py",
                    "emulator/mailbox.py", "emulator/watchdog.py", "emulator/message.py",
                    "emulator/mpi_call.py"))),
    ("optimizer + clip (optim.py, clip.py)", lambda f, n: f.endswith(("optim.py", "clip.py"))),
    ("parameter init (config.py)", lambda f, n: f.endswith("emulator/config.py")),
    ("model NumPy (ops, block, model)", lambda f, n: f.endswith((
        "ops.py", "block.py", "model.py", "precision.py", "moe.py", "attention.py"))
     or "numpy" in f or n.startswith(("<method", "<built-in method numpy", "{method"))),
    ("layout Python (parallel/)", lambda f, n: "/parallel/" in f),
]  # fmt: skip


def category(file: str, name: str) -> str:
    return next((c for c, pred in CATEGORIES if pred(file, name)), "other Python")


def _categorised(stats) -> dict:
    out = collections.Counter()
    for (file, _line, name), (_cc, _nc, tt, _ct, callers) in stats.stats.items():
        if file == "<string>" and name == "__init__":  # dataclass inits: Record's is recording
            rec = sum(v[2] for k, v in callers.items() if k[2] == "_record")
            out["ledger recording"] += rec
            tt -= rec
        out[category(file, name)] += tt
    return dict(out)


def profile(case, size: str) -> tuple[dict, int]:
    """Own CPU seconds per category summed over the ranks, and ledger records per rank, one
    step (after a warm-up step)."""
    cfg = config(size, case.moe)
    batches = batches_for(cfg)
    profs, lock = [], threading.Lock()

    def rank(comm):
        pr = cProfile.Profile(time.thread_time)
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
    return _categorised(stats), max(records)


def reference_profile(case, size: str) -> dict:
    """The same categories for the reference step on the same global batch (one thread)."""
    cfg = config(size, case.moe)
    batches = batches_for(cfg)
    with blas.limit(blas.per_rank(case.ranks)):
        reference_train(cfg, 0, batches, 1, microbatches=case.ref_microbatches)  # warm-up
        pr = cProfile.Profile(time.thread_time)
        pr.enable()
        reference_train(cfg, 0, batches, 1, microbatches=case.ref_microbatches)
        pr.disable()
    return _categorised(pstats.Stats(pr))


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


class MessageClock:
    """Thread CPU inside the emulator's communication calls by kind, summed over the threads
    (`clocked` patches them for its block, this benchmark only). A call inside another - a
    ring step's sendrecv in its collective, a group's creation check - counts as the outer."""

    KINDS = ("collectives", "point-to-point", "control plane")

    def __init__(self):
        self.cpu = dict.fromkeys(self.KINDS, 0.0)
        self.calls = dict.fromkeys(self.KINDS, 0)
        self._lock, self._local = threading.Lock(), threading.local()

    def _begin(self) -> None:
        """Open a call on this thread: the outermost one starts the clock (None: nested)."""
        stack = self._local.__dict__.setdefault("starts", [])
        stack.append(None if stack else time.thread_time())

    def _end(self, kind: str) -> None:
        start = self._local.starts.pop()
        if start is not None:
            spent = time.thread_time() - start
            with self._lock:
                self.cpu[kind] += spent
                self.calls[kind] += 1

    def _timed(self, fn, kind: str):
        def call(*args, **kw):
            self._begin()
            try:
                return fn(*args, **kw)
            finally:
                self._end(kind)

        return call

    @contextlib.contextmanager
    def clocked(self):
        enter, leave = OpenCall.__enter__, OpenCall.__exit__

        def open_call(call):
            self._begin()
            try:
                return enter(call)
            except BaseException:  # a refused call (a mismatch) never reaches __exit__
                self._end("collectives")
                raise

        def close_call(call, *exc):
            try:
                return leave(call, *exc)
            finally:
                self._end("collectives")

        patches = [(OpenCall, "__enter__", open_call), (OpenCall, "__exit__", close_call)]
        patches += [(VirtualComm, n, self._timed(getattr(VirtualComm, n), "point-to-point"))
                    for n in ("send", "recv", "sendrecv")]  # fmt: skip
        patches += [(VirtualComm, "allgather_object",
                     self._timed(VirtualComm.allgather_object, "control plane")),
                    (Comm, "group", self._timed(Comm.group, "control plane"))]  # fmt: skip
        with contextlib.ExitStack() as stack:
            for owner, name, fn in patches:
                stack.enter_context(mock.patch.object(owner, name, fn))
            yield self


def messages_free(case, size: str, rounds: int) -> dict:
    """Interleaved rounds of (reference, layout under a MessageClock): per round the process CPU
    s of each, the clock's CPU s per kind and its calls (lists, one entry per round)."""
    ref, lay = step_fns(case, size)
    ref(), lay()  # warm-up
    out = {"ref": [], "lay": [], "calls": [], **{k: [] for k in MessageClock.KINDS}}
    for _ in range(rounds):
        out["ref"].append(timed(ref)[1])
        clock = MessageClock()
        with clock.clocked():
            out["lay"].append(timed(lay)[1])
        for kind in MessageClock.KINDS:
            out[kind].append(clock.cpu[kind])
        out["calls"].append(sum(clock.calls.values()))
    return out


def messages_row(case, m) -> list:
    """One table row, medians in ms; rest = the layout's CPU minus its calls' (per round)."""
    med = statistics.median
    inside = [sum(ks) for ks in zip(*(m[k] for k in MessageClock.KINDS))]
    rest = [lay - c for lay, c in zip(m["lay"], inside)]
    ratio = [lay / ref for lay, ref in zip(m["lay"], m["ref"])]
    free = [r / ref for r, ref in zip(rest, m["ref"])]
    ms = lambda xs: f"{1e3 * med(xs):.1f}"
    return [case.label, ms(m["ref"]), ms(m["lay"]), *(ms(m[k]) for k in MessageClock.KINDS),
            ms(rest), f"{med(m['calls']) / case.ranks:.0f}", spread(ratio, "{:.2f}"),
            spread(free, "{:.2f}")]  # fmt: skip


MESSAGE_COLUMNS = ["layout", "reference", "layout", "in collectives", "in point-to-point",
                   "in control plane", "rest", "calls / rank", "layout / reference min/med/max",
                   "rest / reference min/med/max"]  # fmt: skip


def costs(sizes, chosen, rounds: int) -> None:
    for size in sizes:
        prof_rows, share_rows, free_rows = [], [], []
        print(f"\n== size {size}; load average before {load()}")
        for case in chosen:
            cats, n_rec = profile(case, size)
            ref = reference_profile(case, size)
            total, ref_total = sum(cats.values()), sum(ref.values())
            names = [c for c, _ in CATEGORIES] + ["other Python"]
            prof_rows.append([case.label, n_rec, f"{1e3 * total:.0f} / {1e3 * ref_total:.0f}",
                              f"{total / ref_total:.2f}"] + [
                f"{1e3 * cats.get(c, 0.0):.1f} / {1e3 * ref.get(c, 0.0):.1f}" for c in names
            ])  # fmt: skip
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
            free_rows.append(messages_row(case, messages_free(case, size, rounds)))
        print("cProfile own CPU ms by category, layout (summed over the ranks) / reference, one "
              "step after a warm-up")  # fmt: skip
        print(format_table(["layout", "records / rank", "CPU ms", "CPU ratio"]
                           + [c for c, _ in CATEGORIES] + ["other Python"], prof_rows))  # fmt: skip
        print(f"\nledger + call check share of the step, {rounds} interleaved rounds")
        print(format_table(["layout", "step ms min/med/max", "call check share min/med/max",
                            "ledger + check share min/med/max", "1 - min/min",
                            "profile: ledger + check",
                            "< 5%"], share_rows))  # fmt: skip
        print(f"\nmessages free: CPU ms of the step (medians of {rounds} interleaved rounds), "
              f"the ranks' CPU inside the emulator's communication calls (summed over "
              f"the ranks) and the rest; rest / reference: the ratio if every message, check "
              f"and gather cost nothing")  # fmt: skip
        print(format_table(MESSAGE_COLUMNS, free_rows))
        print(f"load average after {load()}")
