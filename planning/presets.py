"""Published model shapes for the planners and the dry run.

Each preset carries the shape its paper publishes (layers, d_model, heads, key/value heads,
FFN width, vocabulary, training sequence length) and the parameter count the paper quotes.
The planners' analytic figures use the quoted count Psi (as the ZeRO and Megatron formulas do);
the "this model" column uses this project's GPT block at the same shape (emulator.config), whose
exact count differs - it has no SwiGLU (2 FFN matrices, not 3), no GQA (K and V are H x H) and
LayerNorm biases - so both are printed and neither is forced to agree with the other.
"""

from __future__ import annotations

import dataclasses

from emulator.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    params: float  # the paper's quoted parameter count (Psi of the analytic formulas)
    layers: int  # L
    d_model: int  # h
    heads: int  # a (query heads)
    kv_heads: int  # key/value heads (GQA when < heads)
    d_ff: int  # FFN inner width (SwiGLU's for Llama)
    vocab: int  # V
    seq: int  # the training context length
    source: str  # where the shape is published

    def model_config(self, seq: int | None = None, dtype: str = "mixed") -> ModelConfig:
        """This project's model at the preset's shape (allocates nothing)."""
        return ModelConfig(vocab_size=self.vocab, max_seq_len=seq or self.seq,
                           d_model=self.d_model, n_heads=self.heads, n_layers=self.layers,
                           d_ff=self.d_ff, dtype=dtype)  # fmt: skip


PRESETS = {
    p.name: p
    for p in (
        # Brown et al. 2020 (arXiv:2005.14165) Table 2.1: 96 layers, d 12288, 96 heads, ctx 2048;
        # d_ff = 4 d; GPT-2's BPE vocabulary of 50257
        Preset("gpt3-175b", 175e9, 96, 12288, 96, 96, 49152, 50257, 2048, "arXiv:2005.14165"),
        # Touvron et al. 2023 (arXiv:2307.09288) Table 1 / the released configs: ctx 4096,
        # vocabulary 32000; GQA (8 KV heads) only in 70B
        Preset("llama2-7b", 7e9, 32, 4096, 32, 32, 11008, 32000, 4096, "arXiv:2307.09288"),
        Preset("llama2-13b", 13e9, 40, 5120, 40, 40, 13824, 32000, 4096, "arXiv:2307.09288"),
        Preset("llama2-70b", 70e9, 80, 8192, 64, 8, 28672, 32000, 4096, "arXiv:2307.09288"),
        # Llama Team 2024 (arXiv:2407.21783) Table 3: 8 KV heads throughout, vocabulary 128000
        # (128256 in the released tokenizer), pre-training ctx 8192
        Preset("llama3-8b", 8e9, 32, 4096, 32, 8, 14336, 128256, 8192, "arXiv:2407.21783"),
        Preset("llama3-70b", 70e9, 80, 8192, 64, 8, 28672, 128256, 8192, "arXiv:2407.21783"),
        Preset("llama3-405b", 405e9, 126, 16384, 128, 8, 53248, 128256, 8192, "arXiv:2407.21783"),
    )
}


def get(name: str) -> Preset:
    """The preset called ``name``; an unknown name names the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def format_presets() -> str:
    head = f"{'preset':<13}{'params':>8}{'L':>5}{'h':>7}{'heads':>7}{'kv':>4}{'d_ff':>7}"
    head += f"{'vocab':>8}{'seq':>6}  source"
    lines = [head, "-" * len(head)]
    for p in PRESETS.values():
        lines.append(
            f"{p.name:<13}{p.params / 1e9:>7.0f}B{p.layers:>5}{p.d_model:>7}{p.heads:>7}"
            f"{p.kv_heads:>4}{p.d_ff:>7}{p.vocab:>8}{p.seq:>6}  {p.source}"
        )
    return "\n".join(lines)
