"""The intra-layer parallel context: which function computes each layer on this rank.

Every model driver (parallel/pipeline/executor.py, which runs every layout: no pipeline is one
stage) calls a layer only through a LayerContext, so the layer's own parallelism is one object:

    ctx = LayerContext()                      # single rank: emulator's functions, bitwise
    ctx = LayerContext(tp=mesh["tp"], sp=True)  # Megatron TP (+ SP): parallel/tensor/ blocks
    x, cache = ctx.block_forward(bp, x, cfg, recompute=..., groups=..., mem=..., name=...)
    dx, dbp = ctx.block_backward(dx, cache, daux)

tp=None (or a group of 1) is exactly the single-rank pieces (emulator.model / emulator.block),
so a dp-only or pp-only layout computes bitwise what reference_train computes for the same
micro-batch. With tp the blocks are parallel/tensor/block.py's: the same ops plus Megatron's
named f / g (enter / leave) at the call sites, the vocab-parallel embedding and head.
Every collective of a layer runs under the scope "tp/<layer>/mb<j>/<fwd|bwd>" (tp_train keeps
its historical "<layer>/mb<j>/<fwd|bwd>", tag="").

Context parallelism (issue 13): ``cp`` is the cp group and ``positions`` the (C, S_local) table
of every cp rank's global positions (parallel/context/layout.table, set per step by
``set_positions``): the embedding takes the position rows of this rank's positions (under SP
the rows of its tp slice of them, parallel/context/layout.sp_table), attention is cp_attention on
the cp group (under tp on this rank's heads; under SP on the gathered S_local tokens), everything
else runs on the local tokens unchanged. `ep` (expert-parallel MoE, issue 12): with parallel/expert/nd.py's moe_pair, on the
single-rank and the TP block. The drop-ins (parallel/context/, parallel/expert/) plug in as ``attention=(forward,
backward)`` and ``moe=(forward, backward)``: passed to the blocks as emulator/block.py's
``attention=`` and ``moe_fn=`` pairs (emulator's signatures; bind the group and extra arguments
with functools.partial; parallel/context/ and parallel/expert/ build such pairs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

from emulator import scope
from emulator.model import (
    block_backward,
    block_forward,
    embed_backward,
    embed_forward,
    head_backward,
    head_forward,
)
from parallel.check.routing import decisions
from parallel.context.attention import cp_attention_backward, cp_attention_forward
from parallel.pipeline.zero_bubble import block_backward_b, block_backward_w
from parallel.tensor.block import tp_block_backward, tp_block_forward
from parallel.tensor.vocab import (
    vocab_embedding_backward,
    vocab_embedding_forward,
    vocab_head_backward,
    vocab_head_forward,
)


@dataclasses.dataclass
class LayerContext:
    tp: object = None  # the tp group (a Comm) or None
    sp: bool = False  # sequence parallelism between the TP regions
    regather: bool = True  # SP: keep S/t slices, all-gather them again in the backward
    cp: object = None  # the context-parallel group (issue 13) or None
    ep: object = None  # the expert-parallel group (issue 12): with moe = parallel/expert/nd.py's
    # moe_pair, whose forward takes the block's cache name as ``where=`` (its ledger tag)
    tag: str = "tp/"  # ledger scope prefix of the tp traffic ("" keeps tp_train's tags)
    # drop-ins for the two layers other axes cut (None = emulator.ops / emulator.moe): a pair
    # (forward, backward) with emulator's signatures, on this rank's local tensors
    attention: tuple | None = None  # (attention_forward, attention_backward): cp, issue 13
    moe: tuple | None = None  # (moe_forward, moe_backward): ep, issue 12 (single-rank block)
    cp_method: str = "ring"  # cp attention: parallel/context/attention.METHODS
    positions: object = None  # cp: the (C, S_local) table of every cp rank's global positions
    act_bytes: dict | None = None  # a dict: each block's activation bytes after its forward

    def __post_init__(self):
        if self.tp is not None and self.tp.size == 1:
            self.tp, self.sp = None, False  # a group of one: the single-rank pieces (SP over
            # one rank cuts nothing; parallel.Layout refuses asking for it)
        if self.cp is not None and self.cp.size == 1:
            self.cp = None  # one cp rank holds the whole sequence: emulator's attention
        if self.ep is not None and self.ep.size > 1 and self.moe is None:
            raise ValueError("LayerContext: ep > 1 needs its MoE drop-in (parallel/expert/nd.py "
                             "moe_pair)")  # fmt: skip

    def set_positions(self, table) -> None:
        """cp: this step's (C, S_local) positions table; attention becomes cp_attention on the
        cp group with it (S may change between steps, so the table is set per step)."""
        if self.cp is None:
            return
        self.positions = table
        fwd = functools.partial(cp_attention_forward, self.cp, positions=table,
                                method=self.cp_method)  # fmt: skip
        self.attention = (fwd, cp_attention_backward)

    def local_positions(self):
        """The global positions of this rank's tokens (None: all of 0..S-1, in order)."""
        return None if self.cp is None else self.positions[self.cp.rank]

    @property
    def t(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def seq_local(self, S: int) -> int:
        """Sequence positions this rank holds between layers: S, or S/t under SP."""
        return S // self.t if self.sp else S

    def scope(self, layer: str, mb: int, phase: str):
        """The ledger tag of this layer's tp traffic (none without tp)."""
        if self.tp is None:
            return contextlib.nullcontext()
        return scope(f"{self.tag}{layer}/mb{mb}/{phase}")

    def decisions(self, cache):
        """An MoE block's routing decisions (parallel/check/routing.py) from its cache; None
        when the cache does not keep them (recompute="full")."""
        if self.tp is None:
            return decisions(cache["saved"]["moe"][0]) if "moe" in cache["saved"] else None
        return decisions(cache["moe"]["groups"])

    # ---- embedding and head: (B, S) ids -> (B, S_l, H) ... -> the CE sum / denom ------------
    def embed_forward(self, p, tokens):
        pos = self.local_positions()  # cp: the rows of this rank's global positions
        if self.tp is None:
            return embed_forward(p, tokens, pos)
        return vocab_embedding_forward(self.tp, tokens, p["embed.tok"], p["embed.pos"], sp=self.sp,
                                       positions=pos)  # fmt: skip

    def embed_backward(self, dx, cache) -> dict:
        if self.tp is None:
            return embed_backward(dx, cache)
        dtok, dpos = vocab_embedding_backward(self.tp, dx, cache)
        return {"embed.tok": dtok, "embed.pos": dpos}

    def head_forward(self, p, x, targets, cfg, *, denom):
        if self.tp is None:
            return head_forward(p, x, targets, cfg, denom=denom)
        return vocab_head_forward(self.tp, p, x, targets, cfg, sp=self.sp, denom=denom)

    def head_backward(self, dce, cache):
        if self.tp is None:
            return head_backward(dce, cache)
        return vocab_head_backward(self.tp, dce, cache)

    # ---- one transformer block ------------------------------------------------------------
    def block_forward(self, bp, x, cfg, *, recompute="none", groups=None, mem=None, name="block"):
        """x (B, S_l, H) -> (x_out, cache); the MoE aux loss is cache["aux"]."""
        out = self._block_forward(bp, x, cfg, recompute, groups, mem, name)
        if self.act_bytes is not None and mem is not None:
            self.act_bytes[name] = mem.nbytes("activations", name)
        return out

    def _block_forward(self, bp, x, cfg, recompute, groups, mem, name):
        if self.tp is None:
            kw = {"recompute": recompute, "groups": groups, "mem": mem, "name": name}
            moe = self.moe
            if self.ep is not None and moe is not None:  # ep drop-in: bind the block's name
                moe = (functools.partial(moe[0], where=name), moe[1])  # (its ledger tag)
            return block_forward(bp, x, cfg, attention=self.attention, moe_fn=moe, **kw)
        if recompute == "full":
            raise ValueError("tensor parallel blocks support recompute 'none' or 'selective'")
        if self.moe is not None and self.ep is None:
            raise ValueError("an MoE drop-in under tp > 1 needs its ep group (expert parallelism)")
        moe = None if self.moe is None else (functools.partial(self.moe[0], where=name),
                                             self.moe[1])  # fmt: skip
        return tp_block_forward(self.tp, bp, x, cfg, sp=self.sp, regather=self.regather,
                                keep_probs=recompute == "none", groups=groups, mem=mem,
                                name=name, attention=self.attention, moe=moe)  # fmt: skip

    def block_backward(self, dx, cache, daux):
        """-> (dx_in (B, S_l, H), {local name: grad} in bp's order)."""
        if self.tp is None:
            return block_backward(dx, cache, daux=daux)
        return tp_block_backward(self.tp, dx, cache, daux=daux)

    def block_backward_b(self, dx, cache, daux):
        """The B half of a split backward (zero-bubble schedules): single-rank blocks only."""
        if self.tp is not None:
            raise ValueError("the B/W split exists for the single-rank block only (tp = 1)")
        return block_backward_b(dx, cache, daux=daux)

    def block_backward_w(self, stash) -> dict:
        return block_backward_w(stash)


SINGLE = LayerContext()  # the single-rank context (pipeline_train, the reference's pieces)
