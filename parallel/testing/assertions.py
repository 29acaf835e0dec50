"""Assertions for your own layouts: against the single-rank reference, byte and memory formulas.

    from parallel.testing import check_layout, assert_bytes

    def my_train(comm, cfg, seed, batches, steps, **optim):   # your layout, on every rank
        ...                                                   # -> an object with .losses,
        return run                                            #    .grads, .params (full shape)

    check_layout(my_train, cfg, world_size=4, steps=3, weight_decay=0.1)

`check_layout` runs the layout on virtual ranks, trains `emulator.reference.reference_train` on
the same global batches with the same optimizer settings, and compares EVERY rank's run (a
replica that skipped an update fails too): the loss of every step, every named gradient of the
last step and every parameter after the last step, float64 to 1e-12 relative by default. A
failure names the rank, the tensor, its max difference and its worst entries.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools

import emulator
from emulator.check import compare_run
from emulator.data import synthetic_batch
from emulator.reference import reference_train
from parallel.layout import Layout
from parallel.train import train

OPTIM = ("lr", "betas", "eps", "weight_decay", "max_norm")
SHOW = 6  # problems listed per rank: the first ones name where to look


def assert_matches_reference(run, ref, *, rtol: float = 1e-12, rank=None,
                             param_atol: float | None = None, noise_floor: float = 1e-6) -> dict:  # fmt: skip
    """Raise AssertionError unless `run` (.losses, .grads, .params by full name) matches the
    reference run `ref` within `rtol` (see emulator.check.compare_run). -> the worst figures."""
    worst, problems = compare_run(run, ref, rtol, param_atol=param_atol, noise_floor=noise_floor)
    if problems:
        where = "" if rank is None else f"rank {rank}: "
        more = [f"... and {len(problems) - SHOW} more"] if len(problems) > SHOW else []
        raise AssertionError(f"{where}run differs from the reference:\n  "
                             + "\n  ".join(problems[:SHOW] + more))  # fmt: skip
    return worst


def check_layout(layout_or_fn, cfg, world_size: int | None = None, *, steps: int = 2,
                 batch: int | None = None, seq: int | None = None, seed: int = 0,
                 data_seed: int = 1, ref_microbatches: int = 1, rtol: float = 1e-12,
                 timeout: float = 60, **optim) -> dict:  # fmt: skip
    """Run a layout on virtual ranks and compare every rank's run with reference_train(cfg,
    seed, batches, steps, microbatches=ref_microbatches, **optim), where `batches(step)` ->
    the global (tokens, targets) of the synthetic task (B = batch, default 2 x world_size;
    S = seq, default max_seq_len). -> the worst figures over all ranks {"loss", "grad", "param"}.

    layout_or_fn: a `parallel.Layout` (trained by `parallel.train` on layout.world ranks, in
    layout.dtype, against the reference with dp x micro-batches micro-batches; its
    tp-replicated copies must agree bitwise too), or your own
    `train_fn(comm, cfg, seed, batches, steps, **optim)` on `world_size` ranks."""
    if isinstance(layout_or_fn, Layout):
        layout = layout_or_fn
        if world_size not in (None, layout.world):
            raise ValueError(f"check_layout: world_size={world_size} but {layout} needs "
                             f"{layout.world} ranks; leave world_size out")  # fmt: skip
        if layout.dtype != "float64" and rtol == 1e-12:
            raise ValueError(f"check_layout: {layout.dtype} needs its own tolerance; pass rtol "
                             f"(parallel/check/ has the measured rules)")  # fmt: skip
        cfg = dataclasses.replace(cfg, dtype=layout.dtype)
        train_fn = functools.partial(_train_layout, layout)
        world_size, ref_microbatches = layout.world, layout.dp * layout.microbatches
    elif world_size is None:
        raise TypeError("check_layout: give world_size with a train function")
    else:
        train_fn = layout_or_fn
    if unknown := sorted(set(optim) - set(OPTIM)):
        raise TypeError(f"check_layout: unknown optimizer settings {unknown}; use {OPTIM}")
    if steps < 1:
        raise ValueError(f"check_layout: steps={steps} must be >= 1 (a run of no steps "
                         f"compares nothing)")  # fmt: skip
    B = 2 * world_size if batch is None else batch
    S = cfg.max_seq_len if seq is None else seq
    batches = lambda step: synthetic_batch(data_seed, step, B, S, cfg.vocab_size)
    ref = reference_train(cfg, seed, batches, steps, microbatches=ref_microbatches, **optim)
    runs = emulator.spawn(
        lambda comm: train_fn(comm, cfg, seed, batches, steps, **optim), world_size,
        timeout=timeout,
    )  # fmt: skip
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    failures = []
    for r, run in enumerate(runs):
        try:
            w = assert_matches_reference(run, ref, rtol=rtol, rank=r)
        except AssertionError as e:
            failures.append(str(e))
            continue
        worst = {k: max(worst[k], w[k]) for k in worst}
    if failures:
        raise AssertionError("\n".join(failures))
    return worst


def _train_layout(layout, comm, cfg, seed, batches, steps, **optim):
    run = train(comm, layout, cfg, batches, steps, seed, **optim)
    if run.replica_mismatch:  # tp- / dp-replicated copies must be the same bits on every rank
        raise AssertionError(f"rank {comm.rank}: replicas differ: {run.replica_mismatch}")
    return run


def _tagged(ledger, direction: str, op, records=None) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in ledger.records if records is None else records:
        if rec.direction == direction and (op is None or rec.op == op):
            out[rec.tag] = out.get(rec.tag, 0) + rec.nbytes
    return out


def assert_bytes(ledger, expected: dict, *, direction: str = "send", op: str | None = None,
                 records=None, exhaustive: bool = True) -> None:  # fmt: skip
    """Bytes per scope tag equal `expected` exactly: {tag or fnmatch pattern: bytes}. A
    pattern sums every tag it matches. With `exhaustive`, bytes under tags no pattern
    matches are an error too (traffic you did not predict). direction "send" or "recv"."""
    if direction not in ("send", "recv"):
        raise ValueError(f"assert_bytes: direction={direction!r} must be 'send' or 'recv'")
    got = _tagged(ledger, direction, op, records)
    problems, seen = [], set()
    for pattern, want in expected.items():
        tags = [t for t in got if fnmatch.fnmatchcase(t, pattern)]
        seen.update(tags)
        have = sum(got[t] for t in tags)
        if have != want:
            problems.append(f"{direction} bytes under {pattern!r}: {have} != expected {want} "
                            f"(tags {sorted(tags) or 'none'})")  # fmt: skip
    if exhaustive and (extra := {t: b for t, b in got.items() if t not in seen}):
        problems.append(f"{direction} bytes under tags nothing expected: {extra}")
    if problems:
        raise AssertionError("\n".join(problems))


def assert_memory(memory, expected: dict, *, which: str = "peak") -> None:
    """The memory ledger's bytes per category equal `expected` exactly ({category: bytes};
    which = "peak" or "current")."""
    if which not in ("peak", "current"):
        raise ValueError(f"assert_memory: which={which!r} must be 'peak' or 'current'")
    get = memory.peak if which == "peak" else memory.current
    problems = [f"{which} {c} bytes: {get(c)} != expected {b}" for c, b in expected.items()
                if get(c) != b]  # fmt: skip
    if problems:
        raise AssertionError("\n".join(problems))
