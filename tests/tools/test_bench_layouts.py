"""`bench layouts` runs its interleaved rounds and its cost profile (a smoke test: no timings
are asserted; the machine is shared)."""

import pytest

import emulator
from benchmarks import layout_costs, layouts
from benchmarks.model import bench_model
from emulator.model import init_params
from parallel.expert.sync import is_expert


def test_one_round_prints_the_row_with_its_ratio(capsys):
    assert layouts.main(["--size", "small", "--rounds", "1", "--only", "dp2 x tp2"]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("dp2 x tp2"))
    ratio = row.split()[-3]  # min/med/max of one round: three equal numbers
    assert len(set(ratio.split("/"))) == 1, row


def test_the_tiny_size_is_asked_for_by_name(capsys, monkeypatch):
    """--size tiny runs the property-test size (its own header); "both" stays the goal's two."""
    assert layouts.main(["--size", "tiny", "--rounds", "1", "--only", "tp4 SP"]) == 0
    head = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("== size"))
    assert head.startswith(
        "== size tiny: {'d_model': 16, 'max_seq_len': 8, 'n_layers': 4, 'vocab_size': 32}, A 4,"
    )
    seen = []
    monkeypatch.setattr(layouts, "bench", lambda sizes, chosen, rounds: seen.append(sizes))
    layouts.main(["--only", "DDP"])
    layouts.main(["--size", "tiny", "--only", "DDP"])
    assert seen == [["small", "compute"], ["tiny"]]


def test_costs_categories_cover_the_profile():
    case = next(c for c in layouts.cases() if c.label == "DDP")
    cats, records = layout_costs.profile(case, "small")
    assert records > 0 and cats["model NumPy (ops, block, model)"] > 0
    assert set(cats) <= {c for c, _ in layout_costs.CATEGORIES} | {"other Python"}
    ref = layout_costs.reference_profile(case, "small")  # same categories, no messages
    assert ref["model NumPy (ops, block, model)"] > 0
    assert ref.get("message path (emulator/, collectives/)", 0.0) == 0.0


def test_bench_model_against_a_missing_file_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_model(["--against", "no_such_ops.py"])
    got = capsys.readouterr()
    assert exc.value.code == 2 and got.out == ""
    assert "--against" in got.err and "no_such_ops.py" in got.err


def test_the_ep_bucket_rows_sync_in_buckets_and_the_others_per_tensor():
    """The "buckets" EP rows run grad_sync="ddp" (a few all-reduces a step), the plain ones
    ep_train's per-tensor default (one all-reduce per replicated or expert tensor)."""

    def grad_calls(case):
        cfg = layouts.config("small", case.moe)
        batches = layouts.batches_for(cfg)

        def body(comm):
            case.run(comm, cfg, batches)
            return {(r.group, r.seq) for r in comm.ledger.records if "dp/grads" in r.tag}

        return emulator.spawn(body, case.ranks, timeout=120)

    cases = {c.label: c for c in layouts.cases()}
    names = list(init_params(layouts.config("small", True), 0))
    dense = [n for n in names if not is_expert(n)]
    # ep4: the experts live on one rank each (no edp group): only the dense tensors are synced;
    # dp2 x ep2: the dense ones over the world and the experts over edp - every tensor
    for ep, per_tensor, n_buckets in (("ep4", len(dense), 1), ("dp2 x ep2", len(names), 2)):
        plain = grad_calls(cases[f"{ep} (E 4, top-2)"])
        buckets = grad_calls(cases[f"{ep} (E 4, top-2) buckets"])
        assert [len(mine) for mine in plain] == [per_tensor] * 4, ep
        assert [len(mine) for mine in buckets] == [n_buckets] * 4, ep
