"""Activations: the bytes a training step saves for backward per layer and token, and the loss head's.

The coefficients are fitted to traces of the runner's own step (runner/train/trace.py), each with the shapes it was
fitted on; `_activations` sums them over a model's layers (dense or mixture of experts, softmax or linear attention),
`_recompute` is what activation checkpointing recomputes at a time, `_loss_bytes` the chunked loss head. Read after
jobspec/plan/adapters.py (the LoRA targets whose inputs a layer's adapters save); jobspec/plan/memory.py adds these
to the model states of each tier.
"""

from __future__ import annotations

from typing import Literal

from jobspec.catalog.families import FAMILIES
from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError
from jobspec.plan.adapters import LoraShape, _family, _lora_targets
from jobspec.plan.widths import HALF_BYTES

LossKernel = Literal["chunked", "liger"]
# Activations per layer and token, bytes = c_h * hidden + c_q * q_width + c_kv * kv_width + c_i * intermediate, by
# (family, residual stream width), fitted to traces of the runner's step (runner/train/trace.py; per layer and token
# from traces at 2 and 4 layers and micro-batches 2 and 4, hidden 512-768, intermediate 2-4x, with and without
# grouped-query attention and a head_dim that is not hidden / heads: every fit within 2 bytes a token). Llama-style
# blocks (RMSNorm upcasts to fp32, RoPE on q and k, SwiGLU saves gate, up and their product), Phi-3's fused qkv and
# gate/up projections (its queries are `hidden` wide: their term is in c_h), and GPT-2 blocks (LayerNorm, tanh
# GELU; q and kv are `hidden` wide) differ. The fp32 residual of autocast over fp32 weights (`fast`) saves both the
# fp32 stream and autocast's 16-bit copies of it; there, as on a GPU, autocast runs GELU's `pow` in fp32 (GPT-2:
# 16 bytes an intermediate unit, 10 under FSDP2's 16-bit weights, which run without autocast).
ACT_BYTES: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("llama", 4): (26.0, 4.0, 4.0, 8.0),
    ("llama", 2): (16.0, 4.0, 4.0, 8.0),
    ("phi3", 4): (28.0, 0.0, 6.0, 8.0),
    ("phi3", 2): (24.0, 0.0, 6.0, 8.0),
    ("gpt2", 4): (20.0, 0.0, 0.0, 16.0),
    ("gpt2", 2): (16.0, 0.0, 0.0, 10.0),
}
# A mixture-of-experts layer, per token and each expert it is routed to: (c_h, c_i) bytes per hidden and expert
# intermediate unit (the token's gathered input, the experts' gate/up output, activation and product, the weighted
# output), on top of the layer's attention and shared experts (traced on Mixtral-shaped layers, hidden 512-768, expert
# width 1024-2048, 8-16 experts, top-2 and top-4, `fast`: 8 a unit of expert width, 3-5 a hidden unit)
MOE_ROUTED_BYTES = (4.0, 8.0)
# Under LoRA the experts are frozen: their projections keep no inputs for weight gradients, only what the input
# gradient needs (traced on Qwen3-MoE-shaped layers, hidden 512-768, expert width 256-512, top-2 and top-4, at `fast`
# and `zero2`: 2 a hidden and 6 an expert-width unit per routed token, every case within 140 bytes a token; with the
# full fine-tuning coefficients a 30B-A3B LoRA at `fast` was planned 17 % over its trace). Adapters on the experts
# add their inputs on top (LORA_INPUT_BYTES).
MOE_ROUTED_LORA_BYTES = (2.0, 6.0)
# LoRA on the routed experts (peft's target_parameters) adds B·A to each adapted 3-D weight at every forward: the
# merged weight, at the compute width, is what the grouped matmul reads and keeps for its input gradient, so every
# MoE layer that saves its activations holds one (traced: 1.8-1.9 bytes an expert weight value at 8 and 16 experts,
# `fast` and `zero2`; a Qwen3-30B-A3B with adapters on its experts at `zero2` was planned at 0.65 of its trace).
# A linear-attention layer (Qwen3-Next's Gated DeltaNet, as transformers runs it without the flash-linear-attention
# package: its PyTorch chunked delta rule, chunks of LINEAR_CHUNK tokens, in fp32): bytes per token beyond the dense
# coefficients' hidden and MLP terms (and the family's hidden extra), per (hidden unit, key width, value width, value
# heads x key head width (q and k repeated for each value head), value heads x chunk (each chunk's decay and attention
# matrices), value heads x key x value head width / chunk (the recurrent state saved at each chunk)), by (autocast:
# `fast`, LoRA). Fitted to traces of the runner's step on all-linear layers with dense MLPs (hidden 512-768, 4-16 value
# heads, head widths 32-128, MLP 1024-2048 wide, 256 tokens: 10 shapes, full fine-tuning every one within 3 bytes a
# token of the fit, LoRA on every projection within 15; `fast`'s less autocast's cached 16-bit weights, which the
# states count). LoRA's frozen norms and output projection keep no inputs for weight gradients. fp32 training (not
# traced) counts the FSDP2 tiers' row.
LINEAR_CHUNK = 64
LINEAR_ACT_BYTES: dict[tuple[bool, bool], tuple[float, float, float, float, float, float]] = {
    (True, False): (-2.0, 8.0, 35.5, 36.5, 14.6, 7.0),
    (False, False): (0.0, 8.0, 34.0, 32.0, 20.6, 4.0),
    (True, True): (-3.9, 8.2, 29.7, 36.5, 14.5, 7.0),
    (False, True): (-4.0, 8.1, 30.0, 32.0, 20.5, 4.0),
}
# `training.block_kernels: liger`: what a dense Llama-style layer keeps less per token, (c_h, c_i) bytes per hidden and
# intermediate unit, by full fine-tuning (True) or LoRA. Liger's RMSNorm keeps its input and an fp32 rstd a row, not
# transformers' fp32 copy and normalised output (two norms a layer); its SwiGLU keeps gate and up, not also the
# activation (its product is the down projection's input either way); its RoPE keeps cos and sin as transformers'
# does. Traced: Llama-shaped layers, hidden 512-768, intermediate 1024-2048, 2 and 4 layers, `fast` and `zero2`, bf16:
# 8 h + 2 i full, 4 h + 2 i with LoRA on every projection, exactly in each of the 12 cases. Mixture-of-experts and
# linear-attention layers, other blocks and fp32 keep transformers' coefficients (an upper bound).
LIGER_SAVED_BYTES: dict[bool, tuple[float, float]] = {True: (8.0, 2.0), False: (4.0, 2.0)}
# `training.compile` (blocks or model): what a dense layer keeps less per token when its blocks are compiled, (c_h,
# c_i) bytes per hidden and intermediate unit, by (family, autocast: `fast` at 16 bits, LoRA). The partitioner
# recomputes in backward the norms' fp32 copies, the gated activation and RoPE's products instead of keeping them.
# Measured on one block, eager against compiled by AOT autograd's min-cut partitioner as inductor compiles it
# (runner/train/trace_compiled.py; `python -m bench.compile_memory`): hidden 512 and 768, MLP 2x and 4x, with and
# without grouped-query attention, Llama's also with heads twice hidden/heads wide; every fit exact to 0.1 B a token
# (GPT-2's `fast` LoRA: 4.03 a hidden unit, taken as 4). Counted for layers that keep their activations (no
# checkpointing: the recomputed layer keeps eager's bytes, an upper bound); not with Liger's blocks (their autograd
# functions do not compile on fakes: eager's bytes with Liger's saving), fp32, MoE or linear-attention layers.
COMPILE_SAVED_BYTES: dict[tuple[str, bool, bool], tuple[float, float]] = {
    ("llama", True, False): (16.0, 2.0),
    ("llama", True, True): (10.0, 2.0),
    ("llama", False, False): (8.0, 2.0),
    ("llama", False, True): (4.0, 2.0),
    ("phi3", True, False): (12.0, 2.0),
    ("phi3", True, True): (4.0, 2.0),
    ("phi3", False, False): (10.0, 2.0),
    ("phi3", False, True): (6.0, 2.0),
    ("gpt2", True, False): (2.0, 12.0),
    ("gpt2", True, True): (4.0, 12.0),
    ("gpt2", False, False): (0.0, 6.0),
    ("gpt2", False, True): (0.0, 6.0),
}
# fp32 training (no autocast, no 16-bit copies), every tier
FP32_ACT_BYTES: dict[str, tuple[float, float, float, float]] = {
    "llama": (24.0, 8.0, 8.0, 16.0),
    "phi3": (40.0, 0.0, 12.0, 16.0),
    "gpt2": (32.0, 0.0, 0.0, 20.0),
}
# LoRA (a frozen 16-bit base: its linears save no input for a weight gradient): the blocks without adapters, by
# (family, autocast: `fast`), then each adapter's 16-bit input (LORA_INPUT_BYTES a unit of its width). Under
# `fast`'s autocast every adapter (fp32) casts and saves a copy of its own; under FSDP2's 16-bit adapters, adapters
# that read one tensor (q, k and v) save it once, and the attention's output projection reads what SDPA already
# keeps (not so in Phi-3's blocks). Traced with rank 8 on the attention's, the MLP's or every linear layer (the same
# grid as ACT_BYTES).
LORA_ACT_BYTES: dict[tuple[str, bool], tuple[float, float, float, float]] = {
    ("llama", True): (8.0, 4.0, 4.0, 6.0),
    ("llama", False): (8.0, 4.0, 4.0, 6.0),
    ("phi3", True): (14.0, 0.0, 6.0, 6.0),
    ("phi3", False): (14.0, 0.0, 6.0, 6.0),
    ("gpt2", True): (16.0, 0.0, 0.0, 14.0),
    ("gpt2", False): (12.0, 0.0, 0.0, 8.0),
}
LORA_INPUT_BYTES = 2
# With checkpointing, the layer being recomputed in backward also holds the gradients through it, per token:
# (c_h, c_i) bytes per hidden and intermediate unit, by what trains (traced at zero3 on Llama-style, Phi-3 and GPT-2
# blocks, hidden 768-1280, intermediate 2.7-4x: full fine-tuning 4i within 4 bytes a token; LoRA 14h + 6i, 14h + 4i
# when it adapts the MLP too; it was 22h for all before 2026-11-26).
RECOMPUTE_GRAD_BYTES: dict[str, tuple[float, float]] = {
    "full": (0.0, 4.0),
    "lora": (14.0, 6.0),
    "lora_mlp": (14.0, 4.0),
}
MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc", "c_proj", "mlp.c_proj"})
# after the last block with LoRA, per token and hidden unit: the frozen final norm's saved tensors (16-bit input, fp32
# intermediates), the 16-bit hidden states the loss keeps and the gradient it makes of them in forward (traced 20.0
# at hidden 640-1536 with checkpointing, where it shows; it was 4 before 2026-11-26, 57 % under on the slope)
LORA_LOSS_HIDDEN_BYTES = 20
# LoRA in fp32 (no autocast): every saved tensor fp32; traced 1.44x the `fast` bytes per layer
FP32_ACT_FACTOR = 1.44
# Residual dropout (GPT-2's resid_pdrop, Phi-3's): a GPU's fused dropout keeps a 1-byte mask of each of a block's two
# residual branches (traced with the trace's GPU decisions: 2 bytes per token and hidden unit a layer). Attention
# dropout runs inside a GPU's SDPA kernel and keeps nothing.
DROPOUT_MASK_BYTES = 1
# Eager attention keeps the scores' softmax: bytes per head per token pair (traced 5.98-5.99 at s 256-512). Llama-style
# blocks take it in fp32 and keep a 16-bit copy; GPT-2's softmax is fp32 only under (a GPU's) autocast, `fast`:
# without autocast (FSDP2's 16-bit weights) it keeps 16 bits (traced 1.98-1.99).
EAGER_SCORE_BYTES = 6.0
EAGER_SCORE_BYTES_16 = 2.0
# QK-norm (Qwen3, Gemma 3, OLMo 2): each layer saves the norms' fp32 input and 16-bit output of its queries and keys,
# per token and unit of q_width + kv_width (traced 6.03, 3 and 6 layers); nothing more with checkpointing.
QK_NORM_BYTES = 6
# A packed micro-batch (`data.packing`) under sdpa: transformers' (b, 1, s, s) block-diagonal mask instead of SDPA's
# `is_causal`. Per micro-batch row and token pair, traced on the runner's step (hidden 384, 2-6 layers, b 4, s 1024):
# every layer saves a 16-bit copy of the mask for backward (gpt2 2.0 B a layer, llama 3.0 with its GQA expansion,
# + 0.4 once); with activation checkpointing only the mask itself stays (1.0-1.2). Eager materialises a mask
# whether packed or not (its scores term covers it); flash attention takes the positions as varlen lengths.
PACKED_MASK_LAYER_BYTES = {"llama": 3.1, "phi3": 3.1, "gpt2": 2.0}
PACKED_MASK_CHECKPOINTED_BYTES = 1.2
# After the last block, per token and hidden unit: the final norm's saved tensors, the hidden states the loss keeps
# and its gradient, by (family, residual width); traced, and where the step peaks with activation checkpointing.
LOSS_HIDDEN_BYTES: dict[tuple[str, int], int] = {("llama", 4): 14, ("llama", 2): 10, ("phi3", 4): 14, ("phi3", 2): 10,
                                                 ("gpt2", 4): 10, ("gpt2", 2): 6}  # fmt: skip
# The chunked cross-entropy's working set: one chunk of fp32 logits is at most this many bytes, and its 16-bit logits
# (or gradient) come with it: LOSS_CHUNK_FACTOR times the fp32 chunk (traced). With Liger's kernel the chunk is its
# logits at the compute width, which the kernel overwrites with their gradient: one chunk of LOSS_CHUNK_BYTES
# (traced). runner/train/loss.py sizes its chunks with `loss_chunk_tokens`.
LOSS_CHUNK_BYTES = 256 * 1024**2
LOSS_CHUNK_FACTOR = {"chunked": 1.5, "liger": 1.0}
# Per token besides the hidden states: int64 label, fp32 log-sum-exp and per-token loss.
LOSS_TOKEN_BYTES = 16


def loss_chunk_bytes(kernel: LossKernel, precision: str) -> int:
    """Bytes of one logit in a chunk: the chunked loss works on fp32 logits, Liger's kernel on the compute width's."""
    return 2 if kernel == "liger" and precision in ("bf16", "fp16") else 4


def loss_chunk_tokens(vocab: int, kernel: LossKernel = "chunked", precision: str = "fp32") -> int:
    """Tokens per chunk of the cross-entropy: one chunk's logits (fp32, or the compute width's for Liger's kernel)
    within LOSS_CHUNK_BYTES."""
    return max(1, LOSS_CHUNK_BYTES // (loss_chunk_bytes(kernel, precision) * max(1, vocab)))


def residual_bytes(tier: str, precision: str, lora: LoraShape | None = None) -> int:
    """Width of the residual stream: fp32 under autocast over fp32 weights (`fast`) or in fp32 training;
    16 bits under FSDP2's mixed precision, which gathers the weights in 16 bits, and over LoRA's 16-bit base."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"unknown precision {precision!r}; expected bf16, fp16 or fp32")
    if precision == "fp32":
        return 4
    return 4 if tier == "fast" and lora is None else 2


def _layer_bytes(
    shape: ModelShape, tier: str, precision: str, lora: LoraShape | None, linear: bool | None = None, *,
    liger: bool = False, compiled: bool = False,
) -> float:  # fmt: skip
    """Activation bytes one layer saves per token (sdpa), from the traced coefficients: the mean over the layers of a
    mixture-of-experts or linear-attention model, whose MoE layers have their experts' instead of a dense MLP's and
    whose linear-attention layers their own (`linear` True or False: the mean over the layers of that attention)."""
    if not shape.moe and not shape.linear:
        return _kind_bytes(shape, tier, precision, lora, moe=False, liger=liger, compiled=compiled)
    kinds = {kind: n for kind, n in shape.layer_kinds().items() if linear in (None, kind[1])}
    total = sum(n * _kind_bytes(shape, tier, precision, lora, *kind, liger=liger, compiled=compiled)
                for kind, n in kinds.items())  # fmt: skip
    return total / sum(kinds.values())


def _liger_saved(shape: ModelShape, precision: str, lora: LoraShape | None, liger: bool) -> float:
    """Bytes a token keeps less in a dense Llama-style layer with Liger's block kernels (LIGER_SAVED_BYTES); 0 for
    the layers and blocks they were not traced on (kept at transformers' coefficients: an upper bound)."""
    if not liger or precision == "fp32" or _family(shape) != "llama":
        return 0.0
    c_h, c_i = LIGER_SAVED_BYTES[lora is None]
    return c_h * shape.hidden + c_i * shape.intermediate


def _compile_saved(shape: ModelShape, tier: str, precision: str, lora: LoraShape | None, liger: bool,
                   compiled: bool) -> float:  # fmt: skip
    """Bytes a token keeps less in a dense layer whose block is compiled (COMPILE_SAVED_BYTES); 0 where not counted."""
    if not compiled or liger or precision == "fp32":
        return 0.0
    c_h, c_i = COMPILE_SAVED_BYTES[(_family(shape), tier == "fast", lora is not None)]
    return c_h * shape.hidden + c_i * shape.intermediate


def _linear_bytes(shape: ModelShape, tier: str, precision: str, lora: LoraShape | None) -> float:
    """Bytes a linear-attention layer's attention keeps per token (LINEAR_ACT_BYTES), without its MLP."""
    _, heads, k_dim, v_dim, _ = shape.linear  # type: ignore[misc]
    key, value = shape.linear_widths
    widths = (shape.hidden, key, value, heads * k_dim, heads * LINEAR_CHUNK, heads * k_dim * v_dim / LINEAR_CHUNK)
    c = LINEAR_ACT_BYTES[(tier == "fast" and precision != "fp32", lora is not None)]
    return sum(a * w for a, w in zip(c, widths, strict=True))


def _kind_bytes(
    shape: ModelShape, tier: str, precision: str, lora: LoraShape | None, moe: bool, linear: bool = False, *,
    liger: bool = False, compiled: bool = False,
) -> float:  # fmt: skip
    """`_layer_bytes` of a dense layer, or of a MoE layer (`moe`): the dense coefficients with the shared experts'
    width for the MLP's, and per routed token MOE_ROUTED_BYTES (the gathered input, the experts' projections); of a
    linear-attention layer (`linear`): the dense coefficients without the attention's q and kv terms, and
    `_linear_bytes` for its attention. `liger`: a dense layer with Liger's block kernels (`_liger_saved`);
    `compiled`: with its block compiled (`_compile_saved`)."""
    mlp = shape.shared_intermediate if moe else shape.intermediate
    widths = (shape.hidden, 0 if linear else shape.q_width, 0 if linear else shape.kv_width, mlp)
    family = _family(shape)
    extra_bytes = 2 * DROPOUT_MASK_BYTES * shape.hidden if shape.residual_dropout else 0
    fam = FAMILIES.get(shape.model_type)
    if moe:  # the routed experts
        routed = MOE_ROUTED_BYTES if lora is None else MOE_ROUTED_LORA_BYTES
        c_h, c_i = (a + b for a, b in zip(routed, fam.routed_extra if fam else (0.0, 0.0), strict=True))
        extra_bytes += shape.experts_computed * (c_h * shape.hidden + c_i * shape.expert_intermediate)
    residual = residual_bytes(tier, precision, lora)
    extra = dict(fam.act_extra).get(residual) if fam else None
    if extra:  # what the family's blocks keep beyond the block they are traced as (per hidden, q and kv unit)
        extra_bytes += sum(c * w for c, w in zip(extra, widths[:3], strict=False))
    if linear:
        extra_bytes += _linear_bytes(shape, tier, precision, lora)
    if not moe and not linear:
        extra_bytes -= _liger_saved(shape, precision, lora, liger) + _compile_saved(shape, tier, precision, lora, liger,
                                                                                    compiled)  # fmt: skip
    if lora is None:
        coef = FP32_ACT_BYTES[family] if precision == "fp32" else ACT_BYTES[(family, residual)]
        return sum(c * w for c, w in zip(coef, widths, strict=True)) + extra_bytes
    per_token = sum(c * w for c, w in zip(LORA_ACT_BYTES[(family, tier == "fast")], widths, strict=True)) + extra_bytes
    modules = _lora_targets(shape, lora, moe, linear)
    routed = {m for m in modules if m[3] == "experts"}  # adapters of the experts read each routed token's input
    modules -= routed
    per_token += shape.experts_computed * LORA_INPUT_BYTES * sum(fin // max(1, shape.experts)
                                                                  for _, fin, _, _ in routed)  # fmt: skip
    if tier == "fast" and precision != "fp32":  # autocast: every fp32 adapter saves a 16-bit copy of its input
        per_token += sum(LORA_INPUT_BYTES * fin for _, fin, _, _ in modules)
    else:  # 16-bit adapters save the tensor they read, once however many read it
        read = {reads: fin for _, fin, _, reads in modules}
        if not shape.fused_projections:
            read.pop("attn_out", None)  # the output projection reads what SDPA keeps for its own backward
        per_token += sum(LORA_INPUT_BYTES * fin for fin in read.values())
    return per_token * FP32_ACT_FACTOR if precision == "fp32" else per_token


def _window_mask(shape: ModelShape, attention: str, seq_len: int) -> float:
    """Bytes per token pair a layer keeps on average for its sliding-window mask under sdpa (Gemma 3's local layers,
    when the sequence is longer than the window; traced 2 bytes a pair)."""
    fam = FAMILIES.get(shape.model_type)
    window = shape.sliding_window
    if fam is None or attention != "sdpa" or window is None or seq_len <= window:
        return 0.0
    return fam.window_mask


def _eager_scores(shape: ModelShape, tier: str, precision: str) -> float:
    """Bytes eager attention keeps per head and token pair (and what the family's own scores keep beyond it)."""
    fam = FAMILIES.get(shape.model_type)
    if fam and fam.softmax_16bit is not None and tier != "fast" and precision != "fp32":
        return fam.softmax_16bit + fam.score_extra
    return _softmax_scores(shape, tier, precision) + (fam.score_extra if fam else 0.0)


def _softmax_scores(shape: ModelShape, tier: str, precision: str) -> float:
    if precision == "fp32":
        return 2 * EAGER_SCORE_BYTES_16 if shape.family == "gpt2" and tier != "fast" else 2 * EAGER_SCORE_BYTES
    return EAGER_SCORE_BYTES_16 if shape.family == "gpt2" and tier != "fast" else EAGER_SCORE_BYTES


def _activations(
    shape: ModelShape,
    tier: str,
    tokens: int,
    seq_len: int,
    checkpointing: bool,
    attention: str,
    precision: str,
    lora: LoraShape | None = None,
    *,
    liger: bool = False,
    compiled: bool = False,
) -> int:
    per_token = _layer_bytes(shape, tier, precision, lora, liger=liger, compiled=compiled)
    softmax = shape.attention_layers / shape.layers  # the layers with softmax attention (not linear attention)
    if shape.qk_norm:
        fam = FAMILIES.get(shape.model_type)
        per_token += softmax * (QK_NORM_BYTES + (fam.qk_norm_extra if fam else 0.0)) * (shape.q_width + shape.kv_width)
    if attention == "eager":  # the scores and their softmax stay in memory, per head and token pair
        per_token += softmax * _eager_scores(shape, tier, precision) * shape.heads * seq_len
    elif attention not in ("sdpa", "flash", "flash_attention_2"):
        raise ConfigError(f"unknown attention {attention!r}; expected sdpa, flash or eager")
    per_token += _window_mask(shape, attention, seq_len) * seq_len
    if checkpointing:
        # each layer keeps its input; backward recomputes one layer at a time, which holds that layer's activations
        # and the gradients flowing through it. The step peaks there or at the loss (after the last block),
        # whichever is larger: `estimate` adds the part of the recompute above the loss.
        return shape.layers * residual_bytes(tier, precision, lora) * tokens * shape.hidden
    prefix = _untrained_prefix(shape, lora)
    skipped = sum(_kind_bytes(shape, tier, precision, lora, shape.moe_at(i), shape.linear_at_layer(i), liger=liger,
                              compiled=compiled) for i in range(prefix))  # fmt: skip
    merged = sum(1 for i in range(prefix, shape.layers) if shape.moe_at(i)) * merged_experts(shape, lora, precision)
    return int((shape.layers * per_token - skipped) * tokens) + merged


def merged_experts(shape: ModelShape, lora: LoraShape | None, precision: str) -> int:
    """Bytes of one MoE layer's merged expert weights (W + B·A of each routed-expert weight LoRA adapts), which the
    layer keeps for backward; 0 without adapters on the experts."""
    if lora is None or not shape.moe:
        return 0
    values = sum(fin * fout // shape.experts for _, fin, fout, reads in _lora_targets(shape, lora, moe=True)
                 if reads == "experts")  # fmt: skip
    return values * (4 if precision == "fp32" else HALF_BYTES)


def _untrained_prefix(shape: ModelShape, lora: LoraShape | None) -> int:
    """Layers before the first one LoRA adapts: with a frozen embedding and no checkpointing (which makes the blocks'
    inputs require gradients) nothing in them needs a gradient, so autograd keeps none of their activations (Qwen3-Next
    with adapters on q_proj and v_proj only: its first three layers hold linear attention and no adapter). 0 without
    LoRA."""
    if lora is None or shape.family == "gpt2":
        return 0
    for layer in range(shape.layers):
        if _lora_targets(shape, lora, shape.moe_at(layer), shape.linear_at_layer(layer)):
            return layer
    return shape.layers


def _recompute(shape: ModelShape, tier: str, tokens: int, seq_len: int, attention: str, precision: str,
               lora: LoraShape | None, *, liger: bool = False) -> int:  # fmt: skip
    """Bytes of the layer that checkpointing recomputes in backward: its activations and the gradients through it."""
    kind = "full" if lora is None else "lora_mlp" if MLP_TARGETS & set(lora.targets) else "lora"
    c_h, c_i = RECOMPUTE_GRAD_BYTES[kind]
    # the layer recomputed is one of either attention where a model has both: the larger
    kinds = (False, True) if shape.linear else (None,)
    layer = max(_layer_bytes(shape, tier, precision, lora, linear, liger=liger) for linear in kinds)
    per_token = layer + c_h * shape.hidden + c_i * shape.intermediate
    merged = merged_experts(shape, lora, precision)  # the recomputed MoE layer's merged expert weights
    fam = FAMILIES.get(shape.model_type)
    if shape.qk_norm and fam and fam.qk_norm_extra:  # norms over whole projections keep theirs in the recomputed
        # layer too (OLMo 2, traced at zero3 and minimal; per-head norms, Qwen3's, add nothing there)
        per_token += (QK_NORM_BYTES + fam.qk_norm_extra) * (shape.q_width + shape.kv_width)
    if attention == "eager":
        scores = _eager_scores(shape, tier, precision)
        per_token += scores * shape.heads * seq_len
        if fam and fam.score_backward:  # or at the attention's own backward, the MLP's activations freed by then: the
            # scores kept and what their backward makes (traced on gpt-oss at 512-4096 tokens: 0.78 of the trace at
            # 4096 without it, 1.00 with it)
            per_token = max(per_token, (scores + fam.score_backward) * shape.heads * seq_len)
    return int(per_token * tokens) + merged


def _loss_parts(
    shape: ModelShape, tier: str, tokens: int, precision: str, lora: LoraShape | None, kernel: LossKernel = "chunked"
) -> tuple[int, int]:
    """(kept, chunk) after the last block: the final norm, the hidden states the chunked cross-entropy keeps and
    per-token extras; one chunk's working set."""
    if tokens == 0:
        return 0, 0
    if lora is not None:
        hidden = LORA_LOSS_HIDDEN_BYTES * (2 if precision == "fp32" else 1)
    else:
        hidden = LOSS_HIDDEN_BYTES[(_family(shape), residual_bytes(tier, precision))]
    per_logit = loss_chunk_bytes(kernel, precision) * LOSS_CHUNK_FACTOR[kernel]
    chunk = min(tokens, loss_chunk_tokens(shape.vocab, kernel, precision)) * shape.vocab * per_logit
    return tokens * (hidden * shape.hidden + LOSS_TOKEN_BYTES), int(chunk)
