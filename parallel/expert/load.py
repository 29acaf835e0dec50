"""The load table of an MoE layer: token copies routed to, kept by and dropped by each expert.

"Routed" counts the top-K choices before the capacity cut, "kept" those with a slot (index below
C_g of their routing group), "dropped" = routed - kept (those choices contribute nothing to the
token's output). Imbalance is max / mean over experts (1.0 = perfectly balanced; the mean is
N K / E per group, so imbalance x C / capacity_factor is the busiest expert's demand in slots).
A rank's table covers the tokens IT routed; ``received`` (exact mode: the counts exchange)
gives the rows each local expert computed on, from every rank of the ep group.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from emulator.ledger import format_table
from parallel.check.routing import decisions


class LayerRoute(NamedTuple):
    """What one MoE layer's forward routed on one rank, for one micro-batch (parallel/expert/nd.py
    moe_pair logs it; parallel.train keeps one dict per step in NDRun.ep_routes)."""

    load: dict  # load_table of this rank's routing groups: routed / kept / dropped (E,), C_g
    counts: np.ndarray  # (P, El) rows each ep source sent to this rank's experts (exchanged)
    decisions: list  # [Route] per group (parallel/check/routing.py): choices and kept experts


def layer_route(cache: dict, E: int, S: int) -> LayerRoute:
    """The ep MoE block's forward cache (parallel/expert/layer.py) -> its LayerRoute; S the
    sequence length of the block input (the Route's token positions)."""
    pairs = list(zip(cache["groups"], cache["routes"]))
    return LayerRoute(load_table(cache["routes"], E), cache["counts"], decisions(pairs, S))


def load_table(routes, E: int) -> dict:
    """routes: emulator.moe.route dicts (one per routing group) -> {routed, kept, dropped} (E,)
    int64 and their imbalances (max / mean; 0.0 when nothing was routed or kept)."""
    routed = sum(np.bincount(r["expert"], minlength=E) for r in routes)
    kept = sum(np.bincount(r["expert"][r["keep"]], minlength=E) for r in routes)
    return _table(routed, kept, [int(r["C"]) for r in routes])


def reference_load(decisions, E: int) -> dict:
    """The same table recounted from parallel/check/routing.py Routes (e.g. the reference's,
    reference_routes): routed = every ranked choice topi (N, K), kept = the (N, E) kept mask."""
    routed = sum(np.bincount(d.topi.reshape(-1), minlength=E) for d in decisions)
    kept = sum(d.kept.sum(axis=0) for d in decisions)
    return _table(routed, kept, [int(d.C) for d in decisions])


def merge_loads(tables) -> dict:
    """Several tables (micro-batches, layers' groups) -> one: counts summed, imbalances
    recomputed, capacities listed in order."""
    return _table(sum(t["routed"] for t in tables), sum(t["kept"] for t in tables),
                  [c for t in tables for c in t["capacity"]])  # fmt: skip


def _table(routed, kept, capacity: list) -> dict:
    routed, kept = np.asarray(routed, np.int64), np.asarray(kept, np.int64)
    t = {"routed": routed, "kept": kept, "dropped": routed - kept}
    for k in ("routed", "kept"):
        mean = t[k].mean()
        t[f"imbalance_{k}"] = float(t[k].max() / mean) if mean > 0 else 0.0
    t["capacity"] = capacity
    return t


def same_load(a: dict, b: dict) -> bool:
    """Two tables with equal counts per expert and equal capacities."""
    return all(np.array_equal(a[k], b[k]) for k in ("routed", "kept", "dropped")) and list(
        a["capacity"]
    ) == list(b["capacity"])


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
