"""The "this model" column: a plan's layout priced exactly for this project's model.

The model is the spec's GPT block (emulator.config) at the preset's shape in "mixed" precision:
bf16 compute copy, activations and gradients, fp32 master and Adam moments. Per GPU, for the
worst rank (pipeline stage 0 or the last stage, tensor rank 0):
  parameters  the stage's names (parallel.pipeline.executor.stage_param_names, layers split as
              evenly as possible), each at its Megatron tensor-parallel local shape
              (parallel.tensor.block.megatron_plan, replicated LayerNorms and row biases)
  state       parallel.data.cost.peak_memory over those local shapes with the layout's flat
              buffers (DDP / ZeRO-1/2 buckets of 25 MiB, ZeRO-3 one FSDP unit per block plus the
              root): the padding to a multiple of dp, ZeRO-2's one transient bucket, ZeRO-3's
              gathered root unit + one block, all as the memory ledger records them; optimizer
              static (2 fp32 moments per owned element)
  activations per block emulator.flops.activation_bytes_per_block (tp = 1) or
              parallel.tensor.cost.block_activation_bytes (tp > 1, sequence parallel); full
              recompute with tp > 1 keeps the block input sharded on the sequence: 2 B S H / t
              (priced only: this project's tp code recomputes none or selective).
              Times L: 1F1B's stage 0 holds min(pp, m) = pp micro-batches of L / pp blocks.
Why the columns differ from the course's (which prices Psi = the quoted count with Korthikanti's
34 + 5 a s / h): see WHY.
"""

from __future__ import annotations

import dataclasses
import math

from emulator.config import n_params, param_shapes
from emulator.flops import activation_bytes_per_block
from parallel.data import cost as dpcost
from parallel.data.flat import fsdp_units, make_buckets
from parallel.pipeline.executor import split_layers, stage_param_names
from parallel.tensor.block import megatron_plan
from parallel.tensor.cost import block_activation_bytes
from parallel.tensor.shard import local_shape

WHY = (
    (
        "params: this model's block has 2 FFN matrices (Llama's SwiGLU has 3), full H x H K and V "
        "(no GQA), LayerNorm gains and biases, learned positions and an untied head"
    ),
    (
        "activ: this block keeps 16 s b h + 4 s b F bytes (32 s b h at F = 4 h: Korthikanti's 34 "
        "less the 2 s b h of dropout masks; this model has no dropout) and a 2-byte softmax, 2 a s^2 "
        "b (his 5 adds the 1-byte mask and the dropout output), plus 8 s b of fp32 LN statistics"
    ),
    (
        "state: flat buffers padded to a multiple of dp; ZeRO-2 holds one full gradient bucket in "
        "flight, ZeRO-3 the root unit (embeddings + head) and one block gathered"
    ),
)


def rank_shapes(cfg, tp: int, pp: int, stage: int) -> dict:
    """{name: local shape} of tensor rank 0 of pipeline stage ``stage``."""
    plan, shapes = megatron_plan(cfg), param_shapes(cfg)
    names = stage_param_names(cfg, split_layers(cfg.n_layers, pp), stage, pp)
    return {n: local_shape(shapes[n], plan[n], tp, n) if tp > 1 else shapes[n] for n in names}


def state_bytes(cfg, shapes: dict, dp: int, zero: int, b: int, S: int, **fsdp) -> int:
    """Peak params + grads and static optimizer bytes of one dp rank over these shapes."""
    stage = "ddp" if zero == 0 else str(zero)
    if zero == 3:
        layouts = fsdp_units(shapes, dp)
    else:
        layouts = make_buckets(shapes, dp, 25.0, 2)
    n = sum(math.prod(s) for s in shapes.values())
    peak = dpcost.peak_memory(stage, layouts, n, cfg, b, S, **fsdp)  # reshard / prefetch
    static = dpcost.static_memory(stage, layouts, n, cfg.dtype)
    return peak["params"] + peak["grads"] + static["optimizer"]


def activation_bytes(cfg, b: int, S: int, tp: int, recompute: str, pp: int = 1) -> int:
    """L blocks' caches; with pp stages under 1F1B (m = pp micro-batches) the worst stage s
    holds min(pp - s, m) micro-batches of its blocks (uneven splits: 126 layers on 16 stages
    are 8 x 14 + 7 x 2, so stage 0 holds 16 x 8 = 128 block caches, not 126)."""
    n = max(len(blk) * (pp - s) for s, blk in enumerate(split_layers(cfg.n_layers, pp)))
    if tp == 1:
        return n * activation_bytes_per_block(cfg, b, S, recompute)
    if recompute == "full":
        return n * 2 * b * S * cfg.d_model // tp
    return n * block_activation_bytes(cfg, b, S, tp, sp=True, recompute=recompute)


@dataclasses.dataclass(frozen=True)
class Exact:
    params: int  # this model's parameter count (all ranks together)
    state: int  # bytes per GPU, worst stage
    activ: int


def price(preset, row, seq: int, b: int, **fsdp) -> Exact:
    """``fsdp``: ZeRO-3's reshard_after_forward / prefetch (parallel.data.cost.peak_memory)."""
    cfg = preset.model_config(seq)
    states = [state_bytes(cfg, rank_shapes(cfg, row.tp, row.pp, s), row.dp, row.zero, b, seq,
                          **fsdp) for s in {0, row.pp - 1}]  # fmt: skip
    return Exact(
        n_params(cfg), max(states), activation_bytes(cfg, b, seq, row.tp, row.recompute, row.pp)
    )


@dataclasses.dataclass(frozen=True)
class Dry:
    state: int  # bytes per GPU: the worst representative's params + grads + optimizer peaks
    activ: int  # its activations peak
    seconds: float  # wall time of the dry run
    differences: list  # where a representative's figures differ from nd_cost's (empty: equal)
    ranks: int  # representatives run


def nd_layout(row):
    """The row's layout as parallel.train runs it: mixed precision, 1F1B with m = pp
    micro-batches (the course's in-flight count), sequence parallelism whenever tp > 1 (the
    course's 60.6 GiB row assumes it)."""
    from parallel.layout import Layout

    return Layout(dp=row.dp, tp=row.tp, pp=row.pp, zero=row.zero, microbatches=max(1, row.pp),
                  sequence_parallel=row.tp > 1, recompute=row.recompute, dtype="mixed")  # fmt: skip


def dry_figures(preset, row, seq: int, b: int, workers: int = 2):
    """Dry-run the row's layout through parallel.train (planning/nd_dryrun.py, one rank per
    pipeline stage) -> Dry, each representative checked against parallel/nd_cost.py's closed
    forms (planning/nd_report.check_all); None when parallel.train cannot run the layout (its
    reason: Layout.problems, e.g. full recompute with tp)."""
    import time

    from planning.nd_dryrun import dry_nd
    from planning.nd_report import check_all

    lay, cfg = nd_layout(row), preset.model_config(seq)
    B = row.dp * b * lay.microbatches
    if lay.problems(lay.world, cfg, (B, seq)):
        return None
    t0 = time.perf_counter()
    runs = dry_nd(cfg, lay, B, seq, workers=workers)
    peaks = [v["figures"]["run_memory"]["peak"] for v in runs.values()]
    state = max(sum(pk[c] for c in ("params", "grads", "optimizer")) for pk in peaks)
    act = max(pk["activations"] for pk in peaks)
    bad = [f"rank {r}: {d}" for r, ds in check_all(cfg, lay, B, seq, runs).items() for d in ds]
    return Dry(state, act, time.perf_counter() - t0, bad, len(runs))


ZERO_UNITS = {
    2: "parallel.train's ZeRO-2 reduce-scatters one layer at a time, so its transient full "
    "gradient is the largest layer's (the embedding or the head), not one 25 MiB bucket",
    3: "parallel.train's ZeRO-3 gathers one layer at a time (the largest, resharded after "
    "use), not the root unit (embeddings + head) and a block together",
}


def dry_notes(rows, ex, drys) -> list:
    """One line per figure where the dry run (= nd_cost) differs from the 'model' column, with
    the difference in bytes and its reason."""
    out = []
    for r, e, d in zip(rows, ex, drys):
        if d is None:
            continue
        if d.activ != e.activ:
            why = ("the embedding's token ids and, during a backward, one block's recomputed "
                   "cache (the head's freed first)" if r.recompute == "full" else
                   "the embedding's token ids (stage 0, per micro-batch in flight) and the head's "
                   "cache (final LN, logits: the last stage) beside the blocks")  # fmt: skip
            out.append(f"dry act - model = {d.activ - e.activ:+,} bytes ({r.name}): {why}")
        if d.state != e.state:
            why = ZERO_UNITS.get(r.zero, "the layout's buffers")
            out.append(f"dry st - model = {d.state - e.state:+,} bytes ({r.name}): {why}")
        out += [f"DIFFERENT from nd_cost ({r.name}): {x}" for x in d.differences]
    return out


def format_table(preset, rows, seq: int, b: int, gpu_gib: float, dry: bool = False) -> str:
    from planning.memory import GIB

    cfg = preset.model_config(seq)
    ex = [price(preset, r, seq, b) for r in rows]
    drys = [dry_figures(preset, r, seq, b) if dry else None for r in rows]
    head = f"{'strategy':<32}{'state':>9}{'model':>9}{'activ':>9}{'model':>9}{'total':>9}  fits?"
    if dry:
        head += f"{'dry st':>9}{'dry act':>9}  = nd_cost{'secs':>6}"
    lines = [
        (
            f"this model: the spec's GPT block at {preset.name}'s shape, {ex[0].params / 1e9:.2f}B "
            f"params (published {preset.params / 1e9:.1f}B), mixed precision, exact"
        ),
        "",
        head,
        "-" * len(head),
    ]
    for r, e, d in zip(rows, ex, drys):
        total = e.state + e.activ + r.reserve
        line = (f"{r.name:<32}{r.state / GIB:9.1f}{e.state / GIB:9.1f}{r.activ / GIB:9.1f}"
                f"{e.activ / GIB:9.1f}{total / GIB:9.1f}  {'YES' if total <= gpu_gib * GIB else 'NO':<5}")  # fmt: skip
        if dry and d is None:
            line += f"{'n/a':>9}{'n/a':>9}"
        elif dry:
            same = "equal" if not d.differences else "DIFFERENT"
            line += f"{d.state / GIB:9.1f}{d.activ / GIB:9.1f}  {same:<9}{d.seconds:6.1f}"
        lines.append(line.rstrip())
    lines.append("-" * len(head))
    lines.append(f"per block: {activation_bytes_per_block(cfg, b, seq) / GIB:.3f} GiB this model "
                 f"vs {seq * b * cfg.d_model * (34 + 5 * cfg.n_heads * seq / cfg.d_model) / GIB:.3f}"
                 " GiB Korthikanti (recompute none, tp 1)")  # fmt: skip
    if dry:
        lines.append("dry st / dry act: the memory ledger's peaks from running the layout through "
                     "parallel.train on shape-only arrays (worst representative rank: one per "
                     "pipeline stage); = nd_cost: every representative's bytes per axis and memory "
                     "peaks equal parallel/nd_cost.py's closed forms; tp > 1 with SP, 1F1B with "
                     "m = pp micro-batches")  # fmt: skip
        lines += dry_notes(rows, ex, drys)
    lines += [f"why: {w}" for w in WHY]
    return "\n".join(lines)
