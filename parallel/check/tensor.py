"""A tensor-parallel run (and dp x tp) against the single-rank reference trained the SAME way (same
dtype): the tolerances per precision and model kind, each measured, and the MoE routing rule.

TP changes the order of sums in the forward too (each row-parallel output is a sum of t partial
products, all-reduced), not only in the gradients, so its lower-precision differences start at
step 0 and exceed data parallelism's (parallel/check/data.py). Lower precision compares:
  losses      max relative difference of the loss curve;
  gradients   per tensor, relative L2 ||g - g_ref|| / ||g_ref|| (not the max entry: bf16 leaves
              single entries of cancelling gradients - LayerNorm biases, routers - far off);
  updates     d = p - p0 against d_ref: relative L2 over the whole model AND per tensor (a frozen
              bias is 1.0 per tensor but ~0.08 of the model). Never per element: a near-zero
              gradient entry whose rounding flips its sign gets the opposite Adam step (+-lr
              either way), which moves a 24-entry tensor by 2/sqrt(24) = 0.41 per flipped entry;
  replicas    the replicated tensors' copies on the tp ranks, bitwise (tp_train.replica_mismatch).
Noise-level tensors - reference gradient below noise_floor x the largest, i.e. attn.bk, whose
exact gradient is 0 (emulator.check.compare) - are not compared per tensor nor in the model's
update L2: AdamW turns their rounding noise into full steps (mixed: up to 0.95 of the largest
reference update) whose signs are noise. Their update is only bounded: max |d - d_ref| <=
noise_update x the largest |d_ref| (float32: 2.2e-3 measured; mixed: 1.75, opposite Adam steps;
AdamW moves an entry by <= ~1.17 lr per step whatever its gradient).
Measured maxima, 3 steps, random init and data seeds, TP 1-4, dp 1-2 (DDP, ZeRO-1), SP with and
without re-gather, k 1-2, on examples/04's model (V 32, H 32, 8 heads) and the tests' (12 heads,
H 24/48, F 2H/4H, V 24/48, S 12): 1100 dense and 1100 MoE (K = E) runs in mixed, 300 + 300 in
float32, then 600 + 240 fresh ones through compare_tp (none failed); a bound is the measured
maximum with margin, its number beside it:
  float64  losses, grads rtol 1e-12 per tensor, params 5e-12 (500 random tiny configurations:
           grads <= 3.7e-14; params <= 2.2e-12, 99% <= 2.3e-14: Adam's step lr g / (|g| + eps)
           has slope lr eps / (|g| + eps)^2, 4e4 where a gradient entry cancels to ~eps).
  float32  losses 2.6e-7 -> 1e-6, grads 2.9e-4 (MoE; dense 4.8e-5) -> 5e-4, update L2 2.2e-4
           -> 1e-3, per tensor 1.7e-3 -> 1e-2, noise-level 2.2e-3 -> 1e-2.
  mixed    dense: losses 4.4e-4 -> 5e-4, grads 6.8e-2 -> 0.1, update L2 5.7e-2 -> 0.08, per
           tensor 0.37 -> 0.6.  MoE (K = E): losses 2.9e-4 -> 4e-4, grads 7.5e-2 (a router:
           dL/dlogits = p (dL/dp - sum p dL/dp) cancels) -> 0.12, update L2 5.4e-2 -> 0.08, per
           tensor 0.39 -> 0.6.  Both: noise-level 1.75 -> 2.5. (Tinier bf16 models are noisier:
           H 12 with 24 tokens reaches losses 5.5e-4, grads 0.11, per tensor 0.52.)
Mutants (scratch copies, random seeds and layouts as above, minimum over runs; old = the former
whole-model bounds 0.2 / 0.125): ln1.bias and attn.bo never updated (184 runs): per tensor 1.0
in every run, while update L2 >= 0.05 and grads >= 0.09 (old: 62 of 184 passed); tp rank 1
skips its last AdamW update (118): replicas differ in every run, update L2 >= 0.149 (old: 0.15
vs 0.125); tensor_moe's gate-gradient all-reduce dropped (76): router grad L2 >= 0.6 at K = E,
replicas differ in every run - also where K = 2 flips and nothing numeric compares (old: 10 of
23 of those passed); SP's partial LayerNorm/bias gradients not summed (31): grads >= 0.59.

MoE: the rule of docs/CONTRACTS.md "MoE in lower precision" (parallel/check/routing.py). Unlike
data parallelism, TP may flip a near tie at step 0 (its forward sums differ from the first step).
"""

from __future__ import annotations

import numpy as np

from emulator.check import compare, compare_losses, compare_run
from parallel.check.routing import NEAR_TIE, compare_routes

TOL = {
    "float64": {"rtol": 1e-12, "param": 5e-12, "noise_floor": 1e-6},
    "float32": {"rtol": 5e-4, "loss": 1e-6, "update": 1e-3, "tensor": 1e-2, "noise_update": 1e-2,
                "noise_floor": 1e-6},
    "mixed": {"rtol": 0.1, "loss": 5e-4, "update": 0.08, "tensor": 0.6, "noise_update": 2.5,
              "noise_floor": 1e-5},
    "mixed MoE": {"rtol": 0.12, "loss": 4e-4, "update": 0.08, "tensor": 0.6, "noise_update": 2.5,
                  "noise_floor": 1e-5},
}  # fmt: skip


def _f64(x):
    return np.asarray(x, np.float64)


def noise_level(grads: dict, noise_floor: float) -> set:
    """Names whose max |g| is below noise_floor x the largest |g| of the model."""
    amax = {n: float(np.max(np.abs(_f64(g)), initial=0.0)) for n, g in grads.items()}
    return {n for n, a in amax.items() if a < noise_floor * max(amax.values())}


def grad_l2(got: dict, want: dict, rtol: float, noise_floor: float) -> tuple[float, list[str]]:
    """Per tensor ||got - want|| / ||want|| <= rtol -> (worst, problems). A noise-level tensor
    passes when max |diff| <= rtol x the largest |want|, as in emulator.check.compare."""
    top = max(float(np.max(np.abs(_f64(w)))) for w in want.values())
    noise, worst, problems = noise_level(want, noise_floor), 0.0, []
    for name, w in want.items():
        w, g = _f64(w), _f64(got[name])
        if name in noise:
            d = float(np.max(np.abs(g - w))) / top
        else:
            d = float(np.linalg.norm(g - w) / np.linalg.norm(w))
        worst = max(worst, d)
        if not d <= rtol:
            problems.append(f"grad {name}: relative L2 difference {d:.3e} > {rtol:g}")
    return worst, problems


def update_errors(params, ref_params, init, noise: set) -> tuple[float, dict, float]:
    """d = p - p0 vs d_ref -> (||d - d_ref|| / ||d_ref|| over the tensors not in ``noise``,
    {name: the same per such tensor}, max |d - d_ref| of the ``noise`` ones / max |d_ref|)."""
    num = den = 0.0
    per, diff, top = {}, {}, 0.0
    for n, p0 in init.items():
        want = _f64(ref_params[n]) - p0
        d = _f64(params[n]) - p0 - want
        top = max(top, float(np.max(np.abs(want), initial=0.0)))
        if n in noise:
            diff[n] = float(np.max(np.abs(d), initial=0.0))
            continue
        dd, ww = float(np.sum(d * d)), float(np.sum(want * want))
        per[n] = float(np.sqrt(dd / ww)) if ww > 0 else float(np.sqrt(dd))
        num, den = num + dd, den + ww
    whole = float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))
    return whole, per, max(diff.values(), default=0.0) / top if top > 0 else 0.0


def _lower_precision(run, ref, t) -> tuple[dict, list[str]]:
    worst, p = {}, []
    worst["loss"], q = compare_losses(run.losses, ref.losses, t["loss"])
    p += q
    worst["grad L2"], q = grad_l2(run.grads, ref.grads, t["rtol"], t["noise_floor"])
    p += q
    noise = noise_level(ref.grads, t["noise_floor"])
    whole, per, noisy = update_errors(run.params, ref.params, ref.init_params, noise)
    worst["update L2"], worst["per-tensor update"] = whole, max(per.values(), default=0.0)
    worst["noise update"] = noisy
    if not whole <= t["update"]:
        p.append(f"parameter updates differ: relative L2 {whole:.3e} > {t['update']:g}")
    p += [f"update of {n} differs: relative L2 {d:.3e} > {t['tensor']:g}"
          for n, d in per.items() if not d <= t["tensor"]]  # fmt: skip
    if not noisy <= t["noise_update"]:
        p.append(f"noise-level tensors {sorted(noise)}: max |update diff| "
                 f"{noisy:.3e} x the largest update > {t['noise_update']:g}")  # fmt: skip
    return worst, p


def compare_tp(run, ref, dtype, routing=None, top_k=1) -> tuple[dict, list[str], str]:
    """-> (worst: {what: diff}, problems (empty = pass), a sentence saying what was compared).
    ``routing``: moe_routing.reference_routes(...) for an MoE model (``run.routing`` is
    compared first; ``top_k`` = cfg.moe_top_k). ``worst`` is empty when nothing numeric was
    comparable (a routing flip at step 0): that is not a pass (emulator.check.verdict's SKIP)."""
    moe = any(".moe." in n for n in ref.params)
    kind = "mixed MoE" if dtype == "mixed" and moe else dtype
    t, note = TOL[kind], ""
    problems = [f"replicas differ across tp ranks: {n} (every rank computes them identically)"
                for n in getattr(run, "replica_mismatch", [])]  # fmt: skip
    if routing is not None:
        rc = compare_routes(run.routing, routing, top_k)
        note = rc.describe() + "; "
        if not rc.near_ties or (rc.first_flip is not None and dtype != "mixed"):
            problems.append(f"{rc.describe()}: not bf16 rounding of a near tie (<= {NEAR_TIE:.1e}"
                            " relative) under the spec's fill order")  # fmt: skip
        if rc.first_flip is not None:
            s = rc.first_flip
            w, p = compare_losses(run.losses[:s], ref.losses[:s], t.get("loss", t["rtol"]))
            note += f"layout and reference train different models from step {s} on: " + (
                f"compared the losses of steps 0..{s - 1} only (max rel diff {w:.1e})" if s
                else "no loss, gradient or parameter is comparable"
            )  # fmt: skip
            return ({"loss": w} if s else {}), problems + p, note  # {}: nothing compared
    if dtype == "float64":
        worst, p = compare_run(run, ref, t["rtol"], param_atol=np.inf)  # losses, gradients
        worst["param"], q = compare(run.params, ref.params, t["param"], "param", t["noise_floor"])
        p += q
        bounds = f"rtol {t['rtol']:g}, params {t['param']:g}"
    else:
        worst, p = _lower_precision(run, ref, t)
        bounds = (f"{kind}: losses {t['loss']:g}, grad L2 {t['rtol']:g}, update L2 {t['update']:g}"
                  f", per tensor {t['tensor']:g}, noise-level {t['noise_update']:g}")  # fmt: skip
    note += f"max diff vs reference ({bounds}): " + ", ".join(
        f"{w} {d:.1e}" for w, d in worst.items()
    )
    return worst, problems + p, note
