"""MoE routing decisions of a layout against the reference's: where bf16 flips a near tie.

Shape letters: N tokens of a routing group, E experts, K top-k, C slots per expert.

A top-k router (emulator/moe.py ``route``) makes two discrete decisions per token (docs/model.md,
"The MoE block"): its CHOICES - the top-k experts, ranked by (-probability, index)
- and the DROPS - slots are filled choice by choice (every token's 1st choice, then every
token's 2nd, ..., tokens in index order), and a choice that finds its expert's C slots full is
dropped. A layout changes only the order of sums. In float64 that moves the router's
probabilities by ~1e-16 and no decision changes. In mixed precision the router's input u is
bf16, rounded after those sums; where two experts' probabilities differ by less than that
rounding, layout and reference may rank them differently, and from then on they train different
models: no tolerance on gradients or parameters holds. Measured on examples/04's model (default
init, E=4, K=2, p ~ 1/E) and the tests' H 24/48 models, 470 3-step runs, tp 1-4 x dp 1-4: flips
in about half of them, also with tp=1 (DDP's sums alone); judged gaps (rule 3) at step 0 <= 1.7e-3
(44 flips), step 1 <= 6.2e-3 (126), step 2 <= 9.5e-3 (80; that one run fails: by step 2 the
parameters already differ by bf16 Adam noise, more than the one-ulp NEAR_TIE meant for step 0).
K = E with capacity for every choice leaves nothing to flip.

The rule every layout's MoE check follows (docs/CONTRACTS.md, "MoE in lower precision"):
  1. the layout's drops must be the spec's fill of its OWN ranked choices, exactly, at every
     step (``fill``; any dtype): a layout that fills slots in another order fails here even
     where its choices equal the reference's;
  2. compare the kept experts of every token (step, micro-batch, block, group) with the
     reference's; no difference: compare the numbers at the dtype's dense tolerance;
  3. first difference at step s: every ranked choice where layout and reference differ, in a
     routing group with a differing kept set, must be a near tie - the reference probability of
     the layout's k-th choice within NEAR_TIE (relative) of the reference's k-th largest. A
     kept-set difference with identical choices is then a capacity drop that follows, by rule 1's
     fill order, from near-tie choices (another token's flip took or freed a slot, or two of a
     token's choices swapped rank). Not judged: a token whose input an earlier block's flip
     already changed - the same sequence at or after a position whose kept experts differed
     (causal attention carries it forward) - its decisions are consequences (measured: up to
     6e-2 apart). Only the losses of the steps before s are compared.
Why not a reference that follows the layout's decisions (teacher-forced routing), so that a
flip never stops the comparison? It needs a routing override inside the model's route
(emulator/moe.py), and the oracle would then take part of its input from the layout under test;
kept out. Tests use K = E (robust) and assert that nothing flipped, or check rule 3.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from emulator.data import split_microbatches
from emulator.model import init_params, model_forward
from emulator.reference import reference_train

NEAR_TIE = 2.0**-7  # bf16's machine epsilon: a gap below one bf16 ulp of the probability


class Route(NamedTuple):
    topi: np.ndarray  # (N, K) ranked choices, 1st choice first
    kept: np.ndarray  # (N, E) bool: token n is computed by expert e (a choice within capacity)
    C: int  # slots per expert
    token: np.ndarray | None = None  # (N,) flat index b S + s of each token in its micro-batch
    S: int | None = None  # sequence length (the reference's routes record it)


def decisions(groups, S: int | None = None) -> list[Route]:
    """[(idx, r, ...) per routing group] (a forward's MoE cache) -> [Route per group]."""
    out = []
    for g in groups:
        r = g[1]
        kept = np.zeros((r["probs"].shape[0], r["E"]), bool)
        kept[r["token"][r["keep"]], r["expert"][r["keep"]]] = True
        out.append(Route(r["topi"].copy(), kept, int(r["C"]), np.asarray(g[0]), S))
    return out


def fill(topi, E, C) -> np.ndarray:
    """The spec's drops: topi (N, K) -> kept (N, E). Choice i = k N + t (choice-major) takes a
    slot if fewer than C earlier choices went to its expert (a cumulative count, not route's
    sort: an independent restatement)."""
    N, K = topi.shape
    expert = topi.T.reshape(-1)  # (K N,) choice-major
    onehot = expert[:, None] == np.arange(E)  # (K N, E)
    before = np.cumsum(onehot, axis=0)[np.arange(K * N), expert] - 1  # earlier, same expert
    keep = before < C
    kept = np.zeros((N, E), bool)
    kept[np.tile(np.arange(N), K)[keep], expert[keep]] = True
    return kept


def reference_routes(cfg, seed, batches, steps, *, microbatches=1, groups_fn=None, params=None,
                     **train_kw) -> list:  # fmt: skip
    """The reference's decisions: [step][micro-batch][block] -> ([Route], [probs (N, E)]) per
    group. Step s reruns reference_train for s steps (same arguments) and the forward of each
    micro-batch on its parameters: O(steps^2) reference steps, for checks only."""
    out = []
    for s in range(steps):
        kw = {"microbatches": microbatches, "groups_fn": groups_fn, "params": params, **train_kw}
        p = reference_train(cfg, seed, batches, s, **kw).params if s else params
        p = init_params(cfg, seed) if p is None else p
        tokens, targets = batches(s) if callable(batches) else batches[s]
        step = []
        for j, (tk, tg) in enumerate(split_microbatches(tokens, targets, microbatches)):
            groups = groups_fn(s, j, *tk.shape) if groups_fn else None
            _, cache = model_forward(p, tk, tg, cfg, groups=groups)
            moe = [c["saved"]["moe"][0] for c in cache["blocks"]]
            step.append([(decisions(g, tk.shape[1]), [x[1]["probs"] for x in g]) for g in moe])
        out.append(step)
    return out


@dataclasses.dataclass
class RoutingCheck:
    first_flip: int | None  # the first step with a differing kept set (None: identical)
    flipped: int  # tokens of that step whose kept experts differ
    tokens: int  # token decisions compared in that step (all blocks), or in all steps
    worst_gap: float  # max gap of a differing ranked choice in a group that flipped
    misfilled: int = 0  # tokens (all steps) whose kept != fill(own choices, reference C)
    downstream: int = 0  # of ``flipped``: inputs already changed by an earlier block's flip

    @property
    def near_ties(self) -> bool:
        """Every difference is explained by near ties (rule 3) under the spec's fill (rule 1)."""
        return self.worst_gap <= NEAR_TIE and not self.misfilled

    def describe(self) -> str:
        fill_note = (
            ""
            if not self.misfilled
            else (
                f"; CAPACITY FILL: {self.misfilled} tokens kept other experts than the spec's "
                "choice-major fill of their own choices"
            )
        )
        if self.first_flip is None:
            return f"routing identical to the reference ({self.tokens} token decisions)" + fill_note
        down = f" ({self.downstream} downstream of an earlier block's flip)" * (self.downstream > 0)
        return (
            f"routing FLIPPED at step {self.first_flip}: {self.flipped} of {self.tokens} token "
            f"decisions differ{down}, worst reference gap {self.worst_gap:.1e} relative "
            f"({'near ties: <=' if self.worst_gap <= NEAR_TIE else 'NOT near ties: >'} "
            f"{NEAR_TIE:.1e}){fill_note}"
        )


def _gaps(got: Route, want: Route, probs, judged) -> float:
    """Worst |p_(k) - p[layout's k-th choice]| / p_(k) over the ``judged`` tokens' ranked choices
    that differ (reference probabilities; p_(k) the reference's k-th largest)."""
    p_k = np.sort(probs, axis=1)[:, ::-1][:, : want.topi.shape[1]]  # (N, K)
    p_got = np.take_along_axis(probs, got.topi, axis=1)  # (N, K)
    differ = (got.topi != want.topi) & judged[:, None]
    return float(np.where(differ, np.abs(p_k - p_got) / np.maximum(p_k, 1e-30), 0.0).max())


def _block(g_routes, w_routes, w_probs, first_bad, judge) -> tuple:
    """One block of one micro-batch -> (flipped, downstream, worst gap, misfilled, tokens).
    ``first_bad`` (B,): per sequence, the first position whose kept experts differed in an
    earlier block; causal attention carries that change to every later position, so those
    tokens' decisions are downstream consequences, not judged. Updated in place."""
    flipped = down = misfilled = n = 0
    worst, changed = 0.0, []
    for g, w, p in zip(g_routes, w_routes, w_probs, strict=True):
        misfilled += int((fill(g.topi, g.kept.shape[1], w.C) != g.kept).any(axis=1).sum())
        differ = (g.kept != w.kept).any(axis=1)  # (N,)
        if w.S is None:  # positions unknown: every token is judged
            after = np.zeros(differ.shape, bool)
        else:
            row, col = np.divmod(w.token, w.S)
            after = col >= first_bad[row]
            changed.append((row[differ], col[differ]))
        if judge and differ.any():  # rank-only differences elsewhere change no computation
            worst = max(worst, _gaps(g, w, p, ~after))
        flipped, down, n = (
            flipped + int(differ.sum()),
            down + int((differ & after).sum()),
            n + differ.size,
        )
    for row, col in changed:  # groups of one block run side by side: update after all of them
        np.minimum.at(first_bad, row, col)
    return flipped, down, worst, misfilled, n


def compare_routes(got, want, top_k) -> RoutingCheck:
    """got [step][micro-batch][block] -> [Route per group] (the layout's, every micro-batch in
    the reference's order); want from ``reference_routes``. Rule 1 is checked at every step;
    ranked-choice gaps at the first flip (after it the models differ), except downstream."""
    total, worst, misfilled, first, result = 0, 0.0, 0, None, None
    for s, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        flipped = down = n = 0
        for g_blocks, w_blocks in zip(g_step, w_step, strict=True):
            rows = sum(x.topi.shape[0] for x in w_blocks[0][0]) // (w_blocks[0][0][0].S or 1)
            first_bad = np.full(rows, np.iinfo(np.int64).max)  # (B,) no flip yet
            for g_routes, (w_routes, w_probs) in zip(g_blocks, w_blocks, strict=True):
                if any(g.topi.shape[1] != top_k for g in g_routes):
                    raise ValueError(f"routes have other than top_k={top_k} choices per token")
                f, d, gap, bad, m = _block(g_routes, w_routes, w_probs, first_bad, first is None)
                flipped, down, n, misfilled = flipped + f, down + d, n + m, misfilled + bad
                worst = max(worst, gap)
        if first is None:
            total += n
            if flipped:
                first, result = s, (flipped, n)
                downstream = down
    if first is None:
        return RoutingCheck(None, 0, total, worst, misfilled)
    return RoutingCheck(first, *result, worst, misfilled, downstream)
