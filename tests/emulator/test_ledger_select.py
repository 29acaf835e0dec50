"""Ledger.select (one pass per field) against its per-record definition, ledger._matches."""

import itertools
import random

from emulator.ledger import FIELDS, Ledger, Record, _matches


def _records(n: int, rng) -> list[Record]:
    tags = ["dp/grads/0", "dp/params", "blocks.1/ep/fwd/counts", "tp/attn/mb0/fwd", ""]
    return [
        Record(rng.choice(["all_reduce", "p2p", "all_to_all"]), rng.choice(["ring", ""]),
               rng.choice(["world", "dp", "tp"]), rng.randrange(4), rng.choice(["send", "recv"]),
               rng.randrange(1, 100), rng.randrange(3), rng.choice(tags), rng.randrange(-1, 9))
        for _ in range(n)
    ]  # fmt: skip


QUERIES = [{}, {"direction": "send"}, {"tag": "dp/*"}, {"tag": "blocks.1/ep/fwd/counts"},
           {"op": ("p2p", "all_to_all"), "direction": "recv"}, {"peer": {1, 2}, "tag": "*"},
           {"step": 1, "group": ["tp", "dp"], "tag": "tp/*"}, {"tag": "", "peer": 0}]  # fmt: skip


def test_select_equals_the_per_record_definition():
    rng = random.Random(0)
    led = Ledger(0)
    for r in _records(400, rng):
        led.add(r)
    part = led.records[100:300]
    for q, records in itertools.product(QUERIES, (None, part)):
        want = [r for r in (led.records if records is None else records)
                if all(_matches(getattr(r, k), v) for k, v in q.items())]  # fmt: skip
        got = led.select(records, **q)
        assert got == want, q
        assert all(k in FIELDS for k in q)
    assert led.sent(tag="dp/*") == sum(
        r.nbytes for r in led.records if r.direction == "send" and r.tag.startswith("dp/")
    )
