"""The model families jobspec plans, traces and trains, by transformers' `model_type`: one table, read in this order.

1. `Family`: what the plan, the trace and the runner need to know of a family beyond the numbers every config has
   (jobspec/catalog/model_config.py reads those): the block the activation coefficients were traced on (Llama-style,
   Phi-3's fused projections, GPT-2), QK-norm, the tie default, mixture-of-experts (`ExpertKeys`: where the config
   keeps the routed experts, their width, the shared experts, the dense layers, the router's auxiliary loss),
   multi-head latent attention, logit soft-capping and scaling, the attention kernels transformers accepts, and for
   a multimodal checkpoint the text model inside it (`text_model`: Gemma 3 4B+ is planned and trained as the
   `gemma3_text` model of its `text_config`, the vision tower left out).
2. `FAMILIES`: the table. A `model_type` outside it is refused (`family`: ConfigError, exit 2, naming it and the
   supported ones): a family the memory model was never checked on would be planned as dense Llama blocks, which is
   how a 14 B mixture-of-experts model came to be planned as 1.9 B.
3. `attention_for`: the kernel a family runs when the spec leaves `model.attention` at its default (Gemma 2 and
   gpt-oss refuse sdpa in transformers: eager), and the refusal of one it does not accept.

Every family here is trained shrunk to 2 layers on the CPU by tests/runner/model/test_families.py, full and LoRA,
and exported; bench/families.py prints formula vs trace at each family's published shape. Pure Python: the
submitter reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from jobspec.errors import ConfigError

Block = Literal["gpt2", "llama", "phi3"]
KERNELS = frozenset({"sdpa", "eager", "flash_attention_2"})


@dataclass(frozen=True)
class ExpertKeys:
    """Where a mixture-of-experts config keeps its experts (transformers' key names differ by family)."""

    count: tuple[str, ...]  # routed experts per MoE layer: the first of these keys the config has (transformers
    # writes one name, the published config.json files may use another)
    width: str  # one expert's MLP inner width
    top_k: str = "num_experts_per_tok"
    shared: str | None = None  # shared experts' total width (Qwen2-MoE), or their count (DeepSeek: x `width`)
    shared_is_count: bool = False
    shared_gate: bool = False  # a sigmoid gate (hidden -> 1) on the shared expert's output (Qwen2-MoE)
    dense_first: str | None = None  # the first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    sparse_step: str | None = None  # the config key of the MoE layers' interval (layer i is MoE when (i + 1) % step
    # is 0: Qwen's decoder_sparse_step, Llama 4's interleave_moe_layer_step)
    dense_list: str | None = None  # the config key listing layers that keep a dense MLP (Qwen's mlp_only_layers)
    moe_list: str | None = None  # the config key listing the MoE layers, over the interval (Llama 4's moe_layers)
    every_expert: bool = False  # every expert computes every token, the router's score zero for the unchosen
    # (transformers' Llama 4: its memory and time are those of top_k = experts, though one expert is chosen)
    bias: bool = False  # biases on the router and on every expert's projections (gpt-oss)
    aux_loss: bool = True  # transformers computes the router's load-balancing loss (`output_router_logits`)


@dataclass(frozen=True)
class Family:
    """One `model_type`: what the plan, the trace and the runner need beyond the config's sizes."""

    name: str  # transformers' model_type
    label: str  # as people write it
    block: Block = "llama"
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys
    qk_norm_key: str | None = None  # the config key that turns that norm on (GLM-4.5's use_qk_norm), where optional
    tie_default: bool = False  # tie_word_embeddings when the config leaves it out (the config class's default)
    experts: ExpertKeys | None = None
    mla: bool = False  # multi-head latent attention (DeepSeek-V2): low-rank k/v (kv_lora_rank), split rope dims
    softcap_key: str | None = None  # config key of the final logits' soft cap: cap * tanh(logits / cap)
    scale_key: str | None = None  # config key of a logit scale
    scale_divides: bool = False  # Granite divides the logits by its `logits_scaling`
    extra_norms: int = 0  # norms a block has beyond the usual two (Gemma 2 and 3: after attention and the MLP)
    attentions: frozenset[str] = field(default=KERNELS)  # the kernels transformers builds the family with
    # Activation bytes a layer keeps per token beyond the block it is traced as, (per hidden unit, per unit of
    # q width[, per unit of kv width]) by residual width (4: `fast`'s fp32 stream, 2: FSDP2's 16-bit one), traced
    # at hidden 512-768: Gemma's scaled embedding and (1 + w) norms, Gemma 2 and 3's extra norms and pre-attention
    # query scaling
    act_extra: tuple[tuple[int, tuple[float, ...]], ...] = ()
    score_extra: float = 0.0  # eager attention's bytes per head and token pair beyond the softmax (Gemma 2's
    # soft-capped scores keep their tanh)
    window_mask: float = 0.0  # bytes per token pair a sliding-window layer keeps under sdpa when the sequence is
    # longer than the window (its (b, 1, s, s) mask, 16-bit), times the share of such layers
    window_key: str = "sliding_window"  # the config key of that window (Llama 4's chunked attention: its chunk size)
    routed_extra: tuple[float, float] = (0.0, 0.0)  # (per hidden, per expert-width unit) a routed token keeps beyond
    # activations.MOE_ROUTED_BYTES (gpt-oss's clamped, biased experts)
    softmax_16bit: float | None = None  # eager attention's bytes per head and token pair under 16-bit weights (the
    # FSDP2 tiers) where the family takes its softmax at the weights' width (gpt-oss, with its sinks; traced 2.0)
    # bytes per token and unit of q and kv width a layer keeps beyond activations.QK_NORM_BYTES
    qk_norm_extra: float = 0.0
    # (OLMo 2 normalizes its whole q and k projections: traced 2.0 at both residual widths, with and without GQA)
    score_backward: float = 0.0  # eager attention's bytes per head and token pair alive in its own backward beyond
    # what it keeps (the scores' gradients, the softmax's and the sinks' copies): with checkpointing the recomputed
    # layer peaks there once the sequence is long (gpt-oss: 6.0-6.5 in all at 1-4k tokens, kept 2.0; 0: not traced,
    # the layer's activations and gradients are its peak)
    text_model: str | None = None  # a multimodal checkpoint whose `text_config` (of this model_type) is the model
    # planned and trained, its vision tower left out (Gemma 3 4B+: the runner loads its language model's weights)
    dense_width: str = "intermediate_size"  # the config key of a dense layer's MLP width (Llama 4:
    # intermediate_size_mlp; its intermediate_size is an expert's)
    linear: bool = False  # Gated DeltaNet linear attention in the layers `layer_types` names (or all but every
    # `full_attention_interval`-th): Qwen3-Next's linear_* keys
    gated_attention: bool = False  # the softmax attention's output is gated by a sigmoid of a second query-wide
    # projection (Qwen3-Next's q_proj makes both)
    text_defaults: tuple[tuple[str, object], ...] = ()  # the text config class's defaults, for the keys a published
    # text_config leaves out (Gemma 3's lists only what differs from Gemma3TextConfig)


_ROUTED = ("num_local_experts", "num_experts")  # transformers' name, and the alias a config.json may use
_QWEN = ("num_experts", "num_local_experts")
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("gpt2", "GPT-2", block="gpt2", tie_default=True),
        Family("llama", "Llama"),
        Family("mistral", "Mistral"),
        Family("qwen2", "Qwen 2 / 2.5"),
        Family("qwen3", "Qwen 3", qk_norm=True),
        Family("smollm3", "SmolLM3", tie_default=True),
        Family("olmo2", "OLMo 2", qk_norm=True, qk_norm_extra=2.0,
               act_extra=((4, (1.1, 0.0)), (2, (5.1, 0.0)))),  # its post-norms keep their inputs, traced at 512 wide
        Family("granite", "Granite", scale_key="logits_scaling", scale_divides=True),
        Family("phi3", "Phi-3 / Phi-4", block="phi3"),
        Family("gemma", "Gemma", tie_default=True, act_extra=((4, (1.0, 2.0)), (2, (5.0, 2.0)))),
        Family(
            "gemma2", "Gemma 2", tie_default=True, softcap_key="final_logit_softcapping", extra_norms=2,
            attentions=frozenset({"eager", "flash_attention_2"}), act_extra=((4, (17.0, 10.0)), (2, (21.0, 10.0))),
            score_extra=2.0,
        ),
        Family(
            "gemma3_text", "Gemma 3 (text)", qk_norm=True, tie_default=True, softcap_key="final_logit_softcapping",
            extra_norms=2, act_extra=((4, (17.0, 5.2)), (2, (21.0, 5.2))), window_mask=2.0 * 5 / 6,
        ),
        Family(
            "gemma3", "Gemma 3 (multimodal: its text model)", text_model="gemma3_text",
            text_defaults=(("vocab_size", 262208), ("hidden_size", 2304), ("intermediate_size", 9216),
                           ("num_hidden_layers", 26), ("num_attention_heads", 8), ("num_key_value_heads", 4),
                           ("head_dim", 256), ("max_position_embeddings", 131072), ("sliding_window", 4096)),
        ),  # Gemma3TextConfig's defaults in transformers 5.24
        Family("mixtral", "Mixtral", experts=ExpertKeys(_ROUTED, "intermediate_size")),
        Family(
            "qwen2_moe", "Qwen 1.5 / 2 MoE",
            experts=ExpertKeys(_QWEN, "moe_intermediate_size", shared="shared_expert_intermediate_size",
                               shared_gate=True, sparse_step="decoder_sparse_step", dense_list="mlp_only_layers"),
            act_extra=((4, (7.0, 0.0)), (2, (2.7, 0.0))),  # the gated shared expert's output
        ),
        Family("qwen3_moe", "Qwen 3 MoE", qk_norm=True,
               experts=ExpertKeys(_QWEN, "moe_intermediate_size", sparse_step="decoder_sparse_step",
                                  dense_list="mlp_only_layers")),
        Family(
            "qwen3_next", "Qwen3-Next", qk_norm=True, linear=True, gated_attention=True,
            experts=ExpertKeys(_QWEN, "moe_intermediate_size", shared="shared_expert_intermediate_size",
                               shared_gate=True, sparse_step="decoder_sparse_step", dense_list="mlp_only_layers"),
            act_extra=((4, (0.0, 8.1, 1.9)), (2, (4.1, 8.1, 1.9))),  # the output gate (its sigmoid, the gated output)
        ),  # and the (1 + w) norms at the 16-bit residual; its linear-attention layers: activations.LINEAR_ACT_BYTES
        Family("olmoe", "OLMoE", qk_norm=True, experts=ExpertKeys(_QWEN, "intermediate_size")),
        Family(
            "deepseek_v2", "DeepSeek-V2", mla=True,
            experts=ExpertKeys(("n_routed_experts", "num_local_experts"), "moe_intermediate_size",
                               shared="n_shared_experts", shared_is_count=True, dense_first="first_k_dense_replace",
                               aux_loss=False),
            act_extra=((4, (1.5, 0.0)), (2, (4.5, 0.0))),  # the latent's norm and the rope split
        ),
        Family(
            "deepseek_v3", "DeepSeek-V3", mla=True,
            experts=ExpertKeys(("n_routed_experts", "num_local_experts"), "moe_intermediate_size",
                               shared="n_shared_experts", shared_is_count=True, dense_first="first_k_dense_replace",
                               aux_loss=False),  # sigmoid, group-limited routing with a bias buffer: no aux loss
            act_extra=((4, (1.5, 0.0)), (2, (4.5, 0.0))),
        ),
        Family(
            "glm4_moe", "GLM-4.5", qk_norm_key="use_qk_norm",
            experts=ExpertKeys(("n_routed_experts", "num_local_experts"), "moe_intermediate_size",
                               shared="n_shared_experts", shared_is_count=True, dense_first="first_k_dense_replace",
                               aux_loss=False),  # DeepSeek-V3's router; partial rotary, q/k/v biases
        ),
        Family(
            "llama4_text", "Llama 4 (text)", qk_norm_key="use_qk_norm", dense_width="intermediate_size_mlp",
            window_key="attention_chunk_size", window_mask=2.0 * 3 / 4,  # 3 of 4 layers chunked (traced: 2 a pair)
            experts=ExpertKeys(("num_local_experts",), "intermediate_size", shared="intermediate_size",
                               sparse_step="interleave_moe_layer_step", moe_list="moe_layers", every_expert=True,
                               aux_loss=False),  # a sigmoid of the top score, no load-balancing loss in transformers
        ),
        Family(
            "llama4", "Llama 4 (multimodal: its text model)", text_model="llama4_text",
            text_defaults=(("vocab_size", 202048), ("hidden_size", 5120), ("intermediate_size", 8192),
                           ("intermediate_size_mlp", 16384), ("num_hidden_layers", 48), ("num_attention_heads", 40),
                           ("num_key_value_heads", 8), ("head_dim", 128), ("max_position_embeddings", 131072),
                           ("num_local_experts", 16), ("num_experts_per_tok", 1), ("interleave_moe_layer_step", 1),
                           ("use_qk_norm", True)),
        ),  # Llama4TextConfig's defaults in transformers 5.24
        Family("gpt_oss", "gpt-oss", experts=ExpertKeys(_ROUTED, "intermediate_size", bias=True),
               attentions=frozenset({"eager"}), act_extra=((4, (0.0, 4.0)), (2, (0.0, 4.0))), routed_extra=(0.0, 5.3),
               softmax_16bit=2.0, score_backward=4.25),
    )
}  # fmt: skip


def supported() -> str:
    """The supported model types, for messages."""
    return ", ".join(sorted(FAMILIES))


def family(model_type: object, where: str) -> Family:
    """The family of `model_type`; ConfigError naming it, `where` it came from and the supported ones otherwise."""
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    shown = repr(model_type)[:60] if isinstance(model_type, str) else type(model_type).__name__
    raise ConfigError(
        f"{where}: model_type {shown} is not a family jobspec plans and trains (its memory plan would be a guess): "
        f"supported: {supported()}. Use a model of one of these families, or ask for yours to be added"
    )


def attention_for(fam: Family, asked: str, explicit: bool) -> str:
    """The attention kernel `fam` runs: `asked`, or where the spec left the default and the family refuses it, the
    first kernel it accepts (eager). ConfigError when the spec asks for one the family does not accept."""
    if asked in fam.attentions:
        return asked
    if not explicit:
        return "eager" if "eager" in fam.attentions else sorted(fam.attentions)[0]
    raise ConfigError(
        f"model.attention {asked}: {fam.label} models ({fam.name}) accept {', '.join(sorted(fam.attentions))} "
        f"(transformers refuses {asked} for them): set model.attention: eager"
    )
