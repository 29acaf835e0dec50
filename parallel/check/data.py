"""A data-parallel run against the single-rank reference trained the SAME way (same dtype), per
precision - the tolerances, each measured - and the MoE routing rule under mixed precision.

Layout and reference differ only in the order gradients are summed (ring over ranks vs
sequential micro-batches), so every difference below is rounding:
  float64  rtol 1e-12 on losses, grads, params, Adam m and v (measured ~1e-15; ~1e-16 per add).
  float32  rtol 1e-4. Measured max over 36 runs (4 stages x D,k in {(2,2),(4,2),(3,1)} x 3
           seeds): params 2.1e-5, grads 7.2e-6, m 6.6e-6, v 3.6e-6, losses 3.4e-8.
  mixed    bf16 gradients (8-bit mantissa) summed in another order; fp32 master and moments.
           Measured max over 80 runs (4 stages x D,k in {(2,2),(4,2),(3,1),(4,1)} x 5 seeds):
           per-tensor grads 5.6e-2, m 3.7e-2, v 3.2e-2; losses 3.4e-5; update L2 3.8e-2.
           Bounds: grads, m, v rtol 0.1; losses 1e-4; parameter UPDATES p - p0 by the
           whole-model relative L2 norm <= 0.08. Not per element: a near-zero gradient entry
           whose sign rounding flips gets the opposite Adam step (+-lr either way), so single
           entries differ by 2 lr however correct the run. The mutant "ZeRO-3 mixed never
           refreshes its bf16 shard" measures (20 runs, minimum): grads 0.74, m 0.41, v 0.42,
           losses 3.8e-4, update L2 0.15 - every one of the five checks fails it.
Noise-level tensors (emulator.check.compare): attn.bk's exact gradient is 0, so its computed
one is rounding noise (bf16: <= 4e-7 of the largest gradient; the smallest real tensor,
attn.bq at init, is >= 3.6e-5): noise_floor 1e-6 (float64/32) and 1e-5 (mixed); Adam v holds
squares, so its floor is the square.

MoE: the rule of parallel/check/routing.py (docs/CONTRACTS.md, "MoE in lower precision"), which
every layout follows. Routing is compared first, token by token (the experts that computed it).
No flip: the tolerances above. A flip at step s (only under mixed precision, where bf16 rounding
of the router input decides near ties: measured here, flipped tokens' reference probability
margins <= 1.5e-2 absolute, same-routed tokens' probabilities differ by <= 3.9e-3): every
flipped expert must be a near tie, and then the runs train different models (one flip moved
moe.w2's gradient by 0.1-0.4 relative), so only the losses of steps 0..s-1 are compared. Step
0 can never flip (identical parameters and micro-batches), and float64 / float32 must never.
"""

from __future__ import annotations

import numpy as np

from emulator.check import compare, compare_losses, compare_run
from parallel.check.routing import compare_routes

TOL = {
    "float64": {"rtol": 1e-12, "noise_floor": 1e-6},
    "float32": {"rtol": 1e-4, "noise_floor": 1e-6},
    "mixed": {"rtol": 0.1, "loss": 1e-4, "update": 0.08, "noise_floor": 1e-5},
}


def update_l2(params, ref_params, init) -> float:
    """||(p - p0) - (p_ref - p0)|| / ||p_ref - p0|| over the whole model (float64)."""
    num = den = 0.0
    for n, p0 in init.items():
        want = np.asarray(ref_params[n], np.float64) - p0
        d = np.asarray(params[n], np.float64) - p0 - want
        num, den = num + float(np.sum(d * d)), den + float(np.sum(want * want))
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def compare_dp(run, ref, dtype, routing=None, top_k=1) -> tuple[dict, list[str], str]:
    """-> (worst: {what: diff}, problems (empty = pass), a sentence saying what was compared).
    `routing`: moe_routing.reference_routes(...) for a MoE model (run.routing is compared first;
    `top_k` = cfg.moe_top_k)."""
    t, problems, note = TOL[dtype], [], ""
    nf, rtol = t["noise_floor"], t["rtol"]
    if routing is not None:
        rc = compare_routes(run.routing, routing, top_k)
        note = rc.describe() + "; "
        if rc.first_flip is not None:
            if dtype != "mixed" or rc.first_flip == 0 or not rc.near_ties:
                problems.append(f"{rc.describe()}: not bf16 rounding of a near tie (step 0 and "
                                f"float64/float32 must route identically)")  # fmt: skip
            s = rc.first_flip
            w, p = compare_losses(run.losses[:s], ref.losses[:s], t.get("loss", rtol))
            note += (f"different models from step {s} on: compared the losses of steps 0..{s - 1}"
                     f" only, max rel diff {w:.1e}")  # fmt: skip
            return {"loss": w}, problems + p, note
    if dtype != "mixed":
        worst, problems2 = compare_run(run, ref, rtol, noise_floor=nf)
    else:
        worst, problems2 = {}, []
        worst["loss"], p = compare_losses(run.losses, ref.losses, t["loss"])
        problems2 += p
        worst["grad"], p = compare(run.grads, ref.grads, rtol, "grad", nf)
        problems2 += p
    for key in ("m", "v"):
        floor = nf * nf if key == "v" else nf  # v holds squares
        worst[f"adam {key}"], p = compare(run.opt_state[key], ref.opt_state[key], rtol,
                                          f"adam {key}", floor)  # fmt: skip
        problems2 += p
    bounds = f"rtol {rtol:g}"
    if dtype == "mixed":
        worst["update L2"] = update_l2(run.params, ref.params, ref.init_params)
        if not worst["update L2"] <= t["update"]:
            problems2.append(f"parameter updates differ: relative L2 {worst['update L2']:.3e} "
                             f"> {t['update']}")  # fmt: skip
        bounds = f"rtol {rtol:g}, losses {t['loss']:g}, update L2 {t['update']:g}"
    note += f"max diff vs reference ({bounds}): " + ", ".join(
        f"{w} {d:.1e}" for w, d in worst.items()
    )
    return worst, problems + problems2, note
