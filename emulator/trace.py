"""Events with logical time -> busy/idle tables, an ASCII timeline, Chrome trace-event JSON.

An `Event` is plain data - which rank (track), what kind, a display name, start, duration,
and optionally the micro-batch, the bytes moved and the peer rank - so any producer (a pipeline
schedule replay, a layout's recorded run) can emit them and any consumer (these renderers, a
cost model that re-times messages under link bandwidth/latency) can read them. Times are
logical units (numbers or fractions.Fraction, so replays can be exact); a renderer scales them.

Compute events occupy their rank; "send" events describe a message (nbytes, peer) and do not
count as busy time unless a consumer gives them a duration and chooses to.

Chrome trace format: the "X" (complete) events of the Trace Event Format, one thread (track) per
rank named by "M" metadata events; chrome://tracing and https://ui.perfetto.dev open the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

COMPUTE = ("F", "B", "W")  # kinds that keep a rank busy


@dataclass(frozen=True)
class Event:
    rank: int  # the track: a pipeline stage, a rank
    kind: str  # "F" | "B" | "W" | "send" | any other label
    name: str  # what the timeline prints ("F3", "B1.1", "act 2->3")
    start: object  # logical time (int, float or Fraction)
    duration: object
    mb: int | None = None  # micro-batch index (0-based), if any
    nbytes: int = 0  # bytes moved (messages) or touched
    peer: int | None = None  # the other rank of a message

    @property
    def end(self):
        return self.start + self.duration


def compute_events(events, kinds=COMPUTE) -> list[Event]:
    return [e for e in events if e.kind in kinds]


def busy_idle(events, n_ranks: int | None = None, kinds=COMPUTE) -> list[dict]:
    """Per rank: busy time, idle time and bubble = idle / total, where total is the span
    from the earliest start to the latest end over all ranks (everyone waits for the last)."""
    ev = compute_events(events, kinds)
    if not ev:
        raise ValueError("busy_idle: no compute events to measure")
    n = n_ranks if n_ranks is not None else 1 + max(e.rank for e in ev)
    t0, t1 = min(e.start for e in ev), max(e.end for e in ev)
    total = t1 - t0
    rows = []
    for r in range(n):
        busy = sum((e.duration for e in ev if e.rank == r), 0)
        rows.append({"rank": r, "busy": busy, "idle": total - busy, "total": total,
                     "bubble": (total - busy) / total})  # fmt: skip
    return rows


def ascii_timeline(events, n_ranks: int | None = None, slot=None, label="stage") -> str:
    """One row per rank; each column is `slot` time units (default: the shortest compute
    event). An event prints its name in its first cell and '=' in the cells it continues
    into; '.' is idle. The seed's picture: `stage 0: F1 F2 F3 F4 .  .  B1 ...`."""
    ev = compute_events(events)
    if not ev:
        return "(no events)"
    slot = slot or min(e.duration for e in ev if e.duration > 0)
    n = n_ranks if n_ranks is not None else 1 + max(e.rank for e in ev)
    t0 = min(e.start for e in ev)
    cols = round((max(e.end for e in ev) - t0) / slot)
    width = max(len(e.name) for e in ev)
    rows = []
    for r in range(n):
        cells = ["."] * cols
        for e in ev:
            if e.rank != r:
                continue
            a = round((e.start - t0) / slot)
            b = max(a + 1, round((e.end - t0) / slot))
            cells[a:b] = [e.name] + ["="] * (b - a - 1)
        rows.append(f"{label} {r}: " + " ".join(c.ljust(width) for c in cells).rstrip())
    return "\n".join(rows)


def chrome_trace(events, us_per_unit: float = 1000.0, label="stage") -> dict:
    """Trace-event JSON (a dict): one "X" event per compute event on track (pid 0, tid rank),
    message events as zero-length instant-like "X" events carrying bytes and peer in args."""
    ranks = sorted({e.rank for e in events})
    out = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"{label} {r}"}}
           for r in ranks]  # fmt: skip
    for e in events:
        args = {"mb": e.mb, "bytes": e.nbytes, "start_units": float(e.start)}
        if e.peer is not None:
            args["peer"] = e.peer
        out.append({
            "name": e.name, "cat": e.kind, "ph": "X", "pid": 0, "tid": e.rank,
            "ts": float(e.start) * us_per_unit, "dur": float(e.duration) * us_per_unit,
            "args": args,
        })  # fmt: skip
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path, events, **kw) -> str:
    """Write chrome_trace(events) to `path` (open it in ui.perfetto.dev); returns the path."""
    with open(path, "w") as f:
        json.dump(chrome_trace(events, **kw), f)
    return str(path)


def to_records(events) -> list[dict]:
    """Plain dicts (JSON-ready, times as floats) for tables or a later cost model."""
    return [asdict(e) | {"start": float(e.start), "duration": float(e.duration)} for e in events]
