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


@pytest.mark.parametrize(
    "flags, rows",
    [
        ("--dp 2 --cp 2", 2),
        ("--cp 2 --pp 2 --cp-method ulysses --cp-balance contiguous --zero 1", 4),
        ("--dp 2 --cp 2 --tp 2 --cp-method all-gather --recompute selective", 2),
    ],
)
def test_context_parallel_runs_through_parallel_train(flags, rows):
    # one representative per (stage, cp rank), each equal to nd_cost (cp attention included)
    rc, out, _ = run(f"--preset llama2-7b --seq 32 {flags}")
    lines = [line for line in out.split("\n") if " cp " in line and "rank(s)" in line]
    assert rc == 0 and len(lines) == rows and all(x.endswith("equal") for x in lines), out
    assert "through parallel.train" in out and "cp sent" in out and "DIFFERENT" not in out


@pytest.mark.parametrize(
    "flags", ["--dp 4 --ep 2", "--dp 2 --ep 2 --tp 2 --pp 2 --sequence-parallel"]
)
def test_expert_parallel_runs_padded_to_capacity(flags):
    rc, out, _ = run(f"--preset llama2-7b --seq 32 --experts 4 --top-k 2 {flags} --json")
    ranks = json.loads(out)["ranks"]
    assert rc == 0 and all(r["differences_from_nd_cost"] == [] for r in ranks.values())
    assert all(r["bytes_sent_by_axis"]["ep"] > 0 for r in ranks.values())
    rc, out, _ = run(f"--preset llama2-7b --seq 32 --experts 4 {flags}")
    assert rc == 0 and "padded to capacity" in out and "ep sent" in out


@pytest.mark.parametrize(
    "argv, words",
    [
        ("--preset gpt4", ["unknown preset 'gpt4'", "llama3-405b"]),
        ("--preset llama2-7b --pp 64", ["64 virtual stages", "only 32 blocks"]),
        ("--preset llama2-7b --tp 3", ["tp=3 does not divide n_heads=32"]),
        ("--preset llama2-7b --sequence-parallel", ["sequence_parallel=True needs tp > 1"]),
        ("--preset llama2-7b --dp 2 --ranks 0,5", ["ranks are 0..1"]),
        ("--preset llama2-7b --cp 3 --seq 32", ["S=32 does not split into 6 equal"]),
        ("--preset llama2-7b --dp 4 --ep 3 --experts 6", ["ep=3 must divide dp=4"]),
        ("--preset llama2-7b --dp 2 --ep 2", ["--ep 2 needs an MoE model"]),
        ("--preset llama2-7b --dp 2 --ep 2 --experts 4 --dispatch exact", ["exact dispatch sends"]),
        ("--preset llama2-7b --experts 4 --top-k 5", ["moe_top_k=5 must satisfy"]),
    ],
)
def test_bad_input_is_one_line(argv, words):
    rc, out, err = run(argv)
    assert rc == 2 and out == "" and err.count("\n") == 1
    for w in words:
        assert w in err, err


def test_plan_memory_dry_run_columns_equal_nd_cost_and_this_models():
    from emulator.flops import head_activation_bytes
    from planning import exact, memory, presets

    p = presets.get("llama2-7b")
    cfg = p.model_config(32)
    rows = memory.strategies(p, 2, 32, 1, "none", 10)
    assert [r.tp * r.pp for r in rows] == [1, 1, 1, 1, 2, 2]  # DDP, ZeRO-1/2/3, TP, PP
    for r in rows:  # every row, TP and PP included, has its dry-run twin, equal to nd_cost
        e, d = exact.price(p, r, 32, 1), exact.dry_figures(p, r, 32, 1)
        assert d is not None and d.differences == [], (r.name, d)
        if r.zero < 2:  # the same flat buffers as the 'model' column
            assert d.state == e.state, r.name
        if r.tp == r.pp == 1:  # beside the blocks: the embedding's ids and the head's cache
            assert d.activ - e.activ == head_activation_bytes(cfg, 1, 32), r.name


def test_plan_memory_json_carries_the_dry_run():
    from planning import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(
            ["memory", "--preset", "llama2-7b", "--gpus", "2", "--seq", "32", "--dry-run", "--json"]
        )
    rows = json.loads(out.getvalue())["rows"]
    assert rc == 0 and len(rows) == 6
    assert all(r["dry_run"]["differences_from_nd_cost"] == [] for r in rows)
    assert [r["dry_run"]["representatives"] for r in rows] == [1, 1, 1, 1, 1, 2]  # PP: 2 stages


def test_full_recompute_rows_differ_by_one_recomputed_block():
    # the dry run's peak under full recompute: the layer inputs, the ids, and during a backward
    # one block's whole cache (the head's freed first) - the note's reason, in bytes
    from emulator.flops import activation_bytes_per_block
    from planning import exact, memory, presets

    p = presets.get("llama2-7b")
    cfg = p.model_config(32)
    for r in memory.strategies(p, 2, 32, 1, "full", 10)[:4]:  # DDP, ZeRO-1/2/3
        e, d = exact.price(p, r, 32, 1), exact.dry_figures(p, r, 32, 1)
        assert d.differences == [] and d.activ - e.activ == 8 * 32 + activation_bytes_per_block(
            cfg, 1, 32, "none"
        ), r.name
