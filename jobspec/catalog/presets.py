"""Built-in model presets: architectures built from config, never downloaded.

Pure Python (no torch, no transformers): the memory model and `jobspec plan` read the
shapes here; the runner turns the same numbers into a transformers config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Family = Literal["gpt2", "llama"]


@dataclass(frozen=True)
class ModelShape:
    """The numbers the memory model needs, and enough to build the model."""

    family: Family
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_positions: int
    intermediate: int  # MLP inner width (gpt2: 4 * hidden)
    kv_heads: int | None = None  # llama grouped-query attention; None = heads
    tie_embeddings: bool = True
    head_dim: int | None = None  # llama-style configs that name it (Qwen3, Gemma): q is heads x head_dim wide, which
    # need not be `hidden`; None = hidden // heads
    qk_norm: bool = False  # an RMSNorm on the queries and keys of every head (Qwen3, Gemma 3, OLMo 2)
    fused_projections: bool = False  # one linear layer for q, k and v and one for the MLP's gate and up (Phi-3):
    # the same parameters, other activations and LoRA target names
    residual_dropout: bool = False  # dropout on each block's two residual branches (GPT-2's resid_pdrop, 0.1 in its
    # configs; the presets train without)

    @property
    def q_width(self) -> int:
        """Width of the attention's queries (and of its output projection's input): heads x head_dim."""
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        """Width of the keys and of the values (grouped-query attention: fewer heads than the queries)."""
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)

    @property
    def params(self) -> int:
        """Parameter count, exact for the transformers GPT-2 and Llama implementations."""
        h, i, v, n = self.hidden, self.intermediate, self.vocab, self.layers
        if self.family == "gpt2":
            # per block: qkv (3h^2+3h) + proj (h^2+h) + mlp (2hi+i+h) + 2 layernorms (4h)
            block = 4 * h * h + 2 * h * i + 9 * h + i
            embed = v * h + self.max_positions * h
            return embed + n * block + 2 * h  # + final layernorm
        q, kv = self.q_width, self.kv_width
        # per block: q,o (2*h*q) + k,v (2*h*kv) + gate/up/down (3hi) + 2 RMSNorms (2h)
        block = 2 * h * q + 2 * h * kv + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_embeddings else 2)
        return embed + n * block + h


PRESETS: dict[str, ModelShape] = {
    # CPU-sized models for the quick start and the tests.
    "tiny": ModelShape("gpt2", layers=2, hidden=128, heads=4, vocab=512, max_positions=512, intermediate=512),
    "llama-tiny": ModelShape(
        "llama", layers=2, hidden=128, heads=4, kv_heads=2, vocab=512, max_positions=512, intermediate=352
    ),
    # The seeds' GPT-2 ladder (001): small 124M, medium 355M, large 774M.
    "gpt2-small": ModelShape(
        "gpt2", layers=12, hidden=768, heads=12, vocab=50257, max_positions=1024, intermediate=3072
    ),
    "gpt2-medium": ModelShape(
        "gpt2", layers=24, hidden=1024, heads=16, vocab=50257, max_positions=1024, intermediate=4096
    ),
    "gpt2-large": ModelShape(
        "gpt2", layers=36, hidden=1280, heads=20, vocab=50257, max_positions=1024, intermediate=5120
    ),
    # Qwen-shaped Llama configs (the seeds' 0.5B / 1.8B chat models), untied output head for 1.8B.
    "qwen-0.5b": ModelShape(
        "llama", layers=24, hidden=896, heads=14, kv_heads=2, vocab=151936, max_positions=32768, intermediate=4864
    ),
    "qwen-1.8b": ModelShape(
        "llama",
        layers=24,
        hidden=2048,
        heads=16,
        kv_heads=16,
        vocab=151936,
        max_positions=32768,
        intermediate=5504,
        tie_embeddings=False,
    ),
    "llama-1b": ModelShape(
        "llama", layers=16, hidden=2048, heads=32, kv_heads=8, vocab=128256, max_positions=131072, intermediate=8192
    ),
}
