"""A tensor-parallel run (and dp x tp) against the single-rank reference trained the SAME way (same
dtype): the tolerances per precision, each measured, and the MoE routing rule.

TP changes the order of sums in the forward too (each row-parallel output is a sum of t partial
products, all-reduced), not only in the gradients, so its lower-precision differences start at
step 0 and exceed data parallelism's (parallel/dp_compare.py). Lower precision compares:
  losses      max relative difference of the loss curve;
  gradients   per tensor, relative L2 ||g - g_ref|| / ||g_ref|| (not the max entry: bf16 leaves
              single entries of cancelling gradients - LayerNorm biases, K = E routers, whose
              gates sum to 1 so dL/dlogits = p (dL/dp - sum p dL/dp) - up to 0.4 off in correct
              runs, while their L2 stays <= 0.1);
  updates     p - p0, whole-model relative L2 (parallel/dp_compare.update_l2), never per
              element: a near-zero gradient entry whose rounding flips its sign gets the
              opposite Adam step (+-lr either way).
Measured maxima (TP 1-4, SP with and without re-gather, k 1-2, dense and MoE with K = E,
3 steps; 60 runs of examples/04's model, 220 of H 12-24 / S 12 models, 220 tiny dense ones):
  float64  losses, grads rtol 1e-12 per tensor, params 5e-12 (measured over 500 random tiny
           configurations: grads <= 3.7e-14; params <= 2.2e-12, 99% <= 2.3e-14: Adam's step
           lr g / (|g| + eps) has slope lr eps / (|g| + eps)^2, 4e4 where a gradient entry
           cancels to ~eps, so one ulp of the tensor's gradient moves the parameter 5.6e-15).
  float32  losses 2.1e-7, grads 9.8e-5, update L2 8.5e-5    -> bounds 1e-6, 5e-4, 1e-3.
  mixed    losses 2.9e-4, grads 9.5e-2 (a K = E router), update L2 0.10
           -> bounds 5e-4, 0.2, 0.125. (Tiny bf16 MoE models, H <= 16 and 2 S tokens, put a
           router at 0.97 and the loss at 6.9e-4: the tests draw MoE at H >= 12, S = 12.)
Mutants (each measured on >= 15 runs): the gate-gradient all-reduce of tensor_moe dropped: router
L2 >= 0.65; SP's partial LayerNorm/bias gradients not summed: >= 0.65; one tp rank skipping its
last AdamW update: update L2 >= 0.14 (its gradients precede the update and match; the old bound
|p - p_ref| <= 2 lr per step passed it). attn.bk's exact gradient is 0 (emulator.check.compare's
noise-level tensors): bf16 leaves it at <= 2.4e-6 of the largest gradient, the smallest real
tensor is >= 3.3e-5, so mixed uses noise_floor 1e-5.

MoE: the rule of docs/CONTRACTS.md "MoE in lower precision" (parallel/moe_routing.py). Unlike
data parallelism, TP may flip a near tie at step 0 (its forward sums differ from the first step).
"""

from __future__ import annotations

import numpy as np

from emulator.check import compare, compare_losses, compare_run
from parallel.dp_compare import update_l2
from parallel.moe_routing import compare_routes

TOL = {
    "float64": {"rtol": 1e-12, "param": 5e-12, "noise_floor": 1e-6},
    "float32": {"rtol": 5e-4, "loss": 1e-6, "update": 1e-3, "noise_floor": 1e-6},
    "mixed": {"rtol": 0.2, "loss": 5e-4, "update": 0.125, "noise_floor": 1e-5},
}


def grad_l2(got: dict, want: dict, rtol: float, noise_floor: float) -> tuple[float, list[str]]:
    """Per tensor ||got - want|| / ||want|| <= rtol -> (worst, problems). A noise-level tensor
    (max |want| < noise_floor x the largest |want|) passes when max |diff| <= rtol x that
    largest value, as in emulator.check.compare."""
    top = max(float(np.max(np.abs(np.asarray(w, np.float64)))) for w in want.values())
    worst, problems = 0.0, []
    for name, w in want.items():
        w, g = np.asarray(w, np.float64), np.asarray(got[name], np.float64)
        if np.max(np.abs(w)) < noise_floor * top:
            d = float(np.max(np.abs(g - w))) / top
        else:
            d = float(np.linalg.norm(g - w) / np.linalg.norm(w))
        worst = max(worst, d)
        if not d <= rtol:
            problems.append(f"grad {name}: relative L2 difference {d:.3e} > {rtol:g}")
    return worst, problems


def compare_tp(run, ref, dtype, routing=None, top_k=1) -> tuple[dict, list[str], str]:
    """-> (worst: {what: diff}, problems (empty = pass), a sentence saying what was compared).
    ``routing``: moe_routing.reference_routes(...) for an MoE model (``run.routing`` is
    compared first; ``top_k`` = cfg.moe_top_k)."""
    t, problems, note = TOL[dtype], [], ""
    if routing is not None:
        rc = compare_routes(run.routing, routing, top_k)
        note = rc.describe() + "; "
        if rc.first_flip is not None:
            if dtype != "mixed" or not rc.near_ties:
                problems.append(f"{rc.describe()}: not bf16 rounding of a near tie")
            s = rc.first_flip
            w, p = compare_losses(run.losses[:s], ref.losses[:s], t.get("loss", t["rtol"]))
            note += f"layout and reference train different models from step {s} on: " + (
                f"compared the losses of steps 0..{s - 1} only (max rel diff {w:.1e})" if s
                else "no loss, gradient or parameter is comparable"
            )  # fmt: skip
            return {"loss": w}, problems + p, note
    if dtype == "float64":
        worst, p = compare_run(run, ref, t["rtol"], param_atol=np.inf)  # losses, gradients
        worst["param"], q = compare(run.params, ref.params, t["param"], "param", t["noise_floor"])
        p += q
        bounds = f"rtol {t['rtol']:g}, params {t['param']:g}"
    else:
        worst, p = {}, []
        worst["loss"], q = compare_losses(run.losses, ref.losses, t["loss"])
        p += q
        worst["grad L2"], q = grad_l2(run.grads, ref.grads, t["rtol"], t["noise_floor"])
        p += q
        worst["update L2"] = update_l2(run.params, ref.params, ref.init_params)
        if not worst["update L2"] <= t["update"]:
            p.append(f"parameter updates differ: relative L2 {worst['update L2']:.3e} "
                     f"> {t['update']:g}")  # fmt: skip
        bounds = f"losses {t['loss']:g}, grad L2 {t['rtol']:g}, update L2 {t['update']:g}"
    note += f"max diff vs reference ({bounds}): " + ", ".join(
        f"{w} {d:.1e}" for w, d in worst.items()
    )
    return worst, problems + p, note
