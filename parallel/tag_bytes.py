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
    for r in records:  # plain comparisons, no call per record: ~2-3 k records per rank and step
        d = r.direction
        if d == "send":
            side = 0
        elif d == "recv":
            side = 1
        else:
            continue
        s, tag = r.step, r.tag
        if s < 0 or s >= steps:
            continue
        if tag in hits:
            names = hits[tag]
        else:
            names = hits[tag] = exact.get(tag, []) + [
                n for pre, n in prefixes if isinstance(tag, str) and tag.startswith(pre)
            ]
        if names:
            row, nb = out[s], r.nbytes
            for n in names:
                row[n][side] += nb
    return [{n: tuple(v) for n, v in row.items()} for row in out]
