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

from collectives.cost import tree_broadcast
from emulator.flops import activation_bytes_per_block
from emulator.precision import compute_dtype, master_dtype

PAPER = {"ddp": "16 Psi", "1": "4 Psi + 12 Psi/D", "2": "2 Psi + 14 Psi/D", "3": "16 Psi/D"}
# elements on the wire per step at k = 1 (ZeRO section 7: all-reduce = RS + AG = 2 Psi; ZeRO-3
# adds one all-gather: 3 Psi), and the k-scaled count this code moves (see step_bytes)
PAPER_WIRE = {"ddp": "2 Psi", "1": "2 Psi", "2": "2 Psi", "3": "3 Psi"}


def wire_elements(stage, k=1, reshard_after_forward=True) -> int:
    """Multiple of Psi moved per step (send side, before the (D-1)/D of the ring): 2, 2, k+1,
    3k (2k without resharding); at k = 1 the paper's 2, 2, 2, 3 (2 for the no-reshard variant)."""
    stage = str(stage)
    if stage in ("ddp", "1"):
        return 2
    if stage == "2":
        return k + 1
    return k * (2 if reshard_after_forward else 1) + k


def paper_figures(stage, psi: int, psi_pad: int, D: int, dtype, k=1, reshard=True) -> dict:
    """The paper's numbers beside this run's: bytes sent per rank per step at k = 1 from the real
    Psi (may be fractional), the same from Psi_pad (an integer), the k-scaled bytes this run
    moves, and the static memory 2c + K per parameter (mixed: c = 2, K = 12 -> 16 Psi, 4 Psi +
    12 Psi/D, 2 Psi + 14 Psi/D, 16 Psi/D; float64: c = 8, K = 16) from Psi and as allocated
    (flat buffers padded to Psi_pad; DDP's gradient buckets only: (c + K) Psi + c Psi_pad)."""
    stage = str(stage)
    c, m = compute_dtype(dtype).itemsize, master_dtype(dtype).itemsize
    K = 2 * m + m * (dtype == "mixed")  # Adam m, v (+ the fp32 master copy)
    w1, wk = wire_elements(stage, 1, reshard), wire_elements(stage, k, reshard)
    mem = {"ddp": lambda p: (2 * c + K) * p, "1": lambda p: 2 * c * p + K * p / D,
           "2": lambda p: c * p + (c + K) * p / D, "3": lambda p: (2 * c + K) * p / D}[stage]  # fmt: skip
    return {
        "bytes k=1 (Psi)": w1 * psi * c * (D - 1) / D,
        "bytes k=1 (Psi_pad)": w1 * psi_pad * c * (D - 1) // D,
        f"bytes k={k} (Psi_pad)": wk * psi_pad * c * (D - 1) // D,
        "memory (Psi)": mem(psi),
        # as allocated: flat buffers are padded; DDP's replicated model and AdamW are not
        "memory (Psi_pad)": (c + K) * psi + c * psi_pad if stage == "ddp" else mem(psi_pad),
        "c": c,
        "K": K,
    }


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


def peak_memory(stage, layouts, n_params: int, cfg, b: int, S: int, *, reshard_after_forward=True,
                prefetch=False, recompute="none") -> dict:  # fmt: skip
    """Peak bytes per category over a step (static state included):
    ddp, zero-1  params, grads: the static state (nothing transient is allocated)
    zero-2       grads: static shards + ONE bucket's full gradient, max_i padded_i c. The
                 backward produces gradients in exactly reverse parameter order, the bucket
                 order, and a bucket is reduce-scattered and freed the moment its last
                 gradient arrives - before the next bucket's first - so one is live at a time
    zero-3       peak_fsdp (the root unit + one / two / all gathered blocks)
    activations  L blocks of one micro-batch (b = B / (D k) rows; micro-batches run one
                 after another): L * emulator.flops.activation_bytes_per_block(cfg, b, S);
                 recompute="full": the L kept block inputs (a b S H each) PLUS the whole cache
                 of the block being recomputed (its "none" bytes, emulator/block.py keeps it
                 through that block's backward) - at the last block's backward, when every
                 block's input is still alive
    """
    stage, c = str(stage), compute_dtype(cfg.dtype).itemsize
    static = static_memory(stage, layouts, n_params, cfg.dtype)
    peak = {"params": static["params"], "grads": static["grads"]}
    if stage == "2":
        peak["grads"] += max(lay.padded for lay in layouts) * c
    if stage == "3":
        peak |= peak_fsdp(layouts, cfg.n_layers, cfg.dtype, reshard_after_forward, prefetch)
    peak["activations"] = cfg.n_layers * activation_bytes_per_block(cfg, b, S, recompute)
    if recompute == "full":  # + the recomputed block's cache (was left out: 640 B vs 6,720 B)
        peak["activations"] += activation_bytes_per_block(cfg, b, S, "none")
    return peak


def init_broadcast_bytes(n_params: int, D: int, itemsize: int, rank: int) -> tuple[int, int]:
    """(sent, received) by dp rank ``rank`` for DDP's one broadcast of the initial parameters
    from rank 0 (parallel/data/ddp.py): a binomial tree over D ranks of n_params elements,
    once per run, outside every step's formula."""
    return tree_broadcast(n_params, D, itemsize, rank)
