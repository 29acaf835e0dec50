"""Hypothesis strategies over the N-D program's layouts: valid ones by construction, and
invalid ones with the reason they must be refused.

    @given(dst.layouts(world=8, cfg=cfg, batch=(B, S)))
    def test_mine(layout):
        check_layout(layout, cfg, batch=B, seq=S)

Valid is built from the rules written here, not by asking `Layout.problems` (the code under
test): tp divides heads, vocabulary, d_ff and d_model; pp x chunks <= blocks; dp x micro-batches
divides the batch; sequence parallelism needs tp > 1 and tp dividing S; interleaving needs
chunks >= 2 and pp dividing the micro-batches; zb-h1 runs neither with ZeRO-3 nor with tp > 1;
full recompute runs neither with tp > 1 nor with zb-h1.
"""

from __future__ import annotations

from hypothesis import strategies as st

from parallel.layout import Layout
from parallel.testing.strategies import _factorisations


def _divides_model(t: int, cfg) -> bool:
    return all(n % t == 0 for n in (cfg.n_heads, cfg.vocab_size, cfg.d_ff, cfg.d_model))


@st.composite
def layouts(draw, world: int, cfg, batch: tuple[int, int], *, dtypes=("float64",)):
    """A Layout (dp x pp x tp = world, cp = ep = 1) that can train cfg on a (B, S) batch; the
    strategy fails (hypothesis reports it) when no factorisation of world fits the model."""
    B, S = batch
    shapes = [(d, p, t) for d, p, t in _factorisations(world, 3)
              if B % d == 0 and p <= cfg.n_layers and _divides_model(t, cfg)]  # fmt: skip
    if not shapes:
        raise ValueError(f"layouts: no dp x pp x tp = {world} fits {cfg} with batch {batch}")
    dp, pp, tp = draw(st.sampled_from(shapes))
    names = ["gpipe", "1f1b"]
    names += ["zb-h1"] if tp == 1 else []
    names += ["interleaved"] if pp > 1 and 2 * pp <= cfg.n_layers else []
    schedule = draw(st.sampled_from(names))
    fits = [m for m in range(1, B // dp + 1) if (B // dp) % m == 0]  # micro-batches per rank
    if schedule == "interleaved" and not [m for m in fits if m % pp == 0]:
        schedule = "1f1b"  # no micro-batch count that pp divides: interleaving cannot run
    if schedule == "interleaved":
        fits = [m for m in fits if m % pp == 0]
    m = draw(st.sampled_from(fits))
    chunks = 1
    if schedule == "interleaved":
        chunks = draw(st.sampled_from([v for v in (2, 3) if pp * v <= cfg.n_layers]))
    zero = draw(st.sampled_from([0, 1, 2] if schedule == "zb-h1" else [0, 1, 2, 3]))
    recompute = ["none", "selective"]
    recompute += ["full"] if tp == 1 and schedule != "zb-h1" else []
    return Layout(
        dp=dp, pp=pp, tp=tp, zero=zero, schedule=schedule, chunks=chunks, microbatches=m,
        sequence_parallel=tp > 1 and S % tp == 0 and draw(st.booleans()),
        recompute=draw(st.sampled_from(recompute)), dtype=draw(st.sampled_from(dtypes)),
        reshard_after_forward=draw(st.booleans()), prefetch=draw(st.booleans()),
    )  # fmt: skip


@st.composite
def invalid_layouts(draw, world: int, cfg, batch: tuple[int, int]):
    """(layout, fragment): a valid layout with one thing broken, and a few words the refusal
    must contain (the degree or feature it names)."""
    good = draw(layouts(world, cfg, batch))
    B = batch[0]
    kinds = ["world", "sp", "microbatches"]
    kinds += ["tp"] if any(cfg.n_heads % t for t in range(2, cfg.n_heads + 1)) else []
    kinds += ["zb-zero3"]
    kind = draw(st.sampled_from(kinds))
    if kind == "world":
        return Layout(**{**_fields(good), "dp": good.dp * 2}), "ranks"
    if kind == "sp":
        return Layout(**{**_fields(good), "tp": 1, "dp": good.dp * good.tp,
                         "sequence_parallel": True}), "sequence_parallel"  # fmt: skip
    if kind == "microbatches":
        bad = next(k for k in range(2, B + 2) if (B // good.dp) % k)
        return Layout(**{**_fields(good), "microbatches": bad, "schedule": "1f1b",
                         "chunks": 1}), "microbatches"  # fmt: skip
    if kind == "tp":
        t = next(t for t in range(2, cfg.n_heads + 1) if cfg.n_heads % t)
        return Layout(**{**_fields(good), "tp": t}), f"tp={t}"
    return Layout(**{**_fields(good), "zero": 3, "tp": 1, "dp": good.dp * good.tp,
                     "schedule": "zb-h1", "chunks": 1, "sequence_parallel": False}), "zb-h1"  # fmt: skip


def _fields(layout: Layout) -> dict:
    return {f: getattr(layout, f) for f in layout.__dataclass_fields__}
