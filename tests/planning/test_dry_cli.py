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


@pytest.mark.parametrize("flags", ["", "--prefetch", "--no-reshard"])
def test_zero3_bytes_equal_the_formula_and_memory_equals_this_model(flags):
    rc, out, _ = run(f"--preset llama2-7b --dp 4 --zero 3 --seq 64 --ranks 0 {flags}")
    assert rc == 0 and ": equal" in out and "DIFFERENT" not in out
    state = next(line for line in out.split("\n") if line.strip().startswith("state"))
    dry, model = state.split()[1:3]
    assert dry == model  # the ledger's peaks equal parallel/data/cost.py's, to 0.01 GiB


def test_json_has_every_representative():
    rc, out, _ = run("--preset llama2-7b --dp 2 --pp 4 --seq 32 --json")
    ranks = json.loads(out)["ranks"]
    assert rc == 0 and sorted(ranks) == ["0", "1", "2", "3"]
    assert all(r["memory"]["peak"]["activations"] > 0 for r in ranks.values())


@pytest.mark.parametrize(
    "argv, words",
    [
        ("--preset gpt4", ["unknown preset 'gpt4'", "llama3-405b"]),
        ("--preset llama2-7b --tp 2 --pp 2", ["tp x pp", "parallel.train"]),
        ("--preset llama2-7b --pp 64", ["pp=64 is more stages", "32 layers"]),
        ("--preset llama2-7b --tp 3", ["tp=3", "heads 32"]),
        ("--preset llama2-7b --tp 2 --zero 3", ["zero=3 with tp or pp"]),
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
