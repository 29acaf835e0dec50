"""MoE routing decisions of a layout against the reference's: where bf16 flips a near tie.

Shape letters: N tokens of a routing group, E experts, K top-k.

A top-k router (emulator/moe.py ``route``) makes a discrete decision per token: the experts it is
sent to and kept by (top-k, then the capacity, filled in choice order). A layout changes only the
order of sums. In float64 that moves the router's probabilities by ~1e-16 and no decision changes.
In mixed precision the router's input u is bf16, rounded after those sums; where two experts'
probabilities differ by less than that rounding, the layout and the reference may decide
differently, and from then on they train different models: no tolerance on gradients or
parameters holds. Measured on examples/04's model (default init, E=4, K=2, p ~ 1/E): flips in
about half of 3-step dp x tp runs, also with tp=1 (DDP's sums alone), all within 1.6e-3 relative.
Scaling the router does not help (the rounding of its logits scales with it); K = E with capacity
for every choice leaves nothing to flip.

The rule every layout's MoE check follows (docs/CONTRACTS.md, "MoE in lower precision"):
  1. compare the decision of every token (step, micro-batch, block, group) with the reference's;
  2. no flip: compare losses, gradients and parameter updates at the dtype's dense tolerance;
  3. first flip at step s: every expert the layout chose and the reference did not must be a near
     tie - its reference probability within NEAR_TIE (relative) of the reference's K-th choice -
     and only the losses of the steps before s are compared; the example says so.
Tests use K = E (robust) and assert that nothing flipped, or check rule 3 where flips can happen.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from emulator.data import split_microbatches
from emulator.model import init_params, model_forward
from emulator.reference import reference_train

NEAR_TIE = 2.0**-7  # bf16's machine epsilon: a gap below one bf16 ulp of the probability


def decisions(groups) -> list:
    """[(idx, r, ...) per routing group] (a forward's MoE cache) -> [kept (N, E) bool per group]:
    kept[n, e] = token n is computed by expert e (among its top-k and within e's capacity)."""
    out = []
    for g in groups:
        r = g[1]
        kept = np.zeros((r["probs"].shape[0], r["E"]), bool)
        kept[r["token"][r["keep"]], r["expert"][r["keep"]]] = True
        out.append(kept)
    return out


def reference_routes(cfg, seed, batches, steps, *, microbatches=1, groups_fn=None, params=None,
                     **train_kw) -> list:  # fmt: skip
    """The reference's decisions: [step][micro-batch][block] -> ([topi (N, K)], [probs (N, E)])
    per group. Step s reruns reference_train for s steps (same arguments) and the forward of
    each micro-batch on its parameters: O(steps^2) reference steps, for checks only."""
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
            step.append([(decisions(g), [x[1]["probs"] for x in g]) for g in moe])
        out.append(step)
    return out


@dataclasses.dataclass
class RoutingCheck:
    first_flip: int | None  # the first step with a differing decision (None: identical)
    flipped: int  # tokens of that step whose kept experts differ
    tokens: int  # token decisions compared in that step (all blocks), or in all steps
    worst_gap: float  # max over experts the layout added of (p_K - p_e) / p_K, reference probs

    @property
    def near_ties(self) -> bool:
        return self.worst_gap <= NEAR_TIE

    def describe(self) -> str:
        if self.first_flip is None:
            return f"routing identical to the reference ({self.tokens} token decisions)"
        return (
            f"routing FLIPPED at step {self.first_flip}: {self.flipped} of {self.tokens} token "
            f"decisions differ, worst reference gap {self.worst_gap:.1e} relative "
            f"({'near ties: <=' if self.near_ties else 'NOT near ties: >'} {NEAR_TIE:.1e})"
        )


def _gap(got, want, probs, K) -> tuple[int, float]:
    """(tokens whose kept experts differ, worst relative gap of an expert only ``got`` kept)."""
    rows = np.nonzero((got != want).any(axis=1))[0]
    p = probs[rows]  # (n, E) reference probabilities of the flipped tokens
    p_k = np.sort(p, axis=1)[:, -K][:, None]  # (n, 1) the reference's K-th choice
    added = got[rows] & ~want[rows]  # experts the layout kept and the reference did not
    gap = np.where(added, (p_k - p) / np.maximum(p_k, 1e-30), 0.0)  # <= 0: dropped by capacity
    return rows.size, float(gap.max(initial=0.0))


def compare_routes(got, want, top_k) -> RoutingCheck:
    """got [step][micro-batch][block] -> [kept per group] (the layout's, every micro-batch in
    the reference's order); want from ``reference_routes``."""
    total = 0
    for s, (g_step, w_step) in enumerate(zip(got, want, strict=True)):
        flipped, gaps, n = 0, [0.0], 0
        for g_blocks, w_blocks in zip(g_step, w_step, strict=True):
            for g_kept, (w_kept, w_probs) in zip(g_blocks, w_blocks, strict=True):
                for gk, wk, p in zip(g_kept, w_kept, w_probs, strict=True):
                    f, gap = _gap(gk, wk, p, top_k)
                    n, flipped = n + gk.shape[0], flipped + f
                    gaps.append(gap)
        total += n
        if flipped:
            return RoutingCheck(s, flipped, n, max(gaps))
    return RoutingCheck(None, 0, total, 0.0)
