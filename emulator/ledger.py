"""The byte ledger: every byte one rank sends or receives, with what it was for.

Each point-to-point message adds one `Record` on the sending rank (direction "send") and one on
the receiving rank ("recv"). The record carries the collective it belonged to (`op`,
`algorithm`), the group, the peer's global rank, the byte count, the training step and the
user's scope tag. Everything else - totals by op, by group, by tag, world tables, JSON - is a
query over these records, so later layers (the cost model, trace replay) read the same data.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass

FIELDS = ("op", "algorithm", "group", "peer", "direction", "step", "tag")


@dataclass(frozen=True, slots=True)
class Record:
    op: str  # the collective ("all_reduce", ...) or "p2p" for a bare send/recv
    algorithm: str  # "ring", "tree", ... or "" for p2p
    group: str  # the communicator's name ("world", "tp", "dp[0,2]", ...)
    peer: int  # the other rank, global numbering
    direction: str  # "send" | "recv"
    nbytes: int
    step: int
    tag: str  # the innermost `emulator.scope(...)`s joined with "/"
    seq: int  # index of the collective call on this rank (-1 for bare p2p)


class Unfrozen:
    """Record's slots without its frozen `__setattr__`, for the message path (`Comm._record`):
    it fills an `object.__new__(Unfrozen)` with plain attribute stores and then assigns
    `__class__ = Record` (CPython allows it between classes of the same slots), which gives a
    Record equal to the constructor's, field for field. The frozen constructor's
    `object.__setattr__` per field cost ~1.6 k instructions each (callgrind), nine per Record,
    and a collective builds Records on every call (they hold its sequence number)."""

    __slots__ = Record.__slots__


class Ledger:
    """One rank's records. Cheap to append; all summaries are computed on demand."""

    def __init__(self, rank: int):
        self.rank = rank
        self.records: list[Record] = []
        self.step = 0

    def add(self, record: Record) -> None:
        self.records.append(record)

    def mark(self) -> int:
        """A position; `since(mark)` selects the records appended after it."""
        return len(self.records)

    def since(self, mark: int) -> list[Record]:
        return self.records[mark:]

    def select(self, records=None, **match) -> list[Record]:
        unknown = set(match) - set(FIELDS)
        if unknown:
            raise ValueError(f"unknown ledger field(s) {sorted(unknown)}; fields are {FIELDS}")
        out = self.records if records is None else records
        # one pass per field with the test chosen once (not per record): the same records in
        # the same order as _matches on each; ep_train's per-layer byte queries spent 20% of
        # a small step here (bench layouts --costs)
        for k, want in match.items():
            if isinstance(want, (set, frozenset, tuple, list)):
                out = [r for r in out if getattr(r, k) in want]
            elif isinstance(want, str) and want.endswith("*"):
                pre = want[:-1]
                out = [r for r in out if isinstance(v := getattr(r, k), str) and v.startswith(pre)]
            else:
                out = [r for r in out if getattr(r, k) == want]
        return list(out)

    def sent(self, records=None, **match) -> int:
        return sum(r.nbytes for r in self.select(records, direction="send", **match))

    def received(self, records=None, **match) -> int:
        return sum(r.nbytes for r in self.select(records, direction="recv", **match))

    def totals(self, by: str = "op", records=None) -> dict:
        """{key: {"sent": bytes, "recv": bytes, "messages": n}} grouped by one field."""
        if by not in FIELDS:
            raise ValueError(f"cannot group by {by!r}; fields are {FIELDS}")
        out: dict = defaultdict(lambda: {"sent": 0, "recv": 0, "messages": 0})
        for r in self.records if records is None else records:
            row = out[getattr(r, by)]
            row["sent" if r.direction == "send" else "recv"] += r.nbytes
            row["messages"] += r.direction == "send"
        return dict(out)

    def summary(self) -> dict:
        return {
            "rank": self.rank,
            "sent": self.sent(),
            "recv": self.received(),
            "by_op": self.totals("op"),
            "by_group": self.totals("group"),
            "by_tag": self.totals("tag"),
        }

    def to_json(self) -> str:
        return json.dumps({"rank": self.rank, "records": [asdict(r) for r in self.records]})


def _matches(value, wanted) -> bool:
    if isinstance(wanted, (set, frozenset, tuple, list)):
        return value in wanted
    if isinstance(wanted, str) and wanted.endswith("*"):
        return isinstance(value, str) and value.startswith(wanted[:-1])
    return value == wanted


def world_table(summaries: list[dict], by: str = "op") -> str:
    """A per-rank table of bytes sent / received, one column pair per key of `by`."""
    keys = sorted({k for s in summaries for k in s[f"by_{by}"]}, key=str)
    head = ["rank"] + [f"{k} sent/recv" for k in keys] + ["total sent", "total recv"]
    rows = []
    for s in summaries:
        cells = [str(s["rank"])]
        for k in keys:
            t = s[f"by_{by}"].get(k, {"sent": 0, "recv": 0})
            cells.append(f"{t['sent']}/{t['recv']}")
        rows.append(cells + [str(s["sent"]), str(s["recv"])])
    return format_table(head, rows)


def format_table(head: list[str], rows: list[list]) -> str:
    rows = [[str(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)
    ]
    line = "  ".join(h.rjust(w) for h, w in zip(head, widths))
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([line, "-" * len(line), *body])


def gather_summaries(comm) -> list[dict]:
    """Every rank's `Ledger.summary()`, on every rank (through the uncounted control plane)."""
    return comm.allgather_object(comm.ledger.summary())


def world_report(comm, by: str = "op", path: str | None = None) -> str:
    """The world's bytes table by `by`; with `path`, also the summaries as JSON (rank 0 writes)."""
    summaries = gather_summaries(comm)
    if path is not None and comm.rank == 0:
        with open(path, "w") as f:
            json.dump(summaries, f, indent=1)
    return world_table(summaries, by)
