"""The load table of an MoE layer: token copies routed to, kept by and dropped by each expert.

"Routed" counts the top-K choices before the capacity cut, "kept" those with a slot (index below
C_g of their routing group), "dropped" = routed - kept (those choices contribute nothing to the
token's output). Imbalance is max / mean over experts (1.0 = perfectly balanced; the mean is
N K / E per group, so imbalance x C / capacity_factor is the busiest expert's demand in slots).
A rank's table covers the tokens IT routed; ``received`` (exact mode: the counts exchange)
gives the rows each local expert computed on, from every rank of the ep group.
"""

from __future__ import annotations

import numpy as np

from emulator.ledger import format_table


def load_table(routes, E: int) -> dict:
    """routes: emulator.moe.route dicts (one per routing group) -> {routed, kept, dropped} (E,)
    int64 and their imbalances (max / mean; 0.0 when nothing was routed or kept)."""
    routed = sum(np.bincount(r["expert"], minlength=E) for r in routes).astype(np.int64)
    kept = sum(np.bincount(r["expert"][r["keep"]], minlength=E) for r in routes).astype(np.int64)
    t = {"routed": routed, "kept": kept, "dropped": routed - kept}
    for k in ("routed", "kept"):
        mean = t[k].mean()
        t[f"imbalance_{k}"] = float(t[k].max() / mean) if mean > 0 else 0.0
    t["capacity"] = [int(r["C"]) for r in routes]
    return t


def received(counts) -> np.ndarray:
    """counts (P, El) from the exchange -> (El,) rows each local expert received (all sources)."""
    return np.asarray(counts, np.int64).sum(axis=0)


def format_load(t: dict, first: int = 0, rows_in=None) -> str:
    """The table as text: one row per expert; ``rows_in`` (El,) adds a column for the experts
    this rank holds (experts first .. first + El - 1)."""
    E = t["routed"].size
    head = ["expert", "routed", "kept", "dropped"] + (
        ["computed here"] if rows_in is not None else []
    )
    rows = []
    for e in range(E):
        row = [e, int(t["routed"][e]), int(t["kept"][e]), int(t["dropped"][e])]
        if rows_in is not None:
            mine = first <= e < first + len(rows_in)
            row.append(int(rows_in[e - first]) if mine else "")
        rows.append(row)
    rows.append(["total", int(t["routed"].sum()), int(t["kept"].sum()), int(t["dropped"].sum())])
    if rows_in is not None:
        rows[-1].append(int(np.sum(rows_in)))
    tail = (
        f"imbalance max/mean: routed {t['imbalance_routed']:.2f}, kept {t['imbalance_kept']:.2f}; "
        f"capacity per group {t['capacity']}"
    )
    return format_table(head, rows) + "\n" + tail
