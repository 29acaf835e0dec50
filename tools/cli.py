"""The command line, `python -m emulator run | tour | bench`.

python -m emulator run -n 16 examples/01_collectives.py [script args]   # 16 virtual ranks
python -m emulator tour                                                  # every example, verdicts
python -m emulator bench collectives | model | layouts                   # benchmark tables
python -m emulator plan memory | collective | bubble [flags]             # planning (planning/)
python -m emulator dryrun --preset NAME --dp D --zero Z                  # shape-only run
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys

from emulator import launcher as _launch

BENCHES = {
    "collectives": "benchmarks.collectives",
    "model": "benchmarks.model",
    "layouts": "benchmarks.layouts",
    "dryrun": "benchmarks.dryrun",
}


def _run(args: argparse.Namespace) -> int:
    if args.n < 1:
        raise SystemExit(f"run: -n must be a positive number of ranks, got {args.n}")
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
    if args.what not in BENCHES:
        raise SystemExit(f"bench: unknown benchmark {args.what!r}; choose from {sorted(BENCHES)}")
    try:
        module = importlib.import_module(BENCHES[args.what])
    except ModuleNotFoundError as exc:
        raise SystemExit(f"bench {args.what}: {exc}; this benchmark is not built yet") from exc
    entry = getattr(module, "main", None) or getattr(module, f"bench_{args.what}")
    return entry(args.bench_args) or 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m emulator", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an SPMD script on N virtual ranks")
    run.add_argument("-n", type=int, required=True, help="number of virtual ranks")
    run.add_argument("script")
    run.add_argument("script_args", nargs=argparse.REMAINDER)
    tour = sub.add_parser("tour", help="run every example on virtual ranks; one verdict each")
    tour.add_argument("--only", default=None, help="run the examples whose name contains this")
    bench = sub.add_parser("bench", help="print a benchmark table")
    bench.add_argument("what", help=f"one of {sorted(BENCHES)}")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    for name, what in (("plan", "memory | collective | bubble"), ("dryrun", "shape-only run")):
        p = sub.add_parser(name, help=f"{name} {what} (planning/; --help after it for flags)")
        p.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("plan", "dryrun"):  # their flags are planning/'s, parsed there
        module = importlib.import_module(f"planning.{'cli' if argv[0] == 'plan' else 'dry_cli'}")
        return module.main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args)
    if args.command == "tour":
        from tools.tour import tour

        return tour(args.only)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
