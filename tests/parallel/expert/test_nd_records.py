"""The route records of an ep run of parallel.train (NDRun.ep_routes, read by moe_records)
against what does not come from the layout: every rank's load table per MoE layer and
micro-batch = a recount of the single-rank reference's routing of the same tokens (emulator's
model forward, emulator/moe.py's route, on the same groups: reference_routes), and every
all-to-all's bytes per layer, micro-batch and phase on every rank = parallel/expert/cost.py's
formula fed with those REFERENCE counts. Layouts dp x ep, dp x ep x tp and dp x ep x pp; a
capacity factor that drops. Planted: the logged dropped counts off by one fail the check."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
import parallel
from emulator.data import synthetic_batch
from emulator.model import ModelConfig
from parallel import Layout
from parallel.check.routing import reference_routes
from parallel.expert import load
from parallel.expert.cost import layer_bytes
from parallel.expert.load import reference_load, same_load
from parallel.expert.train import moe_records

HYPER = {"lr": 3e-3, "max_norm": 0.3}


def _cfg(E=4, K=2, cf=0.75, L=2):
    return ModelConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=L,
                       n_experts=E, moe_top_k=K, capacity_factor=cf)  # fmt: skip


def record_problems(layout, cfg, B=8, S=4, steps=2) -> tuple[list[str], int]:
    """-> (every disagreement, tokens dropped in all): load tables and ep bytes of every rank
    against the reference's routing."""
    batches = lambda s: synthetic_batch(3, s, B, S, cfg.vocab_size)
    k = layout.microbatches
    ref = reference_routes(cfg, 0, batches, steps, microbatches=layout.dp * k, **HYPER)

    def main(comm):
        mark = comm.ledger.mark()
        run = parallel.train(comm, layout, cfg, batches, steps, **HYPER)
        return run.coords, moe_records(run, comm.ledger.since(mark))

    out = emulator.spawn(main, layout.world, timeout=180)
    E, bad, dropped, seen = cfg.n_experts, [], 0, 0
    for co, recs in out:
        assert len(recs) == steps
        # the ep group of this rank: same edp, pp, tp; dp = edp ep + e, so dp order is ep order
        group = sorted(c["dp"] for c, _ in out
                       if all(c[a] == co[a] for a in ("edp", "pp", "tp")))  # fmt: skip
        for s, st in enumerate(recs):
            for (b, j), rec in st.items():
                i = int(b.split(".")[1])
                want = reference_load(ref[s][co["dp"] * k + j][i][0], E)
                seen += 1
                dropped += int(want["dropped"].sum())
                if not same_load(rec["load"], want):
                    bad.append(f"{co} step {s} mb{j}.{b}: load {rec['load']} != {want}")
                kept = np.array([reference_load(ref[s][d * k + j][i][0], E)["kept"] for d in group])
                f = layer_bytes(layout.dispatch, kept, sum(want["capacity"]), cfg.d_model, 8,
                                co["ep"])  # fmt: skip
                if rec["bytes"] != f:
                    bad.append(f"{co} step {s} mb{j}.{b}: bytes {rec['bytes']} != formula {f}")
    n_blocks = cfg.n_layers // layout.pp
    assert seen == layout.world * steps * k * n_blocks  # every rank logged every MoE layer
    return bad, dropped


@pytest.mark.parametrize(
    "kw",
    [
        {"dp": 4, "ep": 2, "dispatch": "exact"},
        {"dp": 4, "ep": 4, "dispatch": "padded"},
        {"dp": 2, "ep": 2, "tp": 2, "dispatch": "exact"},
        {"dp": 2, "ep": 2, "pp": 2, "dispatch": "padded"},
    ],
    ids=str,
)
def test_load_tables_and_bytes_against_the_reference_routing(kw):
    layout = Layout(microbatches=2, **kw)
    bad, dropped = record_problems(layout, _cfg(L=2 * layout.pp))
    assert not bad, bad[:3]
    assert dropped > 0  # the capacity factor drops: the dropped column is exercised


def test_planted_dropped_off_by_one_fails(monkeypatch):
    """The layout logs one dropped copy too many at expert 0: the recount disagrees."""
    real = load.load_table

    def planted(routes, E):
        t = real(routes, E)
        t["dropped"] = t["dropped"] + np.eye(E, dtype=np.int64)[0]
        return t

    monkeypatch.setattr(load, "load_table", planted)
    bad, _ = record_problems(Layout(dp=2, ep=2, microbatches=1), _cfg(), B=4, steps=1)
    assert bad and all("load" in b for b in bad), bad[:3]


def test_planted_extra_padded_row_fails(monkeypatch):
    """Padded dispatch sends one zero row too many per block (and the receiver drops it, so the
    numbers stay right): only the bytes disagree with the formula."""
    from parallel.expert import dispatch as dx

    real = dx.exchange

    def planted(ep, sends, send_rows, recv_rows, mode, tag):
        sends = [np.concatenate([s, np.zeros((1, s.shape[1]), s.dtype)]) for s in sends]
        return [o[:-1] for o in real(ep, sends, send_rows, recv_rows, mode, tag)]

    monkeypatch.setattr(dx, "exchange", planted)
    layout = Layout(dp=2, ep=2, microbatches=1, dispatch="padded")
    bad, _ = record_problems(layout, _cfg(), B=4, steps=1)
    assert bad and all("bytes" in b for b in bad), bad[:3]
