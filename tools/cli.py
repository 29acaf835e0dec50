"""The command line, `python -m emulator run | tour | bench`.

python -m emulator run -n 16 examples/01_collectives.py [script args]   # 16 virtual ranks
python -m emulator tour                                                  # every example, verdicts
python -m emulator bench collectives | model | layouts | dryrun | ranks | messages | torch  # tables
python -m emulator plan memory | collective | bubble [flags]             # planning (planning/)
python -m emulator dryrun --preset NAME --dp D --zero Z                  # shape-only run

A bad flag or value is one line on stderr and exit code 2 (tools/args.py); anything else that
goes wrong is one line naming what failed, the traceback only with --debug (or DISTEMU_DEBUG=1).
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys

from emulator import launcher as _launch

from . import args as cli

BENCHES = {
    "collectives": "benchmarks.collectives",
    "model": "benchmarks.model",
    "layouts": "benchmarks.layouts",
    "dryrun": "benchmarks.dryrun",
    "ranks": "benchmarks.ranks",
    "messages": "benchmarks.messages",
    "ddp": "benchmarks.ddp",
    "torch": "benchmarks.torch_peer_model",
}


def _check_run(p, args: argparse.Namespace) -> None:
    """-n before the script, not under mpiexec (whose -n is the world), the script a file."""
    if args.n is None:
        if "-n" in args.script_args or any(a.startswith("-n") for a in args.script_args):
            p.error(f"argument -n: goes before the script; flags after {args.script} are its "
                    f"own: python -m emulator run -n N {args.script} ...")  # fmt: skip
        p.error(f"argument -n: required, the number of virtual ranks: python -m emulator run "
                f"-n 4 {args.script}")  # fmt: skip
    if _launch.under_mpi():
        have = cli.planned_world_size(args.n)
        if have != args.n:
            p.error(f"argument -n: {args.n} has no effect under mpiexec, which started {have} "
                    f"ranks; use mpiexec -n {args.n} python {args.script}, or drop mpiexec")  # fmt: skip
    if not os.path.isfile(args.script):
        p.error(f"argument script: {args.script!r} is not a file")


def _run(args: argparse.Namespace) -> int:
    _launch.requested_world_size = args.n
    sys.argv = [args.script, *args.script_args]
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exc:  # the script's own exit code is ours
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        _launch.requested_world_size = None
    return 0


def _bench(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(BENCHES[args.what])
    except ModuleNotFoundError as exc:
        raise SystemExit(f"bench {args.what}: {exc}; this benchmark is not built yet") from exc
    entry = getattr(module, "main", None) or getattr(module, f"bench_{args.what}")
    return entry(args.bench_args) or 0


def main(argv=None) -> int:
    parser = cli.Parser(prog="python -m emulator", description=__doc__.split("\n")[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=cli.Parser)
    run = sub.add_parser("run", help="run an SPMD script on N virtual ranks")
    run.add_argument("-n", type=cli.ranks_flag, default=None, help="number of virtual ranks")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    tour = sub.add_parser("tour", help="run every example on virtual ranks; one verdict each")
    tour.add_argument("--only", default=None, help="run the examples whose name contains this")
    tour.add_argument("--timeout", type=cli.positive_float, default=600.0,
                      help="seconds per example before it counts as failed")  # fmt: skip
    bench = sub.add_parser("bench", help="print a benchmark table")
    bench.add_argument("what", choices=sorted(BENCHES))
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    for name, what in (("plan", "memory | collective | bubble"), ("dryrun", "shape-only run")):
        p = sub.add_parser(name, help=f"{name} {what} (planning/; --help after it for flags)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("plan", "dryrun"):  # their flags are planning/'s, parsed there
        module = importlib.import_module(f"planning.{'cli' if argv[0] == 'plan' else 'dry_cli'}")
        return module.main(argv[1:])
    args = parser.parse_args(argv)
    debug = args.debug or bool(os.environ.get("DISTEMU_DEBUG"))
    if args.debug:  # `python -m emulator --debug run ...` reaches the script's handler too
        os.environ["DISTEMU_DEBUG"] = "1"
    try:
        if args.command == "run":
            _check_run(run, args)
            return _run(args)
        if args.command == "tour":
            from tools.tour import tour

            return tour(args.only, timeout=args.timeout)
        return _bench(args)
    except Exception as exc:  # noqa: BLE001 - anything outside an example's handler: one line
        from .run import report_error

        report_error(exc, debug, f"python -m emulator {args.command}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
