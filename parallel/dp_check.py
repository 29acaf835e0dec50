"""The closed forms a data-parallel run is checked against: bytes per step, static memory per
rank and peak gathered memory (ZeRO paper, Rajbhandari et al. 2020, sections 3.1 and 7).
(Comparing a run with the reference: emulator.check.compare / compare_run.)

Letters: D dp degree; Psi real parameters; Psi_pad = sum of the flat buffers' padded sizes
(each a multiple of D, so every ring chunk is Psi_pad/D of a buffer and the formulas are exact
integers); c = compute itemsize (bf16: 2; float64: 8), m = master itemsize (fp32: 4; float64: 8);
mixed = a separate master copy exists (c != m); k micro-batches per step.

Bytes sent (= received) per rank per optimizer step, wire dtype = compute dtype:
  one ring reduce-scatter or all-gather of a buffer moves  unit = Psi_pad (D-1)/D * c
  ddp        2 unit                      (all-reduce = RS + AG, once per step: no_sync)
  zero-1     2 unit                      (RS of grads + AG of params)
  zero-2     (k + 1) unit                (RS per micro-batch: grads are never held whole)
  zero-3     k (2 + 1) unit, or k (1 + 1) unit with reshard_after_forward=False
Static memory per rank (params / grads / optimizer); with mixed: c=2, m=4 -> 16 Psi,
4 Psi + 12 Psi/D, 2 Psi + 14 Psi/D, 16 Psi/D (the paper's K = 12):
  ddp     params Psi (m + c [mixed]), grads Psi_pad c, optimizer 2 Psi m
  zero-1  params Psi_pad c + (Psi_pad/D) m [mixed], grads Psi_pad c,   optimizer 2 (Psi_pad/D) m
  zero-2  as zero-1 but grads (Psi_pad/D) c
  zero-3  params (Psi_pad/D)(c + m [mixed]), grads (Psi_pad/D) c,      optimizer 2 (Psi_pad/D) m
"""

from __future__ import annotations

import itertools

from emulator.precision import compute_dtype, master_dtype

PAPER = {"ddp": "16 Psi", "1": "4 Psi + 12 Psi/D", "2": "2 Psi + 14 Psi/D", "3": "16 Psi/D"}


def step_bytes(stage, layouts, dtype, microbatches=1, reshard_after_forward=True) -> dict:
    """{"grads": bytes, "params": bytes} sent (= received) by every rank in one step."""
    stage, k = str(stage), microbatches
    D, c = layouts[0].D, compute_dtype(dtype).itemsize
    unit = sum(lay.padded for lay in layouts) * (D - 1) // D * c
    if stage == "ddp":
        return {"grads": 2 * unit, "params": 0}
    if stage == "1":
        return {"grads": unit, "params": unit}
    if stage == "2":
        return {"grads": k * unit, "params": unit}
    return {"grads": k * unit, "params": k * (2 if reshard_after_forward else 1) * unit}


def static_memory(stage, layouts, n_params: int, dtype) -> dict:
    """Bytes per category of the state that lives for the whole run."""
    stage = str(stage)
    D = layouts[0].D
    c, m = compute_dtype(dtype).itemsize, master_dtype(dtype).itemsize
    mixed = dtype == "mixed"
    pad = sum(lay.padded for lay in layouts)
    shard = pad // D
    if stage == "ddp":
        return {
            "params": n_params * (m + c * mixed),
            "grads": pad * c,
            "optimizer": 2 * n_params * m,
        }
    params = (pad * c if stage in "12" else shard * c) + shard * m * mixed
    grads = pad * c if stage == "1" else shard * c
    return {"params": params, "grads": grads, "optimizer": 2 * shard * m}


def peak_fsdp(layouts, n_layers: int, dtype, reshard_after_forward=True, prefetch=False) -> dict:
    """Peak params and grads bytes of ZeRO-3 / FSDP over a step: the static shards plus the
    largest set of units gathered at once - the root unit (live through each whole pass) plus
    one block, two with prefetch, every block without resharding - and, for grads, the root's
    and one block's full gradient before their reduce-scatter."""
    c = compute_dtype(dtype).itemsize
    root, blocks = layouts[0].padded, [lay.padded for lay in layouts[1:]]
    if not reshard_after_forward:
        live = sum(blocks)
    elif prefetch and n_layers >= 2:
        live = max(a + b for a, b in itertools.pairwise(blocks))
    else:
        live = max(blocks)
    static = static_memory("3", layouts, 0, dtype)
    return {
        "params": static["params"] + (root + live) * c,
        "grads": static["grads"] + (root + max(blocks)) * c,
    }
