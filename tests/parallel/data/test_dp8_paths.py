"""The eighth pass's data-parallel fast paths against the code they replace: dp_step_bytes
against the ledger's sent/received queries, rebind's replacements and container types, and
ZeroOptimizer.unshard_many / final_state against one _unshard per dict."""

from __future__ import annotations

import numpy as np
import pytest

import emulator
from emulator.config import init_params
from emulator.data import synthetic_batch
from emulator.ledger import Ledger, Record
from parallel.data.common import rebind
from parallel.data.flat import fsdp_units
from parallel.data.train import DP_WHATS, dp_step_bytes
from parallel.data.zero import ZeroOptimizer

from .helpers import tiny


def _rec(direction, tag, nbytes):
    return Record("all_gather", "ring", "world", 1, direction, nbytes, 0, tag, 0)


def test_dp_step_bytes_equals_the_ledger_queries():
    """Prefix semantics ("dp/gradsX" counts as dp/grads*, "x/dp/grads" does not), both
    directions, tags under none of the three."""
    tags = ["dp/grads/u0@bwd:blocks.1", "dp/params/u1", "dp/clip", "dp/gradsX", "x/dp/grads",
            "tp/fwd", "", "dp/params", "edp/dp/grads/u0", "dp/cliq"]  # fmt: skip
    rng = np.random.default_rng(0)
    recs = [_rec(d, t, int(rng.integers(1, 1000))) for t in tags for d in ("send", "recv")]
    recs += [_rec("send", t, 7) for t in tags[:4]]  # a tag seen again: summed
    ledger = Ledger(0)
    want = {w: (ledger.sent(recs, tag=f"dp/{w}*"), ledger.received(recs, tag=f"dp/{w}*"))
            for w in DP_WHATS}  # fmt: skip
    assert dp_step_bytes(ledger, recs) == want and want["grads"][0] > 0 and want["clip"][1] > 0
    assert dp_step_bytes(ledger, []) == dict.fromkeys(DP_WHATS, (0, 0))


class _Sub(list):
    pass


def test_rebind_replaces_by_id_and_keeps_container_types():
    a, b, c, new_a, new_b = (np.full(3, float(i)) for i in range(5))
    sub = np.arange(3.0).view(np.ma.MaskedArray)  # an ndarray subclass
    cache = {"x": (a, [b, {"y": a, "z": 3}], c), "s": _Sub([b, "k"]), "m": sub, "n": None,
             "t": ((a,),), "l": [[b], ()]}  # fmt: skip
    table = {id(a): new_a, id(b): new_b, id(sub): new_b}
    got = rebind(cache, table)
    assert type(got["x"]) is tuple and type(got["x"][1]) is list and type(got["s"]) is _Sub
    assert got["x"][0] is new_a and got["x"][1][0] is new_b and got["m"] is new_b
    assert got["x"][1][1]["y"] is new_a and got["x"][1][1]["z"] == 3 and got["x"][2] is c
    assert got["s"][0] is new_b and got["s"][1] == "k" and got["n"] is None
    assert got["t"][0][0] is new_a and got["l"] == [[new_b], ()] and got["l"][1] == ()
    assert got["x"] is not cache["x"] and got["l"][0] is not cache["l"][0]  # copies


@pytest.mark.parametrize("stage,D", [(1, 2), (2, 3), (3, 4)])
def test_final_state_equals_one_unshard_per_dict(stage, D):
    """final_state after two steps (uneven shards at D 3 and 4: padding) is bitwise what
    master_params(), full_grads() and state_dict() give, and distinct buffers per dict."""
    cfg = tiny(n_layers=2)
    params = init_params(cfg, 0)
    shapes = {n: p.shape for n, p in params.items()}
    units = [u.names for u in fsdp_units(shapes, D)] if stage == 3 else None
    rng = np.random.default_rng(1)
    grads = [{n: rng.standard_normal(s) for n, s in shapes.items()} for _ in range(2)]

    def body(comm):
        opt = ZeroOptimizer(comm, params, stage, units=units, weight_decay=0.1)
        for g in grads:
            opt.step({n: x * (comm.rank + 1) for n, x in g.items()})
        return opt.final_state(), (opt.master_params(), opt.full_grads(), opt.state_dict())

    for (p, g, st), (p0, g0, st0) in emulator.spawn(body, D, timeout=60):
        assert st["step"] == st0["step"] == 2
        for got, want in ((p, p0), (g, g0), (st["m"], st0["m"]), (st["v"], st0["v"])):
            assert list(got) == list(want)
            for n in want:
                assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
                assert got[n].tobytes() == want[n].tobytes(), n
        assert not np.shares_memory(st["m"]["head.w"], st["v"]["head.w"])
        assert not np.array_equal(st["m"]["head.w"], st["v"]["head.w"])


def test_train_data_parallel_end_state_matches_the_separate_unshards(monkeypatch):
    """train_data_parallel's run.params / grads / opt_state come from final_state: equal to
    the per-dict unshards it replaced (final_state patched back to them)."""
    from parallel.data import train as dtrain

    cfg = tiny()
    batches = lambda s: synthetic_batch(2, s, 8, 8, cfg.vocab_size)
    run = lambda: emulator.spawn(
        lambda c: dtrain.train_data_parallel(c, cfg, 0, batches, 2, stage="3", max_norm=0.1),
        4,
        timeout=60,
    )
    fast = run()
    monkeypatch.setattr(ZeroOptimizer, "final_state", lambda self: (
        self.master_params(), self.full_grads(), self.state_dict()))  # fmt: skip
    slow = run()
    for a, b in zip(fast, slow):
        for got, want in ((a.params, b.params), (a.grads, b.grads),
                          (a.opt_state["m"], b.opt_state["m"]),
                          (a.opt_state["v"], b.opt_state["v"])):  # fmt: skip
            assert {n: x.tobytes() for n, x in got.items()} == {
                n: x.tobytes() for n, x in want.items()
            }
        assert a.opt_state["step"] == b.opt_state["step"] == 2
