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
    model_type: str = ""  # transformers' model_type (jobspec/catalog/families.py); "" for the presets' gpt2/llama
    # Mixture-of-experts (0 experts: dense). A MoE layer holds a router (experts x hidden), `experts` SwiGLU experts
    # of width `expert_intermediate` of which each token goes through `experts_per_token`, and shared experts of
    # total width `shared_intermediate` that every token goes through; the layers `dense_at` lists keep a dense
    # MLP of `intermediate` (DeepSeek's first layers, Qwen's mlp_only_layers, every other one of Llama 4 Maverick's).
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    shared_gate: bool = False  # Qwen2-MoE's sigmoid gate (hidden -> 1) on the shared expert
    expert_bias: bool = False  # gpt-oss: biases on the router and the experts' projections
    every_expert: bool = False  # every expert computes every token (Llama 4 in transformers): activations and time
    # of `experts` routed copies of each token, whatever experts_per_token says
    dense_at: tuple[int, ...] = ()
    # Multi-head latent attention (DeepSeek-V2): (q_lora_rank or 0, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    # v_head_dim); None for the usual q, k, v and o projections
    mla: tuple[int, int, int, int, int] | None = None
    extra_norms: int = 0  # norms a block has beyond its two (Gemma 2 and 3)
    sliding_window: int | None = None  # tokens a sliding-window layer attends to (Gemma 3), None: all
    # Linear attention (Qwen3-Next's Gated DeltaNet): (key heads, value heads, key head width, value head width,
    # convolution width) of the layers `linear_at` lists, which hold it instead of softmax attention; None: none
    linear: tuple[int, int, int, int, int] | None = None
    linear_at: tuple[int, ...] = ()
    gated_attention: bool = False  # the queries' projection also makes a sigmoid gate on the attention's output
    # (Qwen3-Next): q_proj is twice as wide

    @property
    def q_width(self) -> int:
        """Width of the attention's queries (and of its output projection's input): heads x head_dim."""
        if self.mla:
            return self.heads * (self.mla[2] + self.mla[3])
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_width(self) -> int:
        """Width of the keys and of the values (grouped-query attention: fewer heads than the queries)."""
        if self.mla:  # keys and values are expanded per head from the latent
            return self.heads * (self.mla[2] + self.mla[3] + self.mla[4]) // 2
        return (self.kv_heads or self.heads) * (self.head_dim or self.hidden // self.heads)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def dense_layers(self) -> int:
        """Layers whose MLP is dense in a mixture-of-experts model."""
        return len(self.dense_at) if self.moe else 0

    def moe_at(self, layer: int) -> bool:
        """Whether layer `layer` (0-based; -1 the last) holds the experts."""
        return self.moe and (layer % self.layers) not in self.dense_at

    @property
    def moe_layers(self) -> int:
        """Layers whose MLP is a mixture of experts."""
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def experts_computed(self) -> int:
        """Experts that compute each token: the ones it is routed to, or all of them (`every_expert`)."""
        return self.experts if self.every_expert else self.experts_per_token

    def linear_at_layer(self, layer: int) -> bool:
        """Whether layer `layer` (0-based; -1 the last) holds linear attention instead of softmax attention."""
        return self.linear is not None and (layer % self.layers) in self.linear_at

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention (every one but the linear-attention layers)."""
        return self.layers - (len(self.linear_at) if self.linear else 0)

    @property
    def linear_widths(self) -> tuple[int, int]:
        """(key width, value width) of a linear-attention layer: heads x head width (queries are key-wide)."""
        k_heads, v_heads, k_dim, v_dim, _ = self.linear or (0, 0, 0, 0, 0)
        return k_heads * k_dim, v_heads * v_dim

    def layer_kinds(self) -> dict[tuple[bool, bool], int]:
        """(mixture of experts, linear attention) -> how many layers are of that kind."""
        kinds: dict[tuple[bool, bool], int] = {}
        for i in range(self.layers):
            kind = (self.moe_at(i), self.linear_at_layer(i))
            kinds[kind] = kinds.get(kind, 0) + 1
        return kinds

    def attention_params(self, linear: bool = False) -> int:
        """Parameters of one block's attention (q, k, v and o; or MLA's low-rank projections and their norms; or
        with `linear`, the linear attention's projections, convolution, decay, gated norm)."""
        h = self.hidden
        if linear and self.linear:
            _, v_heads, _, v_dim, conv = self.linear
            key, value = self.linear_widths
            mixed = 2 * key + value  # q, k and v through the convolution
            return h * (mixed + value) + h * 2 * v_heads + mixed * conv + 2 * v_heads + v_dim + value * h
        if self.mla:
            q_rank, kv_rank, nope, rope, v = self.mla
            qk = self.heads * (nope + rope)
            q = h * q_rank + q_rank + q_rank * qk if q_rank else h * qk
            return q + h * (kv_rank + rope) + kv_rank + kv_rank * self.heads * (nope + v) + self.heads * v * h
        gate = h * self.q_width if self.gated_attention else 0
        return 2 * h * self.q_width + 2 * h * self.kv_width + gate

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def moe_mlp_params(self, active: bool = False) -> int:
        """A MoE layer's MLP: router, experts (only the `experts_per_token` a token passes through when `active`),
        shared experts."""
        h, e = self.hidden, self.expert_intermediate
        n = self.experts_computed if active else self.experts
        bias = (2 * e + h) if self.expert_bias else 0
        router = self.experts * (h + (1 if self.expert_bias else 0))
        return router + n * (3 * h * e + bias) + 3 * h * self.shared_intermediate + (h if self.shared_gate else 0)

    def block_params(self, moe: bool, linear: bool = False) -> int:
        """Parameters of one Llama-style block, dense or MoE, with softmax or linear attention (FSDP2 gathers a block
        whole)."""
        norms = (2 + self.extra_norms) * self.hidden
        mlp = self.moe_mlp_params() if moe else self.dense_mlp_params()
        return self.attention_params(linear) + mlp + norms

    def block_params_at(self, layer: int) -> int:
        """`block_params` of layer `layer` (0-based; -1 the last)."""
        return self.block_params(self.moe_at(layer), self.linear_at_layer(layer))

    @property
    def params(self) -> int:
        """Parameter count, exact for the transformers GPT-2, Llama and Mixtral implementations (biases and
        per-head norms of other families left out: well under 0.1 %)."""
        h, i, v, n = self.hidden, self.intermediate, self.vocab, self.layers
        if self.family == "gpt2":
            # per block: qkv (3h^2+3h) + proj (h^2+h) + mlp (2hi+i+h) + 2 layernorms (4h)
            block = 4 * h * h + 2 * h * i + 9 * h + i
            embed = v * h + self.max_positions * h
            return embed + n * block + 2 * h  # + final layernorm
        blocks = sum(count * self.block_params(*kind) for kind, count in self.layer_kinds().items())
        embed = v * h * (1 if self.tie_embeddings else 2)
        return embed + blocks + h

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: all of them for a dense model; the routed experts it is sent to (every
        expert where every one computes it: Llama 4 in transformers)."""
        if not self.moe:
            return self.params
        return self.params - self.moe_layers * (self.moe_mlp_params() - self.moe_mlp_params(active=True))


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
    # Llama 3.1 8B's published shape (untied head, rope_theta 500000 in its config; here the preset's default RoPE):
    # issue 42's LoRA throughput row, randomly initialised (no download)
    "llama-8b": ModelShape(
        "llama",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        vocab=128256,
        max_positions=131072,
        intermediate=14336,
        tie_embeddings=False,
    ),
}
