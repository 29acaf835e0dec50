"""The attention work each cp rank does at each ring step, in closed form.

Shape letters: S global sequence, C cp ranks, S_local = S / C, c = S / (2C) (a zigzag chunk).
Work is counted per (batch, head) as the score entries a rank computes: rows (queries) times
columns (keys) of the part of the block pair that sees anything (ring.py computes exactly that
part and records it; the tests compare the record with these formulas). At step t rank r holds
the K/V block of rank src = (r - t) mod C.

  contiguous  src <= r (t <= r): the whole block, S_local x S_local; src > r: fully masked,
              skipped. Rank r computes r + 1 blocks; the last rank C, the first one.
  zigzag      t = 0: S_local x S_local (the own block: 3 of its 4 chunk pairs see something);
              src < r: all queries on key chunk src only, S_local x c;
              src > r: only query chunk 2C-1-r, on both key chunks, c x S_local.
              Every rank computes S_local^2 (C + 1) / 2 entries: balanced (Brandon et al. 2023).

Visible (useful) entries per rank: contiguous r S_local^2 + S_local (S_local + 1) / 2; zigzag
c^2 (2C - 1) + c (c + 1) on every rank; both sum to S (S + 1) / 2 over the ranks.
The ring's steps are synchronous (a block moves on when every rank is done with it), so the
time is set by the critical path sum_t max_r work[r][t]: C S_local^2 contiguous, (C + 1) / 2
S_local^2 zigzag - a speed-up of 2C / (C + 1) from balancing alone.
"""

from __future__ import annotations

from parallel.context.layout import check


def steps(S: int, C: int, balance: str) -> list:
    """[rank][t] -> (rows, cols) computed at ring step t; (0, 0) = skipped."""
    check(S, C, balance)
    S_l = S // C
    out = []
    for r in range(C):
        row = []
        for t in range(C):
            src = (r - t) % C
            if balance == "contiguous":
                row.append((S_l, S_l) if src <= r else (0, 0))
            elif t == 0:
                row.append((S_l, S_l))
            else:
                row.append((S_l, S_l // 2) if src < r else (S_l // 2, S_l))
        out.append(row)
    return out


def entries(S: int, C: int, balance: str) -> list:
    """[rank][t] -> score entries computed (rows * cols)."""
    return [[a * b for a, b in row] for row in steps(S, C, balance)]


def visible(S: int, C: int, balance: str, rank: int) -> int:
    """Visible (query, key) pairs of rank `rank`'s queries: the useful part of its work."""
    check(S, C, balance)
    S_l, c = S // C, S // (2 * C)
    if balance == "contiguous":
        return rank * S_l * S_l + S_l * (S_l + 1) // 2
    return c * c * (2 * C - 1) + c * (c + 1)


def critical_path(S: int, C: int, balance: str) -> int:
    """sum over steps of the slowest rank's entries: the ring's time in entry units."""
    e = entries(S, C, balance)
    return sum(max(e[r][t] for r in range(C)) for t in range(C))


def summary(S: int, C: int, balance: str) -> dict:
    e = entries(S, C, balance)
    per_rank = [sum(row) for row in e]
    return {
        "entries": e,
        "per_rank": per_rank,
        "skipped": [sum(1 for x in row if x == 0) for row in e],
        "imbalance": max(per_rank) * C / sum(per_rank),
        "critical_path": critical_path(S, C, balance),
        "visible": [visible(S, C, balance, r) for r in range(C)],
    }
