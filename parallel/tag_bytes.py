"""Bytes per step and tag pattern from a rank's ledger records, in one pass over them.

    tag_bytes(records, steps, {"dp": "dp/grads*", "edp": "edp/*"})
    -> [step] {"dp": (sent, received), "edp": (sent, received)}

Each pattern means what emulator.ledger's select means by tag=...: ending in "*" a prefix, else
the whole tag; (sent, received) = (ledger.sent(mine, tag=p), ledger.received(mine, tag=p)) with
mine = the records of that step. ep_train and cp_train asked the ledger that way, a scan of
every record per step, pattern and direction: 4-6 scans of ~1.6-3.2 k records per rank and
step, the whole "ledger queries" share of an ep4 step (bench layouts --costs). Here each record
is looked at once.
"""

from __future__ import annotations

_SIDE = {"send": 0, "recv": 1}


def tag_bytes(records, steps: int, patterns: dict) -> list[dict]:
    """records: Ledger records; patterns {name: tag pattern} -> per step {name: (sent, recv)}."""
    exact = {}  # tag -> [names]
    prefixes = []  # (prefix, name)
    for name, pat in patterns.items():
        if pat.endswith("*"):
            prefixes.append((pat[:-1], name))
        else:
            exact.setdefault(pat, []).append(name)
    out = [{name: [0, 0] for name in patterns} for _ in range(steps)]
    hits: dict = {}  # tag -> the names it counts for (the patterns tested once per tag)
    for r in records:
        side = _SIDE.get(r.direction)
        if side is None or not 0 <= r.step < steps:
            continue
        names = hits.get(r.tag)
        if names is None:
            names = hits[r.tag] = exact.get(r.tag, []) + [
                n for pre, n in prefixes if isinstance(r.tag, str) and r.tag.startswith(pre)
            ]
        row = out[r.step]
        for n in names:
            row[n][side] += r.nbytes
    return [{n: tuple(v) for n, v in row.items()} for row in out]
