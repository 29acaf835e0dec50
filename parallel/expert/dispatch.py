"""Moving token rows between the ranks of an expert-parallel group, and back.

Shape letters: P the ep group size, E experts, El = E / P local experts (rank r owns experts
r El .. (r+1) El - 1), G routing groups on this rank, C_g slots per expert of group g, H d_model.

Every routing group fills its (E, C_g, H) buffer exactly as emulator/moe.py's ``dispatch`` does;
the kept choices of expert e are slots 0 .. n[g, e] - 1 (slots fill from 0, in choice-major
order), so "what to send" is one table ``n`` (G, E) of rows per group and expert:
  exact   n[g, e] = kept choices of e in group g          (Megatron-core's alltoall dispatcher)
  padded  n[g, e] = C_g, empty slots sent as zeros        (GShard / DeepSpeed: fixed sizes)
The rows for rank d are laid out expert-major, then group, then slot:
  [e = d El: g0 slots, g1 slots, ...][e = d El + 1: ...] ...
so the receiver splits what source s sent by the per-expert totals ``counts[s]`` (El,).

Exact mode first exchanges those totals (an all-to-all of E int64s: El to every peer); padded
mode needs none (every block is El x sum_g C_g rows: one fixed-size all_to_all, whose shape
check makes ranks with different slot totals a named collective mismatch). The backward moves
the gradients over the same two exchanges in reverse, with the forward's counts (no new exchange).
Byte counts: parallel/expert/cost.py.
"""

from __future__ import annotations

import itertools

import numpy as np

from collectives.api import all_to_all, all_to_allv
from emulator import scope

MODES = ("exact", "padded")


def rows_table(routes, E: int, mode: str) -> np.ndarray:
    """(G, E) int64: rows each routing group sends for each expert (see the module docstring)."""
    if mode == "padded":
        return np.array([[r["C"]] * E for r in routes], np.int64).reshape(len(routes), E)
    kept = [np.bincount(r["expert"][r["keep"]], minlength=E) for r in routes]
    return np.array(kept, np.int64).reshape(len(routes), E)


def expert_counts(n: np.ndarray) -> np.ndarray:
    """(E,) int64: rows this rank sends to each expert, summed over its routing groups (the
    numbers announced in exact mode's count exchange)."""
    return n.sum(axis=0).astype(np.int64)


def pack(bufs, n: np.ndarray, P: int) -> list[np.ndarray]:
    """bufs: G arrays (E, C_g, H) -> P arrays (rows_d, H), rank d's experts' rows, expert-major
    (a lone part - one local expert, one group - is its buffer's rows themselves, a view: the
    exchange copies what it sends)."""
    E = n.shape[1]
    El, rows = E // P, n.tolist()
    out = []
    for d in range(P):
        parts = [bufs[g][e, : rows[g][e]] for e in range(d * El, (d + 1) * El)
                 for g in range(len(bufs))]  # fmt: skip
        out.append(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0))
    return out


def unpack(blocks, n: np.ndarray, P: int, shapes, dtype) -> list[np.ndarray]:
    """The inverse of pack: P arrays (rows_d, H) -> G zero-filled buffers (E, C_g, H)."""
    E = n.shape[1]
    El, rows = E // P, n.tolist()
    bufs = [np.zeros(s, dtype) for s in shapes]
    for d in range(P):
        off = 0
        for e in range(d * El, (d + 1) * El):
            for g in range(len(bufs)):
                k = rows[g][e]
                bufs[g][e, :k] = blocks[d][off : off + k]
                off += k
    return bufs


def by_expert(recv, counts: np.ndarray) -> list[np.ndarray]:
    """recv: P arrays from the sources; counts (P, El) -> El arrays (rows_e, H), sources in order."""
    P, El = counts.shape
    if El == 1:  # each source's rows are all for the one local expert
        return [np.concatenate(recv)]
    offs = [[0, *itertools.accumulate(row)] for row in counts.tolist()]  # (P, El + 1)
    return [
        np.concatenate([recv[s][offs[s][e] : offs[s][e + 1]] for s in range(P)]) for e in range(El)
    ]


def to_sources(rows, counts: np.ndarray) -> list[np.ndarray]:
    """The inverse of by_expert: El arrays (rows_e, H) -> P arrays (rows_s, H) for the sources
    (one local expert: its rows' slices themselves, views: the exchange copies what it sends)."""
    P, El = counts.shape
    offs = [[0, *itertools.accumulate(col)] for col in counts.T.tolist()]  # (El, P + 1)
    parts = [[rows[e][offs[e][s] : offs[e][s + 1]] for e in range(El)] for s in range(P)]
    return [p[0] if El == 1 else np.concatenate(p) for p in parts]


def announce(ep, counts: np.ndarray, sends) -> np.ndarray:
    """Exact mode's count exchange: counts (E,) int64, El per destination, by an all-to-all of
    integers (counted; tag "counts") -> (P, El): what each source will send to my experts.

    Before anything moves, the rows packed for every destination must equal the counts announced
    to it: a disagreement would leave a receiver waiting for rows that never come (or rows that
    nobody receives), so it is a named error on the sending rank instead.
    """
    P = ep.size
    El = counts.size // P
    for d, said in enumerate(counts.reshape(P, El).sum(axis=1).tolist()):
        rows = sends[d].shape[0]
        if said != rows:
            raise RuntimeError(
                f"expert-parallel count exchange: rank {ep.rank} of group {ep.name!r} announces "
                f"{said} rows to rank {d} (experts {d * El}..{(d + 1) * El - 1}) but packed {rows}; "
                f"counts and rows disagree, so rank {d} would wait for rows that never match"
            )
    with scope("counts"):
        return all_to_all(ep, np.ascontiguousarray(counts, np.int64)).reshape(P, El)


def exchange(ep, sends, send_rows, recv_rows, mode: str, tag: str) -> list[np.ndarray]:
    """One all-to-all(v) of rows: sends[d] (send_rows[d], H) to rank d -> P arrays from sources.

    exact: all_to_allv with the receive counts given (already exchanged); padded: every block has
    the same rows, so one fixed-size all_to_all of the concatenation.
    """
    P, H = ep.size, sends[0].shape[1]
    with scope(tag):
        if mode == "exact":
            return all_to_allv(ep, sends, recv_counts=[int(c) for c in recv_rows])
        k = sends[0].shape[0]
        out = all_to_all(ep, np.concatenate(sends, axis=0).reshape(P * k, H))
    return [out[s * k : (s + 1) * k] for s in range(P)]
