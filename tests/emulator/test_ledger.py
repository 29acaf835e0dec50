"""The byte ledger's queries and tables, on hand-made records."""

import json

import pytest

from emulator.ledger import Ledger, Record, world_table


def _ledger():
    led = Ledger(0)
    led.add(Record("all_reduce", "ring", "dp", 1, "send", 100, 0, "zero1/grads", 0))
    led.add(Record("all_reduce", "ring", "dp", 3, "recv", 100, 0, "zero1/grads", 0))
    led.add(Record("all_gather", "ring", "tp", 1, "send", 7, 1, "tp/fwd", 1))
    led.add(Record("p2p", "", "pp", 2, "recv", 5, 1, "", -1))
    return led


def test_selection_and_totals():
    led = _ledger()
    assert led.sent() == 107 and led.received() == 105
    assert led.sent(op="all_reduce") == 100 and led.received(group="pp") == 5
    assert led.sent(tag="zero1*") == 100 and led.sent(step={1}) == 7
    t = led.totals("op")
    assert t["all_reduce"] == {"sent": 100, "recv": 100, "messages": 1}
    assert t["p2p"] == {"sent": 0, "recv": 5, "messages": 0}
    mark = led.mark()
    led.add(Record("p2p", "", "pp", 2, "send", 9, 2, "", -1))
    assert led.sent(led.since(mark)) == 9


def test_bad_queries():
    with pytest.raises(ValueError, match="unknown ledger field"):
        _ledger().sent(colour="red")
    with pytest.raises(ValueError, match="cannot group by 'nbytes'"):
        _ledger().totals("nbytes")


def test_world_table_and_json():
    led = _ledger()
    table = world_table([led.summary()], by="group")
    assert "dp sent/recv" in table and "100/100" in table and "107" in table
    assert len(json.loads(led.to_json())["records"]) == 4


def test_world_report_gathers_every_rank(tmp_path):
    import numpy as np

    import emulator
    from emulator.ledger import world_report

    def fn(c):
        if c.rank == 0:
            c.send(np.ones(5), 1)  # 40 bytes
        elif c.rank == 1:
            c.recv(0, shape=5, dtype=np.float64)
        return world_report(c, by="group", path=str(tmp_path / "bytes.json"))

    tables = emulator.spawn(fn, 3)
    assert tables[0] == tables[2]
    rows = tables[0].splitlines()[2:]
    assert [r.split() for r in rows] == [
        ["0", "40/0", "40", "0"],
        ["1", "0/40", "0", "40"],
        ["2", "0/0", "0", "0"],
    ]
    saved = json.loads((tmp_path / "bytes.json").read_text())
    assert [s["sent"] for s in saved] == [40, 0, 0]


def test_message_path_records_are_records():
    """Comm._record builds Records through ledger.Unfrozen (plain stores, then __class__ =
    Record): each must be a Record equal to the constructor's in every way a user can see."""
    import copy
    import pickle
    from dataclasses import FrozenInstanceError, asdict, astuple, replace

    import numpy as np

    import collectives as C
    import emulator

    def job(comm):
        with emulator.scope("t"):
            C.all_reduce(comm, np.arange(10.0), algorithm="ring")
        comm.ledger.step = 3
        if comm.rank == 0:
            comm.send(np.ones(3, np.int16), 1)
        else:
            comm.recv(0, shape=3, dtype=np.int16)
        return list(comm.ledger.records)

    for recs in emulator.spawn(job, 2):
        assert recs and {r.op for r in recs} == {"all_reduce", "p2p"}
        for a in recs:
            b = Record(*astuple(a))
            assert type(a) is Record and a == b and hash(a) == hash(b) and repr(a) == repr(b)
            assert asdict(a) == asdict(b) and replace(a, seq=7) == replace(b, seq=7)
            assert pickle.loads(pickle.dumps(a)) == b and copy.deepcopy(a) == b
            with pytest.raises(FrozenInstanceError):
                a.nbytes = 0
            assert not hasattr(a, "__dict__") and Record.__slots__ == tuple(asdict(b))
