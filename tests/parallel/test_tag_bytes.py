"""parallel.tag_bytes (one pass over the records) against the ledger's own definition:
Ledger.sent / received(records of the step, tag=pattern) for each step and pattern, on random
records and on the step_bytes of real ep_train and cp_train runs."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import emulator
from emulator.ledger import Ledger, Record
from emulator.model import ModelConfig
from parallel.context.train import cp_train
from parallel.expert.train import ep_train
from parallel.tag_bytes import tag_bytes

TAGS = ["", "dp/grads/bucket0", "dp/grads", "dp/x", "edp/dp/grads/bucket1", "cp-attn/fwd",
        "cp-attn/fwd/x", "cp-attn/bwd", "ep/blocks.0/mb0/dispatch"]  # fmt: skip
PATTERNS = {"dp": "dp/grads*", "edp": "edp/*", "fwd": "cp-attn/fwd", "fwd2": "cp-attn/fwd",
            "any": "*", "cp": "cp-attn*", "none": "tp/*"}  # fmt: skip


def definition(ledger, records, steps, patterns):
    out = []
    for step in range(steps):
        mine = [r for r in records if r.step == step]
        out.append({n: (ledger.sent(mine, tag=p), ledger.received(mine, tag=p))
                    for n, p in patterns.items()})  # fmt: skip
    return out


record = st.builds(
    lambda tag, d, nbytes, step: Record("p2p", "", "world", 1, d, nbytes, step, tag, -1),
    st.sampled_from(TAGS), st.sampled_from(["send", "recv"]), st.integers(0, 10**6),
    st.integers(-1, 3),
)  # fmt: skip


@settings(max_examples=60)
@given(records=st.lists(record, max_size=60), steps=st.integers(1, 3))
def test_random_records(records, steps):
    got = tag_bytes(records, steps, PATTERNS)
    assert got == definition(Ledger(0), records, steps, PATTERNS)


CFG = ModelConfig(vocab_size=32, d_model=8, n_heads=2, n_layers=2, max_seq_len=8)


def _batches(step):
    rng = np.random.default_rng(step)
    x = rng.integers(0, 32, (4, 8))
    return x, np.roll(x, -1, axis=1)


def test_ep_train_step_bytes():
    cfg = ModelConfig(**{**CFG.__dict__, "n_experts": 4, "moe_top_k": 2})

    def fn(comm):
        mark = comm.ledger.mark()
        run = ep_train(comm, cfg, 0, _batches, 2, ep=2)
        want = definition(comm.ledger, comm.ledger.since(mark), 2,
                          {"dp": "dp/grads*", "edp": "edp/*"})  # fmt: skip
        return run.step_bytes, want

    for got, want in emulator.spawn(fn, 4, timeout=120):
        assert got == want
        assert all(v[0] > 0 for row in got for v in row.values())  # each group moved bytes


def test_cp_train_step_bytes():
    def fn(comm):
        mark = comm.ledger.mark()
        run = cp_train(comm, CFG, 0, _batches, 2, cp=2)
        pats = {"fwd": "cp-attn/fwd", "bwd": "cp-attn/bwd", "grads": "dp/grads*"}
        return run.step_bytes, definition(comm.ledger, comm.ledger.since(mark), 2, pats)

    for got, want in emulator.spawn(fn, 4, timeout=120):
        assert got == want
        assert all(v[0] > 0 for row in got for v in row.values())
