"""`python -m emulator dryrun`: a small real-size run end to end, and one-line errors."""

import contextlib
import io
import json

import pytest

from planning import dry_cli


def run(argv: str):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = dry_cli.main(argv.split())
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("flags", ["--zero 3", "--zero 3 --prefetch", "--zero 3 --no-reshard",
                                   "--zero 2 --tp 2 --pp 2 --sequence-parallel",
                                   "--zero 1 --pp 4 --schedule interleaved --chunks 2 --microbatches 4"])  # fmt: skip
def test_every_representative_equals_nd_costs_formulas(flags):
    rc, out, _ = run(f"--preset llama2-7b --dp 2 --seq 32 --tags {flags}")
    rows = [line for line in out.split("\n") if " stage " in line and "rank(s)" in line]
    pp = 4 if "--pp 4" in flags else 2 if "--pp 2" in flags else 1
    assert rc == 0 and len(rows) == pp and "DIFFERENT" not in out
    assert all(line.endswith("equal") for line in rows), rows
    assert "through parallel.train" in out and "dp/grads" in out


@pytest.mark.parametrize("zero", [0, 1])
def test_dp_state_equals_this_models_exact_column(zero):
    from planning import exact, memory, presets

    rc, out, _ = run(f"--preset llama2-7b --dp 4 --zero {zero} --seq 64 --json")
    peak = json.loads(out)["ranks"]["0"]["memory"]["peak"]
    p = presets.get("llama2-7b")
    row = memory.plan(p, 4, 4, 1, 1, zero, "none", 64, 1, 0.0, even_pp=False)
    assert rc == 0 and sum(peak[c] for c in ("params", "grads", "optimizer")) == (
        exact.price(p, row, 64, 1).state
    )


def test_json_has_every_representative():
    rc, out, _ = run("--preset llama2-7b --dp 2 --pp 4 --tp 2 --seq 32 --json")
    ranks = json.loads(out)["ranks"]
    assert rc == 0 and sorted(ranks, key=int) == ["0", "2", "4", "6"]  # stage s at dp = tp = 0
    assert all(r["memory"]["peak"]["activations"] > 0 for r in ranks.values())
    assert all(r["differences_from_nd_cost"] == [] for r in ranks.values())


def test_context_parallel_still_dry_runs_through_cp_train():
    rc, out, _ = run("--preset llama2-7b --dp 2 --cp 2 --seq 32")
    assert rc == 0 and out.count("rank ") >= 2 and "cp=2" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        ("--preset gpt4", ["unknown preset 'gpt4'", "llama3-405b"]),
        ("--preset llama2-7b --pp 64", ["64 virtual stages", "only 32 blocks"]),
        ("--preset llama2-7b --tp 3", ["tp=3 does not divide n_heads=32"]),
        ("--preset llama2-7b --sequence-parallel", ["sequence_parallel=True needs tp > 1"]),
        ("--preset llama2-7b --dp 2 --ranks 0,5", ["ranks are 0..1"]),
        ("--preset llama2-7b --cp 2 --tp 2", ["cp=2", "dp x cp with DDP only"]),
    ],
)
def test_bad_input_is_one_line(argv, words):
    rc, out, err = run(argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    for w in words:
        assert w in err, err


def test_plan_memory_dry_run_columns_equal_this_models():
    from planning import exact, memory, presets

    p = presets.get("llama2-7b")
    rows = memory.strategies(p, 2, 32, 1, "none", 10)
    # ZeRO-3 ledgers its state; the tp driver ledgers activations (and dp buckets) only
    for r, ledgers_state in ((rows[3], True), (rows[4], False)):
        e = exact.price(p, r, 32, 1)
        state, activ, _ = exact.dry_figures(p, r, 32, 1)
        assert activ == e.activ and state == (e.state if ledgers_state else None), r.name
