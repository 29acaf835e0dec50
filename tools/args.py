"""The flags every example and command shares, their validators, and one-line errors.

A bad value is a user error: one line on stderr naming the flag, the value and what would be
valid, exit code 2 (argparse's), printed once per job - by rank 0 only when mpiexec started one
process per rank - and never a traceback.

    p = args.parser(__doc__)                      # a Parser: one-line errors
    args.add_common(p, model=SIZES, batch=16, steps=3)   # --seed --json --debug + size flags
    p.add_argument("--pp", type=args.positive_int, default=4)
    a = args.parse(p)                              # parse, then check the size flags together
    cfg = ModelConfig(**args.model_kwargs(a))

This file uses only `emulator` (so examples and benchmarks may import it; tools/cli.py, above
everything, dispatches to them).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from emulator.launcher import under_mpi

# the model-size flags and the ModelConfig field each sets
SIZE_FLAGS = {
    "vocab": "vocab_size",
    "seq": "max_seq_len",
    "d_model": "d_model",
    "heads": "n_heads",
    "layers": "n_layers",
}
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def process_rank() -> int:
    """This process's MPI rank from the launcher's environment (0 when not under MPI)."""
    for v in _RANK_VARS:
        if v in os.environ:
            try:
                return int(os.environ[v])
            except ValueError:
                return 0
    return 0


def say_once(line: str, stream=None) -> None:
    """Print `line` from rank 0's process only (every process of an mpiexec job parses argv)."""
    if process_rank() == 0:
        print(line, file=stream or sys.stderr, flush=True)


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block) printed by rank 0 only, exit code 2."""

    def error(self, message: str):  # argparse's hook for every parse error
        say_once(f"{self.prog}: error: {message} (see --help)")
        raise SystemExit(2)


def parser(doc: str | None, prog: str | None = None, **kw) -> Parser:
    """A Parser described by the first line of a module docstring."""
    first = (doc or "").strip().splitlines()[0] if doc else None
    return Parser(prog=prog, description=first, **kw)


# -- validators (argparse `type=`): the message says what would be valid ------------------------
def _number(text: str, kind, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {text!r}; need {what}") from None


def int_at_least(low: int):
    def check(text: str) -> int:
        v = _number(text, int, f"an integer >= {low}")
        if v < low:
            raise argparse.ArgumentTypeError(f"got {v}; need an integer >= {low}")
        return v

    check.__name__ = f"int >= {low}"
    return check


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def float_at_least(low: float, strict: bool = False):
    op = ">" if strict else ">="

    def check(text: str) -> float:
        v = _number(text, float, f"a number {op} {low:g}")
        if not (v > low if strict else v >= low) or not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"got {text}; need a finite number {op} {low:g}")
        return v

    check.__name__ = f"float {op} {low:g}"
    return check


positive_float = float_at_least(0.0, strict=True)
nonneg_float = float_at_least(0.0)


def add_common(p, *, model: dict | None = None, batch: int | None = None,
               steps: int | None = None, seed: int = 0) -> None:  # fmt: skip
    """--seed, --json PATH, --debug; with `model` ({"vocab": V, "seq": T, "d_model": H,
    "heads": A, "layers": L} defaults) the size flags; --batch / --steps when given defaults."""
    g = p.add_argument_group("common")
    g.add_argument("--seed", type=nonneg_int, default=seed, help="seed of init and data")
    if model is not None:
        helps = {"vocab": "V", "seq": "T (positions; S <= T)", "d_model": "H", "heads": "A",
                 "layers": "L"}  # fmt: skip
        for flag in SIZE_FLAGS:
            if flag in model:
                g.add_argument(f"--{flag.replace('_', '-')}", type=positive_int,
                               default=model[flag], help=f"model {helps[flag]}")  # fmt: skip
    if batch is not None:
        g.add_argument("--batch", type=positive_int, default=batch, help="global batch B")
    if steps is not None:
        g.add_argument("--steps", type=positive_int, default=steps, help="optimizer steps")
    g.add_argument("--json", metavar="PATH", default=None,
                   help="write the per-rank bytes, memory and the verdict as JSON")  # fmt: skip
    g.add_argument("--debug", action="store_true",
                   help="show tracebacks (also: DISTEMU_DEBUG=1)")  # fmt: skip


def model_kwargs(a) -> dict:
    """ModelConfig's size fields from the parsed size flags (only those the parser has)."""
    return {field: getattr(a, flag) for flag, field in SIZE_FLAGS.items() if hasattr(a, flag)}


def check_model(p, a) -> None:
    """The size flags together: d_model a multiple of heads; the JSON path writable."""
    if hasattr(a, "d_model") and hasattr(a, "heads") and a.d_model % a.heads:
        p.error(f"argument --d-model: {a.d_model} is not a multiple of --heads {a.heads}; "
                f"choose --d-model {a.heads * max(1, a.d_model // a.heads)} or --heads dividing "
                f"{a.d_model}")  # fmt: skip
    path = getattr(a, "json", None)
    if path is not None:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            p.error(f"argument --json: {path!r}: folder {folder} does not exist")


def refuse_unless(p, a, flag: str, default, needs: bool, why: str) -> None:
    """A flag that does nothing in the chosen mode is an error, not silently ignored."""
    attr = flag.lstrip("-").replace("-", "_")
    v = getattr(a, attr)
    if v != default and not needs:
        p.error(f"argument {flag}{'' if isinstance(v, bool) else ' ' + str(v)}: no effect {why}")


def parse(p, argv=None):
    """parse_args, then the checks of check_model; DISTEMU_DEBUG=1 also sets --debug."""
    a = p.parse_args(argv)
    check_model(p, a)
    if os.environ.get("DISTEMU_DEBUG") and hasattr(a, "debug"):
        a.debug = True
    return a


def planned_world_size(default: int) -> int:
    """How many ranks the launch will have: mpiexec's size, `run -n`, else `default`."""
    for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if v in os.environ:
            return int(os.environ[v])
    from emulator import launcher

    return launcher.requested_world_size or default


def check_world(p, want: int, what: str, default: int | None = None) -> None:
    """Refuse (exit 2) when the job's rank count is not the `want` the flags need."""
    have = planned_world_size(want if default is None else default)
    if have != want:
        how = "mpiexec -n" if under_mpi() else "python -m emulator run -n"
        p.error(f"{what} needs {want} ranks but this job has {have}; start it with {how} {want}")


# -- how many virtual ranks this machine can hold ----------------------------------------------
PER_RANK_BYTES = 1 << 20  # a conservative resident estimate per virtual rank (stack, mailboxes)


def max_virtual_ranks() -> tuple[int, str]:
    """(the most virtual ranks - threads - this machine can hold, why): the smaller of the
    per-user thread limit (RLIMIT_NPROC), the kernel's threads-max / 2 and available memory /
    1 MiB per rank. Unknown limits (no /proc, no resource module) are skipped."""
    limits = []
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NPROC)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append((soft - 64, f"per-user thread limit (ulimit -u) {soft}"))
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    try:
        with open("/proc/sys/kernel/threads-max") as f:
            tmax = int(f.read())
        limits.append((tmax // 2, f"kernel threads-max {tmax} (half of it)"))
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))
        why = f"{avail / 2**30:.1f} GiB available at ~1 MiB per rank"
        limits.append((avail // PER_RANK_BYTES, why))
    except (OSError, ValueError, StopIteration):
        pass
    if not limits:
        return 1 << 16, "no limit could be read; 65,536 assumed"
    n, why = min(limits)
    return max(1, n), why


def ranks_flag(text: str) -> int:
    """argparse type: a virtual-rank count, 1 .. max_virtual_ranks()."""
    n = positive_int(text)
    most, why = max_virtual_ranks()
    if n > most:
        raise argparse.ArgumentTypeError(
            f"got {n}; this machine holds at most {most:,} virtual ranks (threads; {why})"
        )
    return n
