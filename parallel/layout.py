"""A training layout as data: the degree of every axis and the features, validated before
anything runs, and the device mesh it lays over the ranks.

    layout = Layout(dp=2, pp=2, tp=2, zero=3, sequence_parallel=True, microbatches=4)
    layout.validate(world_size=8, cfg=cfg, batch=(B, S))   # ONE ValueError naming every problem
    mesh = layout.mesh(comm)                                  # Mesh(dp, pp, cp, tp)

Mesh axis order (outermost first) dp, pp, cp, tp: row-major, so tp varies fastest and a tp group
is a block of neighbouring global ranks (one node's NVLink domain), then cp, then pp, then dp -
Megatron-LM's and Llama 3's order [TP, CP, PP, DP] innermost-first (Dubey et al. 2024, "The
Llama 3 Herd of Models", section 3.3.2): the axis with the most traffic per step (TP: four
all-reduces of the hidden state per block) gets the fastest links, DP (one reduction per step,
overlapped) the slowest. `cp` (issue 13, context parallelism): every sequence split over the cp
ranks (`cp_balance` contiguous or zigzag), attention by `cp_method` (ring, all-gather, ulysses;
parallel/context/); with sequence_parallel each tp rank holds S/(cp t) of the cp rank's
positions (parallel/context/layout.sp_table). `ep` (issue 12, expert
parallelism): ep > 1 splits dp into edp x ep, ep inner (parallel/expert/nd.py).
"""

from __future__ import annotations

import dataclasses

from emulator.mesh import Mesh
from parallel.context.attention import METHODS
from parallel.context.layout import BALANCES
from parallel.context.layout import check as check_split
from parallel.context.layout import check_sp as check_cp_sp
from parallel.pipeline.schedules import SCHEDULES, make_schedule
from parallel.pipeline.schedules import validate as validate_schedule

AXES = ("dp", "pp", "cp", "tp")  # mesh order, outermost first (tp innermost: neighbours)
DTYPES = ("float64", "float32", "mixed")
RECOMPUTES = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1  # context parallelism: issue 13 (parallel/context/)
    cp_method: str = "ring"  # cp attention: "ring" | "all-gather" | "ulysses"
    cp_balance: str = "zigzag"  # cp sequence split: "zigzag" | "contiguous"
    ep: int = 1  # expert parallelism: issue 12
    dispatch: str = "exact"  # ep > 1: "exact" (all-to-all-v of kept rows) or "padded" (to C)
    zero: int = 0  # on the dp axis: 0 = DDP (replicated optimizer), 1/2/3 = ZeRO stage
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per pipeline stage (interleaved)
    microbatches: int = 1  # per dp rank and step: gradient accumulation = pipeline micro-batches
    recompute: str = "none"
    dtype: str = "float64"
    reshard_after_forward: bool = True  # ZeRO-3
    prefetch: bool = False  # ZeRO-3
    regather: bool = (
        True  # SP: re-gather the S/t inputs in the backward (Korthikanti section 4.2.2)
    )
    bucket_cap_mb: float = 25.0  # DDP / ZeRO-1 buckets

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.chunks

    def __str__(self) -> str:
        d = dataclasses.asdict(self)
        axes = " x ".join(f"{a}{d[a]}" for a in ("dp", "pp", "cp", "tp", "ep") if d[a] > 1)
        rest = [f"zero={self.zero}"] + [
            f"{k}={v}" for k, v in d.items() if k not in (*AXES, "ep", "zero")
            and v != getattr(Layout, k)
        ]  # fmt: skip
        return f"Layout({axes or 'single rank'} = {self.world} ranks; {', '.join(rest)})"

    def problems(self, world_size=None, cfg=None, batch=None) -> list[str]:
        """Every reason this layout cannot run (empty: it can). batch: (B, S) or B."""
        bad = []
        for k in ("dp", "pp", "tp", "cp", "ep", "chunks", "microbatches"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad.append(f"{k}={v!r} must be an int >= 1")
        if bad:
            return bad
        if world_size is not None and self.world != world_size:
            bad.append(f"dp*pp*cp*tp = {self.dp}*{self.pp}*{self.cp}*{self.tp} = {self.world} "
                       f"but the world has {world_size} ranks; {_fits(self, world_size)}")  # fmt: skip
        bad += self._cp_problems()
        if self.ep > 1:
            bad += self._ep_problems()
        if self.dispatch not in ("exact", "padded"):
            bad.append(f"dispatch={self.dispatch!r}: choose 'exact' or 'padded'")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            bad.append(f"zero={self.zero!r}: choose 0 (DDP), 1, 2 or 3")
        if self.dtype not in DTYPES:
            bad.append(f"dtype={self.dtype!r}: choose one of {DTYPES}")
        if self.recompute not in RECOMPUTES:
            bad.append(f"recompute={self.recompute!r}: choose one of {RECOMPUTES}")
        elif self.recompute == "full" and (self.tp > 1 or self.schedule == "zb-h1"):
            why = "the tensor-parallel block" if self.tp > 1 else "zb-h1's B/W split"
            bad.append(f"recompute='full' is not supported with {why} (it keeps only the "
                       f"block input); use 'none' or 'selective'")  # fmt: skip
        if self.sequence_parallel and self.tp == 1:
            bad.append("sequence_parallel=True needs tp > 1: it cuts the sequence over the tp "
                       "group")  # fmt: skip
        if self.schedule not in SCHEDULES:
            bad.append(f"schedule={self.schedule!r}: choose one of {SCHEDULES}")
        else:
            try:
                validate_schedule(make_schedule(self.schedule, self.pp, self.microbatches,
                                                self.chunks))  # fmt: skip
            except ValueError as e:
                bad.append(f"schedule {self.schedule!r} with pp={self.pp}, microbatches="
                           f"{self.microbatches}, chunks={self.chunks}: {e}")  # fmt: skip
        if self.zero == 3 and self.schedule == "zb-h1":
            bad.append("zero=3 with zb-h1: FSDP frees a unit after its backward, but the B/W "
                       "split defers the weight gradients past it; use zero <= 2 or another "
                       "schedule")  # fmt: skip
        if self.tp > 1 and self.schedule == "zb-h1":
            bad.append("tp > 1 with zb-h1: the B/W split (parallel/pipeline/zero_bubble.py) "
                       "exists for the single-rank block only; use gpipe, 1f1b or interleaved")  # fmt: skip
        if cfg is not None:
            bad += self._model_problems(cfg, batch)
        return bad

    def _ep_problems(self) -> list[str]:
        """ep > 1 (parallel/expert/nd.py): the ep group is drawn from the dp ranks (at the same
        cp coordinate); DDP or ZeRO-1/2/3 on both parts, any cp."""
        bad = []
        if self.dp % self.ep:
            bad.append(f"ep={self.ep} must divide dp={self.dp}: the ep group is drawn from the "
                       f"data-parallel ranks (Megatron-core, DeepSpeed-MoE); ep could be one of "
                       f"{[d for d in range(1, self.dp + 1) if self.dp % d == 0]}")  # fmt: skip
        if self.schedule == "zb-h1":
            bad.append("ep > 1 with zb-h1: the B/W split (parallel/pipeline/zero_bubble.py) uses "
                       "the single-rank MoE block; use gpipe, 1f1b or interleaved")  # fmt: skip
        return bad

    def _model_problems(self, cfg, batch) -> list[str]:
        bad = []
        if self.ep > 1 and not cfg.is_moe:
            bad.append(f"ep={self.ep} needs an MoE model (n_experts > 0): a dense model has no "
                       f"experts to split")  # fmt: skip
        elif self.ep > 1 and cfg.n_experts % self.ep:
            divs = [d for d in range(1, cfg.n_experts + 1) if cfg.n_experts % d == 0]
            bad.append(f"ep={self.ep} does not divide n_experts={cfg.n_experts} (each rank holds "
                       f"E/ep whole experts); ep could be one of {divs}")  # fmt: skip
        t = self.tp
        for what, n in (("n_heads", cfg.n_heads), ("vocab_size", cfg.vocab_size),
                        ("d_ff", cfg.d_ff), ("d_model", cfg.d_model)):  # fmt: skip
            if n % t:
                divs = [d for d in range(1, n + 1) if n % d == 0]
                bad.append(f"tp={t} does not divide {what}={n} (Megatron cuts it into equal "
                           f"parts); tp could be one of {divs}")  # fmt: skip
        if self.cp > 1 and self.cp_method == "ulysses" and (cfg.n_heads // t) % self.cp:
            bad.append(f"cp_method='ulysses': n_heads={cfg.n_heads // t} is not divisible by "
                       f"cp={self.cp} (the heads per tp rank: n_heads={cfg.n_heads} / tp={t}); "
                       f"every cp rank takes whole heads: use cp dividing {cfg.n_heads // t}, or "
                       f"'ring' / 'all-gather'")  # fmt: skip
        if cfg.n_layers < self.virtual_stages:
            bad.append(f"pp*chunks = {self.pp}*{self.chunks} = {self.virtual_stages} virtual "
                       f"stages but the model has only {cfg.n_layers} blocks; every stage needs "
                       f"one: pp*chunks <= {cfg.n_layers}")  # fmt: skip
        if batch is None:
            return bad
        B, S = batch if isinstance(batch, tuple) else (batch, None)
        per = self.dp * self.microbatches
        if B % per:
            fits = [m for m in range(1, B + 1) if B % (self.dp * m) == 0]
            bad.append(f"batch B={B} is not divisible by dp*microbatches = {self.dp}*"
                       f"{self.microbatches} = {per}; microbatches could be one of {fits}"
                       if fits else f"batch B={B} is not divisible by dp={self.dp}")  # fmt: skip
        if S is not None and self.cp > 1 and self.cp_balance in BALANCES:
            try:  # S into cp (zigzag: 2 cp) chunks; with SP each cp rank's S/cp into t slices
                if self.sequence_parallel and t > 1:  # one error naming both conditions
                    check_cp_sp(S, self.cp, t, self.cp_balance)
                else:
                    check_split(S, self.cp, self.cp_balance)
            except ValueError as e:
                bad.append(str(e))
        elif S is not None and self.sequence_parallel and S % t:
            bad.append(f"sequence_parallel: S={S} is not divisible by tp={t}; use a sequence "
                       f"length that is a multiple of {t}")  # fmt: skip
        return bad

    def _cp_problems(self) -> list[str]:
        """Context parallelism's own checks (the sequence length is checked with the batch)."""
        bad = []
        if self.cp_method not in METHODS:
            bad.append(f"cp_method={self.cp_method!r}: choose one of {METHODS}")
        if self.cp_balance not in BALANCES:
            bad.append(f"cp_balance={self.cp_balance!r}: choose one of {BALANCES}")
        if self.cp > 1 and self.schedule == "zb-h1":
            bad.append("cp > 1 with zb-h1: the B/W split (parallel/pipeline/zero_bubble.py) "
                       "runs emulator's own attention; use gpipe, 1f1b or interleaved")  # fmt: skip
        return bad

    def validate(self, world_size=None, cfg=None, batch=None) -> Layout:
        """Raise ONE ValueError listing every problem (see `problems`); return self."""
        bad = self.problems(world_size, cfg, batch)
        if bad:
            raise ValueError(f"{self} cannot run:\n  - " + "\n  - ".join(bad))
        return self

    def mesh(self, comm) -> Mesh:
        """The Mesh dp x pp x cp x tp over comm's ranks; every group is created here, in one
        order on every rank (group creation is a collective call)."""
        mesh = Mesh(comm, **{a: getattr(self, a) for a in AXES})
        for a in AXES:
            mesh.group(a)
        return mesh


def _fits(layout: Layout, world: int) -> str:
    """What would fit: the dp that fills the world with the other degrees, else divisors."""
    rest = layout.pp * layout.cp * layout.tp
    if world % rest == 0:
        return f"dp={world // rest} would fit with pp={layout.pp}, cp={layout.cp}, tp={layout.tp}"
    return f"pp*cp*tp={rest} must divide {world}; e.g. tp, pp from the divisors of {world}"


_TEXT: dict = {}  # (axis names, degrees) -> Mesh.describe()


def mesh_text(mesh: Mesh) -> str:
    """``mesh.describe()``, kept per (axis names, degrees): the text reads nothing else (its
    groups are those of arange(world) in that shape, the same on every rank), so the ranks of a
    run, and later runs of the same mesh, share one string instead of each building it again
    (34 us a rank for a 4-axis mesh of 4 ranks)."""
    key = (mesh.names, mesh.shape)
    text = _TEXT.get(key)
    if text is None:  # two ranks racing here build the same string
        text = _TEXT[key] = mesh.describe()
    return text
