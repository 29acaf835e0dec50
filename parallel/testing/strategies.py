"""Hypothesis strategies for property-testing your own sharding against the emulator.

    from hypothesis import given
    from parallel.testing import strategies as dst

    @given(dst.lengths_and_parts())          # (n, p): p ranks over n elements, uneven too
    def test_my_split(np_):
        n, p = np_
        ...

Every strategy draws small sizes, so a property runs on virtual ranks in milliseconds:
- `world_sizes`, `meshes(max_ranks, axes)`: a world size, a {axis: degree} dict for `Mesh`;
- `lengths_and_parts`: n elements over p parts, with the edge cases p > n, n = 0, n = 1 and
  p not dividing n drawn on purpose (they are where chunking rules break);
- `model_configs`: small dense or MoE `ModelConfig`s that every layout can split
  (`divisible_by` keeps heads, vocabulary and d_ff divisible by a tensor-parallel degree);
- `batches(cfg)`: (tokens, targets) for a config; `routing_groups(n)`: a partition of n token
  indices into MoE routing groups;
- `schedules(p, m)`: a pipeline schedule, either built-in or a random valid action list.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from emulator.model import ModelConfig
from parallel.pipeline.schedules import Action, Schedule, depends_on, make_schedule, validate


def world_sizes(min_ranks: int = 1, max_ranks: int = 8) -> st.SearchStrategy[int]:
    return st.integers(min_ranks, max_ranks)


def _factorisations(n: int, k: int) -> list[tuple[int, ...]]:
    """Every ordered k-tuple of positive integers whose product is n."""
    if k == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorisations(n // d, k - 1)]  # fmt: skip


@st.composite
def meshes(draw, max_ranks: int = 8, axes=("dp", "tp"), world_size: int | None = None):
    """{axis: degree}, the degrees' product a world size <= max_ranks (or exactly world_size):
    pass it as `Mesh(comm, **dims)`."""
    if not axes:
        raise ValueError("meshes: give at least one axis name")
    n = world_size if world_size is not None else draw(world_sizes(1, max_ranks))
    return dict(zip(axes, draw(st.sampled_from(_factorisations(n, len(axes))))))


@st.composite
def lengths_and_parts(draw, max_parts: int = 8, max_length: int = 40):
    """(n, p) with 0 <= n <= max_length and 1 <= p <= max_parts; a third of the draws are the
    edge cases: n = 0, n = 1, p > n, and n = k p + r with 0 < r < p."""
    p = draw(st.integers(1, max_parts))
    edge = draw(st.sampled_from(["any", "any", "zero", "one", "fewer", "remainder"]))
    if edge == "zero":
        return 0, p
    if edge == "one":
        return 1, p
    if edge == "fewer" and p > 1:
        return draw(st.integers(0, p - 1)), p
    if edge == "remainder" and p > 1:
        k = draw(st.integers(0, max(0, (max_length - p + 1) // p)))
        return k * p + draw(st.integers(1, p - 1)), p
    return draw(st.integers(0, max_length)), p


@st.composite
def model_configs(draw, *, moe: bool | None = None, divisible_by: int = 1, max_layers: int = 3,
                  dtype: str = "float64"):  # fmt: skip
    """A small ModelConfig (dense, MoE, or either when moe is None). `divisible_by` = t keeps
    n_heads, vocab_size and d_ff multiples of t (a tensor-parallel degree t can split it)."""
    t = divisible_by
    heads = t * draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([2, 4]))
    is_moe = draw(st.booleans()) if moe is None else moe
    kw = {}
    if is_moe:
        E = draw(st.integers(2, 4))
        kw = {"n_experts": E, "moe_top_k": draw(st.integers(1, E)),
              "capacity_factor": draw(st.sampled_from([0.5, 1.0, 1.25, 2.0]))}  # fmt: skip
    return ModelConfig(
        vocab_size=t * draw(st.integers(3, 8)),
        max_seq_len=draw(st.integers(4, 8)),
        d_model=heads * head_dim,
        n_heads=heads,
        n_layers=draw(st.integers(1, max_layers)),
        d_ff=t * draw(st.integers(1, 4)) * 2,
        dtype=dtype,
        **kw,
    )


@st.composite
def batches(draw, cfg: ModelConfig, batch_multiple: int = 1, max_batch: int = 4):
    """(tokens, targets), int64 (B, S) with B a multiple of batch_multiple, S <= max_seq_len."""
    B = batch_multiple * draw(st.integers(1, max_batch))
    S = draw(st.integers(1, cfg.max_seq_len))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (B, S)), rng.integers(0, cfg.vocab_size, (B, S)))


@st.composite
def routing_groups(draw, n_tokens: int, max_groups: int = 4):
    """A partition of the flat token indices 0..n_tokens-1 into non-empty routing groups, each
    in its drawn order (the order the MoE block fills capacity slots in)."""
    if n_tokens < 1:
        raise ValueError("routing_groups: need at least one token")
    perm = draw(st.permutations(range(n_tokens)))
    g = draw(st.integers(1, min(max_groups, n_tokens)))
    cuts = sorted(draw(st.sets(st.integers(1, n_tokens - 1), min_size=g - 1, max_size=g - 1))) if g > 1 else []  # fmt: skip
    bounds = [0, *cuts, n_tokens]
    return [np.array(perm[a:b], dtype=np.int64) for a, b in itertools.pairwise(bounds)]


@st.composite
def random_schedule(draw, p: int, m: int, v: int = 1, split: bool = False):
    """A random valid schedule: a random topological order of every stage's actions (F, B and
    W when split) under the pipeline's dependencies, cut into per-stage lists. Any such order
    runs without deadlock on the eager-send executor; `validate` checks it anyway."""
    sched = Schedule(f"random-p{p}-m{m}-v{v}", p, m, v, split, [[] for _ in range(p)])
    kinds = "FBW" if split else "FB"
    todo = {
        (s, Action(k, j, c)) for s in range(p) for k in kinds for j in range(m) for c in range(v)
    }
    done: set = set()
    while todo:
        ready = sorted(
            x for x in todo if all((ds, d) in done for ds, d, _ in depends_on(sched, *x))
        )
        s, a = ready[draw(st.integers(0, len(ready) - 1))]
        sched.stages[s].append(a)
        todo.remove((s, a))
        done.add((s, a))
    return validate(sched)


@st.composite
def schedules(draw, p: int, m: int, *, names=("gpipe", "1f1b", "zb-h1", "interleaved"),
              random: bool = True):  # fmt: skip
    """A built-in schedule (interleaved with v = 2 when p*2 stages fit) or a random valid one."""
    options = [n for n in names if n != "interleaved" or m % p == 0]
    if random:
        options.append("random")
    name = draw(st.sampled_from(options))
    if name == "random":
        return draw(random_schedule(p, m, split=draw(st.booleans())))
    return make_schedule(name, p, m, 2 if name == "interleaved" else 1)
