"""Memory model: bytes per GPU for a model shape, tier, sequence length and micro-batch, term by term.

Shared by `jobspec plan` (before submit) and the runner (in the pod), so it takes plain numbers
and a `ModelShape`, never the spec, and imports neither torch nor pydantic. All sizes are bytes
(ints). Formulas and tiers: DESIGN.md, "Memory model" and "Memory tiers". The runner verifies the
plan with real optimizer steps; the model is judged against a trace of the runner's own step
(runner/train/trace.py: the same step on FakeTensors under torch's memory tracker), and against a
GPU's `max_memory_allocated` (bench/gpu).

The terms (`MemoryEstimate.breakdown()`, what `jobspec plan -o json` prints as `gpu_breakdown`), with
w the weights held, t the trainable ones, f = w - t the frozen ones (LoRA), N data-parallel ranks:

    tier           weights        gradients  optimizer  buckets      working weights
    fast           4t + 2f        4t         8t         4t (N > 1)   2t  autocast's bf16 copies
    zero2          (4t + 2f)/N    4t/N       8t/N       -            2w  FSDP2's bf16 gather, kept to backward,
    zero2_offload  (4t + 2f)/N    4t/N       host       -            2w  + the module at the peak (below)
    zero3          (4t + 2f)/N    4t/N       8t/N       -            the module at the peak (below)
    minimal        host           host       host       -            as zero3

    at the peak    FSDP2 tiers peak at one of five moments (`_fsdp_peak`): forward at the loss (the output
                   layer gathered, its 16-bit gradient the fused loss makes, one chunk of logits), backward
                   at the output layer (its gradient reduce-scattered in fp32; a tied embedding's unit, which
                   holds the final norm, gathered again for the norm: its all-gather buffer on top),
                   backward at the last block (the block gathered, its fp32 gradient, the layer checkpointing
                   recomputes, every saved activation) or at the first (one layer's activations left, the
                   root's embedding gathered ahead), or the end of backward (the root's embedding and its
                   gradients, no activations); a gathered module is 2 bytes a parameter, twice over where
                   forward reshards (zero3: the parameters and the all-gather buffer; none on one rank; a tied
                   embedding has no buffer of its own at the loss); zero2's kept weights reshard unit by unit
                   after their backward
    activations    per layer and token: ACT_BYTES[family, residual] (c_h * hidden + c_q * q width + c_kv *
                   kv width + c_i * intermediate), the residual stream fp32 under autocast (`fast`: fp32
                   parameters) and bf16 under FSDP2's mixed precision; with checkpointing each layer keeps
                   only its input (residual width x hidden) and one layer is recomputed at a time; eager
                   attention adds its scores, QK-norm its norms, packing its mask, dropout its masks
    logits         the chunked cross-entropy (runner/train/loss.py): the final hidden states it saves, the
                   labels and per-token log-sum-exp, and one chunk of logits at a time (LOSS_CHUNK_BYTES of
                   fp32 logits, with their 16-bit copy and gradient; `training.loss_kernel: liger`: LOSS_CHUNK_BYTES
                   of logits at the compute width, which Liger's kernel turns into their gradient in place):
                   never the whole (tokens x vocab) tensor
    overhead       CUDA/HIP context and workspaces (OVERHEAD_FIXED) + allocator fragmentation
                   (OVERHEAD_PERCENT of the rest)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Literal

from jobspec.catalog.families import FAMILIES
from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import CHECKPOINTING, HOST_OPTIMIZER_TIERS, SHARD_ONLY, TIERS, divisors, tier_index
from jobspec.errors import ConfigError
from jobspec.plan.quantize import base_quantization, gathered_saving, quantized_params, quantized_saving

Attention = Literal["sdpa", "flash", "flash_attention_2", "eager"]
Precision = Literal["bf16", "fp16", "fp32"]
LossKernel = Literal["chunked", "liger"]

# Trainable parameters are fp32 with AdamW's m and v (fp32): 4 + 4 (gradient) + 8. A frozen LoRA base is
# held at the training width (2 bytes); its adapters are fp32.
MASTER_BYTES = 4
FROZEN_BYTES = 2
GRAD_BYTES = 4
ADAM_BYTES = 8
# `training.optimizer: adamw_8bit` (torchao's AdamW8bit) on the tiers that keep the optimizer on the GPU: each moment a
# uint8 code per value and an fp32 scale per block of 256 (2 + 8/256 bytes a parameter; the few tensors under 4096
# values keep fp32 moments, counted as 8-bit here), and its step's fp32 working copies of one parameter (its value,
# gradient and two moments: an upper bound, not traced; the largest parameter's shard counts)
LOW_BIT_NUM, LOW_BIT_DEN = 65, 32  # 2.03125 bytes a parameter
LOW_BIT_STEP_BYTES = 16
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")  # sgd: plain SGD, no momentum, so no state at all
HALF_BYTES = 2  # a 16-bit copy: autocast's weight casts, FSDP2's gathered parameters
# DDP (`fast` on more than one rank) copies the grads into flat fp32 all-reduce buckets (the gradient's
# dtype) unless gradient_as_bucket_view=True. On one rank accelerate does not wrap the model in DDP.
DDP_BUCKET_BYTES = 4
# Offload tiers: the host holds what the GPU does not: the fp32 shard, its gradient and Adam's m and v
# (16 bytes per trainable parameter per rank's shard), the frozen shard in 16 bits.
HOST_TRAINABLE_BYTES = MASTER_BYTES + GRAD_BYTES + ADAM_BYTES
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
# CUDA/HIP context (~0.3-0.6 GiB), cuBLAS/NCCL workspaces: a fixed 1 GiB; allocator fragmentation
# grows with what is allocated: 5 % of the rest.
OVERHEAD_FIXED = 1024**3
OVERHEAD_PERCENT = 5


def overhead_bytes(body: int) -> int:
    """The allowance on top of the bytes the model counts: OVERHEAD_FIXED + OVERHEAD_PERCENT of them."""
    return OVERHEAD_FIXED + body * OVERHEAD_PERCENT // 100


def loss_chunk_bytes(kernel: LossKernel, precision: str) -> int:
    """Bytes of one logit in a chunk: the chunked loss works on fp32 logits, Liger's kernel on the compute width's."""
    return 2 if kernel == "liger" and precision in ("bf16", "fp16") else 4


def loss_chunk_tokens(vocab: int, kernel: LossKernel = "chunked", precision: str = "fp32") -> int:
    """Tokens per chunk of the cross-entropy: one chunk's logits (fp32, or the compute width's for Liger's kernel)
    within LOSS_CHUNK_BYTES."""
    return max(1, LOSS_CHUNK_BYTES // (loss_chunk_bytes(kernel, precision) * max(1, vocab)))


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters: rank r and the module names they wrap (PEFT `target_modules`, by suffix)."""

    rank: int
    targets: tuple[str, ...]


def _lora_modules(
    shape: ModelShape, moe: bool = False, linear: bool = False
) -> dict[str, list[tuple[str, int, int, str]]]:
    """Target name -> (module, in, out features, the tensor it reads) of the linear layers it matches in one block
    (`moe`: a mixture-of-experts block, whose MLP projections are only its shared experts'; the routed experts are
    3-D parameters, not linear layers; `linear`: a linear-attention block, whose projections replace q, k, v and o).
    Modules that read one tensor (q, k and v read the attention's normed input) name the same one. A name the other
    kind of block has maps to no module here (peft adapts what each block holds)."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":  # Conv1D layers; `c_proj` is the suffix of both projections
        attn, mlp = ("attn.c_proj", h, h, "attn_out"), ("mlp.c_proj", i, h, "mlp_act")
        return {
            "c_attn": [("c_attn", h, 3 * h, "attn_in")],
            "c_fc": [("c_fc", h, i, "mlp_in")],
            "c_proj": [attn, mlp],
            "attn.c_proj": [attn],
            "mlp.c_proj": [mlp],
        }
    q, kv = shape.q_width, shape.kv_width  # heads x head_dim, and the grouped-query k/v width
    if moe:
        i = shape.shared_intermediate
    if shape.fused_projections:  # Phi-3: one projection for q, k and v, one for the MLP's gate and up
        shapes = {"qkv_proj": (h, q + 2 * kv, "attn_in"), "o_proj": (q, h, "attn_out"),
                  "gate_up_proj": (h, 2 * i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    elif shape.mla:  # DeepSeek-V2's latent attention: q (or its low-rank pair), the k/v latent and its expansion
        q_rank, kv_rank, nope, rope, v = shape.mla
        attn = {"q_a_proj": (h, q_rank, "attn_in"), "q_b_proj": (q_rank, q, "q_latent")} if q_rank else {
            "q_proj": (h, q, "attn_in")}  # fmt: skip
        shapes = {**attn, "kv_a_proj_with_mqa": (h, kv_rank + rope, "attn_in"),
                  "kv_b_proj": (kv_rank, shape.heads * (nope + v), "kv_latent"),
                  "o_proj": (shape.heads * v, h, "attn_out"), "gate_proj": (h, i, "mlp_in"),
                  "up_proj": (h, i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    else:
        shapes = {"q_proj": (h, q * (2 if shape.gated_attention else 1), "attn_in"), "k_proj": (h, kv, "attn_in"),
                  "v_proj": (h, kv, "attn_in"), "o_proj": (q, h, "attn_out"), "gate_proj": (h, i, "mlp_in"),
                  "up_proj": (h, i, "mlp_in"), "down_proj": (i, h, "mlp_act")}  # fmt: skip
    if shape.linear:  # Gated DeltaNet's projections in its layers, softmax attention's in the others
        key, value = shape.linear_widths
        on = {"in_proj_qkvz": (h, 2 * key + 2 * value, "attn_in"), "in_proj_ba": (h, 2 * shape.linear[1], "attn_in"),
              "out_proj": (value, h, "linear_out")}  # fmt: skip
        off = ("q_proj", "k_proj", "v_proj", "o_proj")
        shapes |= {n: on[n] if linear else (0, 0, "") for n in on} | {n: (0, 0, "") for n in off if linear}
    if shape.moe:  # the routed experts' 3-D parameters (peft's target_parameters): rank r per expert, E x (in + out)
        e, ie = (shape.experts, shape.expert_intermediate) if moe else (0, 0)
        shapes |= {"experts.gate_up_proj": (e * h, e * 2 * ie, "experts"),
                   "experts.down_proj": (e * ie, e * h, "experts")}  # fmt: skip
    return {name: [(name, fin, fout, reads)] if fin and fout else [] for name, (fin, fout, reads) in shapes.items()}


def _lora_targets(
    shape: ModelShape, lora: LoraShape, moe: bool = False, linear: bool = False
) -> set[tuple[str, int, int, str]]:
    """The modules of one block (a MoE block with `moe`, a linear-attention one with `linear`) that `lora` adapts (a
    set: `c_proj` + `mlp.c_proj` count once); ConfigError naming the targets this family has when one is unknown."""
    table = _lora_modules(shape, moe, linear)
    unknown = [t for t in lora.targets if t not in table]
    if unknown or not lora.targets or lora.rank < 1:
        raise ConfigError(
            f"LoRA rank {lora.rank} with targets {list(lora.targets)}: rank must be >= 1 and targets "
            f"non-empty, from {', '.join(table)} for a {_family(shape).replace('phi3', 'Phi-3')} model"
        )
    return {m for t in lora.targets for m in table[t]}


def _per_layer(shape: ModelShape, value: Callable[[bool, bool], float]) -> float:
    """`value(moe, linear)` summed over the layers of each kind: dense or mixture of experts, softmax or linear
    attention."""
    return sum(count * value(*kind) for kind, count in shape.layer_kinds().items())


def trainable_params(shape: ModelShape, lora: LoraShape | None) -> int:
    """Trainable parameters: all of them, or sum over layers and target modules of r*(in+out)."""
    if lora is None:
        return shape.params
    return int(_per_layer(shape, lambda moe, linear: sum(lora.rank * (fin + fout) for _, fin, fout, _ in
                                                         _lora_targets(shape, lora, moe, linear))))  # fmt: skip


def _block_params(shape: ModelShape, layer: int) -> int:
    """Parameters of layer `layer`'s block (0-based; -1 the last), every one of its experts included (FSDP2 gathers a
    block whole)."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":
        return 4 * h * h + 2 * h * i + 9 * h + i
    return shape.block_params_at(layer)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU (and on the host for offload tiers) at one micro-batch, term by term."""

    tier: str
    micro_batch: int
    checkpointing: bool
    trainable_params: int
    weights: int  # parameters as stored (shards on FSDP tiers)
    gradients: int  # fp32 gradients (shards on FSDP tiers)
    optimizer: int  # AdamW's m and v on the GPU (0 when offloaded)
    buckets: int  # DDP's fp32 all-reduce buckets
    working_weights: int  # 16-bit weights made for compute: autocast copies, FSDP2's gathers
    activations: int  # all transformer layers
    logits: int  # the chunked loss: saved final hidden states, labels, log-sum-exp, one chunk of logits
    overhead: int  # context, workspaces, fragmentation
    host: int  # per rank: offloaded optimizer state, fp32 grads, params (0 without offload)

    @property
    def states(self) -> int:
        """What does not grow with the micro-batch: weights, gradients, optimizer, buckets, working weights."""
        return self.weights + self.gradients + self.optimizer + self.buckets + self.working_weights

    @property
    def gpu_bytes(self) -> int:
        return self.states + self.activations + self.logits + self.overhead

    def breakdown(self) -> dict[str, int]:
        """The named terms; they sum to `gpu_bytes`."""
        keys = ("weights", "gradients", "optimizer", "buckets", "working_weights", "activations", "logits", "overhead")
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class _States:
    weights: int
    gradients: int
    optimizer: int
    buckets: int
    working: int
    host: int
    trainable: int


def optimizer_bytes(shape: ModelShape, lora: LoraShape | None, optimizer: str, params: int, shards: int) -> int:
    """The optimizer's GPU bytes for `params` trainable parameters split over `shards` ranks (1: not sharded): AdamW's
    fp32 m and v, adamw_8bit's 8-bit ones and its step's working copies of the largest parameter's shard, or nothing
    (sgd: its fused step writes the parameters in place)."""
    if optimizer == "adamw":
        return ADAM_BYTES * params // shards
    if optimizer == "sgd":
        return 0
    if optimizer != "adamw_8bit":
        raise ConfigError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}")
    working = LOW_BIT_STEP_BYTES * largest_trainable(shape, lora) // shards
    return LOW_BIT_NUM * params // (LOW_BIT_DEN * shards) + working


def optimizer_change(shape: ModelShape, tier: str, world_size: int, lora: LoraShape | None, quantize: str | None,
                     optimizer: str) -> int:  # fmt: skip
    """GPU bytes `optimizer` holds at `tier` beyond AdamW (negative: fewer): what corrects a trace of the AdamW step."""
    base = base_quantization(quantize, lora)
    with_it = _states(shape, tier, world_size, lora, base, optimizer).optimizer
    return with_it - _states(shape, tier, world_size, lora, base).optimizer


def largest_trainable(shape: ModelShape, lora: LoraShape | None) -> int:
    """Values in the largest trainable tensor: the embedding, an MLP projection, a layer's fused routed experts (3-D,
    gate and up together); under LoRA an adapter's larger factor."""
    widths = [shape.hidden, shape.intermediate, shape.q_width, shape.kv_width]
    if lora is not None:
        return lora.rank * max(widths)
    experts = shape.experts * 2 * shape.expert_intermediate * shape.hidden
    return max(shape.vocab * shape.hidden, shape.intermediate * shape.hidden * 2 if shape.fused_projections else 0,
               shape.intermediate * shape.hidden, experts)  # fmt: skip


def _states(
    shape: ModelShape, tier: str, world_size: int, lora: LoraShape | None, quantize: str | None = None,
    optimizer: str = "adamw",
) -> _States:
    """The model states of `tier` on one GPU and on the host (per rank), as the table in the module docstring.

    zero2_offload is what runner/train/engine.py builds: FSDP2 (reshard_after_forward=False, 16-bit mixed
    precision) with Adam through torchao's CPUOffloadOptimizer, which keeps a pinned fp32 copy of each
    shard and of its gradient and Adam's m and v on the host; FSDP2's own fp32 shard (the all-gather's
    source) and gradient shard stay on the GPU. tests/runner/train/test_offload.py counts these bytes on
    real tensors. Several ranks accumulating over micro-batches without gradient sync hold unsharded fp32
    gradients (4t) until the last one, which this does not count. `quantize` (LoRA): the blocks' linear layers of the
    frozen base in 4 bits (jobspec/plan/quantize.py), held, sharded and gathered so. `optimizer`: the spec's
    `training.optimizer` (`optimizer_bytes`), on the tiers whose optimizer is on the GPU.
    """
    t = trainable_params(shape, lora)
    w = shape.params + (t if lora else 0)  # weights held: base (frozen with LoRA) + adapters
    f, n = w - t, world_size
    saved = quantized_saving(shape, quantize)  # bytes the 4-bit blocks save against 16 bits
    if tier == "fast":
        buckets = DDP_BUCKET_BYTES * t if n > 1 else 0
        weights = MASTER_BYTES * t + FROZEN_BYTES * f - saved
        return _States(weights, GRAD_BYTES * t, optimizer_bytes(shape, lora, optimizer, t, 1), buckets, HALF_BYTES * t,
                       0, t)  # fmt: skip
    pad = fsdp_padding(shape, n)  # the experts' rows FSDP2 pads its shards with: trained, or frozen under LoRA
    ts, fs = (t + pad, f) if lora is None else (t, f + pad)
    shards = (MASTER_BYTES * ts + FROZEN_BYTES * fs - saved) // n
    grads, adam = GRAD_BYTES * ts // n, optimizer_bytes(shape, lora, optimizer, ts, n)
    # the host's fp32 shard, gradient and Adam's moments; SGD has no moments (and zero2_offload, which offloads only
    # the optimizer, then nothing: runner/train/engine.py `offload_optimizer`)
    host_offload = (HOST_TRAINABLE_BYTES - (ADAM_BYTES if optimizer == "sgd" else 0)) * ts // n
    # FSDP2 tiers: what stays gathered the whole step (every weight in 16 bits where forward does not reshard);
    # the module gathered at the peak, and its gradient, depend on the moment (_fsdp_peak)
    kept = HALF_BYTES * w - gathered_saving(shape, quantize, n) if tier in ("zero2", "zero2_offload") else 0
    if tier == "zero2":
        return _States(shards, grads, adam, 0, kept, 0, t)
    if tier == "zero2_offload":
        return _States(shards, grads, 0, 0, kept, 0 if optimizer == "sgd" else host_offload, t)
    if tier == "zero3":
        return _States(shards, grads, adam, 0, kept, 0, t)
    tier_index(tier)  # raises for unknown names
    # minimal: shards, gradients and the optimizer on the host; the GPU keeps only the gathered modules (and on one
    # rank a 4-bit base's linear layers, which FSDP2 leaves alone there: runner/model/quantize.py)
    whole = quantized_params(shape, quantize) * 2 - saved if n == 1 else 0
    return _States(whole, 0, 0, 0, kept, host_offload + (FROZEN_BYTES * fs - saved) // n - whole, t)


def fsdp_padding(shape: ModelShape, world_size: int) -> int:
    """Parameters FSDP2 adds to the shards by padding each tensor's first dimension to a multiple of the ranks:
    noticeable only where that dimension is a mixture-of-experts layer's expert count (the routed experts' 3-D
    weights and biases, the router's rows), which need not divide by the ranks: Qwen1.5-MoE's 60 experts on 8 ranks
    are sharded as 64 (traced: 7.05 GiB of shards where 14.3 B parameters make 6.67; the plan was 5 % under at zero3).
    Every other tensor's first dimension is a width, a multiple of 8 in every published shape (0 on one rank)."""
    if not shape.moe or world_size <= 1:
        return 0
    rows = -shape.experts % world_size
    h, e, bias = shape.hidden, shape.expert_intermediate, shape.expert_bias
    per_expert = h + (1 if bias else 0) + 3 * h * e + ((2 * e + h) if bias else 0)  # router row, weights, biases
    return shape.moe_layers * rows * per_expert


def _fsdp_peak(
    shape: ModelShape,
    tier: str,
    world_size: int,
    lora: LoraShape | None,
    *,
    acts: int,
    loss_hidden: int,
    chunk: int,
    recompute: int,
    kept: int = 0,
    quantize: str | None = None,
) -> tuple[int, int, int]:
    """(gathered weights and gradients beyond what `_states` keeps, activations, loss bytes) at the largest of the
    five moments an FSDP2 step peaks at (traced; bench/memory_model.py), `acts` the activations forward saves:

    - forward, at the loss: the output layer gathered (16-bit weights, and an untied head's all-gather buffer; a tied
      embedding lives in the root unit), the fused loss's 16-bit gradient of it, the loss's hidden states and chunk,
      and where forward reshards, the last block's all-gather buffer, prefetched for backward;
    - backward, at the output layer: the same gather and the head's gradient, reduce-scattered in fp32 (a tied
      embedding's stays 16-bit); a fully trained tied embedding shares its unit with the final norm (accelerate's
      tail unit), which reshards after the output layer's backward and is gathered again for the norm's: its
      all-gather buffer and the copied-out weights are alive together, beside every saved activation;
    - backward, at the last block (the first run, every activation saved) and at the first (one layer's left, the
      root's embedding gathered ahead: `_block_gathers`): the block gathered, its gradient reduce-scattered in fp32,
      with activation checkpointing the block being recomputed; a tied embedding's 16-bit gradient;
    - the end of backward: the root unit's embedding gathered, its 16-bit gradient and the fp32 copy that is
      reduce-scattered, the activations gone (the peak of a tied embedding too large for its few blocks); of the
      16-bit weights forward kept gathered (`kept`, zero2's) only the root's are left by then, none on one rank.

    Without resharding after forward (zero2, zero2_offload) every weight is gathered already: only the buffers
    come on top. With LoRA the frozen base has no gradients; the adapters' are small and left out. A 4-bit base
    (`quantize`) gathers its blocks' linear layers in 4 bits: `block` counts them at their 16-bit equivalent."""
    head, half = shape.vocab * shape.hidden, HALF_BYTES
    tied, reshard, full = shape.tie_embeddings, tier in ("zero3", "minimal"), lora is None
    buffer = half if world_size > 1 else 0  # one rank gathers nothing: its 16-bit copy is the unsharded module
    reduced = GRAD_BYTES if full else 0  # a module's gradient, reduce-scattered in fp32
    # On one rank the reduce-scatter's output is a whole fp32 copy of the gradient beside its fp32 input (and, for
    # `minimal`, on the device until copied to the host); on more ranks the 16-bit gradient is freed before the output
    # shard (4/N bytes a parameter, no more than its 2) is made, so the input's moment is the larger one (traced).
    # The embedding's and an untied head's are the large ones.
    offloaded = GRAD_BYTES * head if full and world_size == 1 else 0
    gather_head = (half * head if reshard else 0) + (0 if tied else buffer * head)
    head_grad = half * head if full else 0  # made by the fused loss in forward
    saving = gathered_saving(shape, quantize, world_size) // (HALF_BYTES * shape.layers)
    pad = fsdp_padding(shape, world_size) // max(1, shape.moe_layers)

    def at(layer: int) -> tuple[int, int, int]:
        """Layer `layer`'s block: (its parameters, what its all-gather buffer holds (FSDP2 pads a MoE block's experts),
        its gradients at its backward). Backward runs the last layer first and layer 0 last; in a model whose dense
        and MoE layers alternate (Llama 4 Maverick) the block gathered ahead of the last one is a dense one."""
        moe = shape.moe_at(layer)
        block = _block_params(shape, layer) - saving
        padded = block + (pad if moe else 0)
        grads = reduced * padded + (head_grad if tied else 0)
        if full and moe:  # the routed experts' weight gradient leaves the grouped matmul transposed: a 16-bit copy
            grads += HALF_BYTES * shape.experts * 3 * shape.hidden * shape.expert_intermediate  # of all of them
        return block, padded, grads

    (last_block, padded, block_grads), ahead, (first_block, _, first_grads) = at(-1), at(-2), at(0)
    last, first = _block_gathers(head, first_block, kept, tied=tied, reshard=reshard, full=full, buffer=buffer,
                                 ahead=ahead[:2])  # fmt: skip
    # the end: the root's embedding gathered again where forward reshards, a tied root's last block still reducing
    end = (half * head if reshard and world_size > 1 else 0) + (reduced * first_block if world_size > 1 and tied else 0)
    end -= 0 if reshard else _end_kept(kept, half * head, world_size)
    # the last block's all-gather, issued for backward at the loss; not with an untied frozen output layer (LoRA), whose
    # unit backward does not run (traced: 2-layer Phi-3, Mistral, Qwen2.5-7B, 4-layer Llama with LoRA at micro-batch 1
    # were 3-21 % over with it, within 2.3 % without)
    prefetch = buffer * padded if reshard and (full or tied) else 0
    # a tied tail (final norm, embedding, output layer) gathered again for the norm's backward, after resharding at the
    # output layer's: during the copy-out its all-gather buffer is alive beside its weights (traced: gemma-2b and
    # gemma-2-2b at zero2_offload, 8 ranks, peaked there 0.60 GiB above the loss, whatever the micro-batch, sequence
    # length or rank count; FSDP2 frees a backward all-gather's buffer only after the copy-out, on a GPU too)
    regather = buffer * head if tied and full else 0
    moments = (
        (gather_head + head_grad + prefetch, acts, loss_hidden + chunk),
        (gather_head + (head_grad + regather if tied else reduced * head + offloaded), acts, loss_hidden),
        (last + block_grads, acts + recompute, 0),
        # where forward reshards, during the last block's own backward: it is gathered beside the one prefetched
        # after it; full fine-tuning's fp32 gradient moment above is larger, a frozen base's (LoRA) has none (traced:
        # Mixtral, Qwen3-30B-A3B and Qwen3-Next LoRA at zero3, 8 ranks, micro-batch 1, were 0.90-0.93 without it,
        # 1.03-1.04 with it; at micro-batch 4 1.03-1.10, Mixtral at minimal 0.78 -> 1.08: over, where it was under)
        (last + (HALF_BYTES * last_block if reshard else 0), acts + recompute, 0),
        (first + first_grads, acts // max(1, shape.layers) + recompute, 0),  # one layer's saved inputs left
        (end + (head_grad + reduced * head + offloaded if full else 0), 0, 0),
    )  # fmt: skip
    return tuple(int(x) for x in max(moments, key=sum))  # type: ignore[return-value]


def _end_kept(kept: int, embedding: int, world_size: int) -> int:
    """What zero2's kept weights have shed by the end of backward: every block resharded after its backward; on one
    rank the root too (traced)."""
    return kept if world_size == 1 else max(0, kept - embedding)


def _block_gathers(
    head: int, first_block: int, kept: int, *, tied: bool, reshard: bool, full: bool, buffer: int,
    ahead: tuple[int, int],
) -> tuple[int, int]:
    """16-bit weights gathered beyond `kept` (what forward left gathered: zero2's) at the last block's backward (the
    first one run, all activations saved) and at the first block's (the last one run, one layer's left), traced:

    - where forward reshards, each block is gathered again (its parameters and the all-gather buffer); at the first
      block the root's embedding is all-gathered ahead into a buffer, for the embedding's backward;
    - where it does not, nothing needs gathering until the root: an untied output layer has resharded after its own
      backward, and so has a fully trained tied embedding's root (its gradient came from the output layer), which
      the first block's backward then gathers ahead again; every other block reshards after its backward.

    At the last block's gradients, where forward reshards, the block itself has resharded and the one backward runs
    next (the one before it in the model) is gathered: `ahead`, its parameters and what its all-gather buffer holds
    (with FSDP2's padding, `fsdp_padding`). Traced on Llama 4 Maverick, whose layers alternate: a dense block is
    gathered while an MoE block's gradients reduce (0.59 GiB of unsharded parameters beside 60.7 GiB reduced). At
    the first block, `first_block` and the root's embedding gathered ahead."""
    if reshard:
        return HALF_BYTES * ahead[0] + buffer * ahead[1], HALF_BYTES * first_block + buffer * head
    root_kept = not (tied and full)
    last = -HALF_BYTES * head * ((not tied) + (not root_kept))
    return last, HALF_BYTES * first_block + (HALF_BYTES * head if root_kept else buffer * head) - kept


def residual_bytes(tier: str, precision: str, lora: LoraShape | None = None) -> int:
    """Width of the residual stream: fp32 under autocast over fp32 weights (`fast`) or in fp32 training;
    16 bits under FSDP2's mixed precision, which gathers the weights in 16 bits, and over LoRA's 16-bit base."""
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"unknown precision {precision!r}; expected bf16, fp16 or fp32")
    if precision == "fp32":
        return 4
    return 4 if tier == "fast" and lora is None else 2


def _family(shape: ModelShape) -> str:
    """The block the activation coefficients were traced on: gpt2, phi3 (fused projections) or llama."""
    if shape.family == "gpt2":
        return "gpt2"
    return "phi3" if shape.fused_projections else "llama"


def _layer_bytes(
    shape: ModelShape, tier: str, precision: str, lora: LoraShape | None, linear: bool | None = None
) -> float:
    """Activation bytes one layer saves per token (sdpa), from the traced coefficients: the mean over the layers of a
    mixture-of-experts or linear-attention model, whose MoE layers have their experts' instead of a dense MLP's and
    whose linear-attention layers their own (`linear` True or False: the mean over the layers of that attention)."""
    if not shape.moe and not shape.linear:
        return _kind_bytes(shape, tier, precision, lora, moe=False)
    kinds = {kind: n for kind, n in shape.layer_kinds().items() if linear in (None, kind[1])}
    return sum(n * _kind_bytes(shape, tier, precision, lora, *kind) for kind, n in kinds.items()) / sum(kinds.values())


def _linear_bytes(shape: ModelShape, tier: str, precision: str, lora: LoraShape | None) -> float:
    """Bytes a linear-attention layer's attention keeps per token (LINEAR_ACT_BYTES), without its MLP."""
    _, heads, k_dim, v_dim, _ = shape.linear  # type: ignore[misc]
    key, value = shape.linear_widths
    widths = (shape.hidden, key, value, heads * k_dim, heads * LINEAR_CHUNK, heads * k_dim * v_dim / LINEAR_CHUNK)
    c = LINEAR_ACT_BYTES[(tier == "fast" and precision != "fp32", lora is not None)]
    return sum(a * w for a, w in zip(c, widths, strict=True))


def _kind_bytes(
    shape: ModelShape, tier: str, precision: str, lora: LoraShape | None, moe: bool, linear: bool = False
) -> float:
    """`_layer_bytes` of a dense layer, or of a MoE layer (`moe`): the dense coefficients with the shared experts'
    width for the MLP's, and per routed token MOE_ROUTED_BYTES (the gathered input, the experts' projections); of a
    linear-attention layer (`linear`): the dense coefficients without the attention's q and kv terms, and
    `_linear_bytes` for its attention."""
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
) -> int:
    per_token = _layer_bytes(shape, tier, precision, lora)
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
    skipped = sum(_kind_bytes(shape, tier, precision, lora, shape.moe_at(i), shape.linear_at_layer(i))
                  for i in range(prefix))  # fmt: skip
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
               lora: LoraShape | None) -> int:  # fmt: skip
    """Bytes of the layer that checkpointing recomputes in backward: its activations and the gradients through it."""
    kind = "full" if lora is None else "lora_mlp" if MLP_TARGETS & set(lora.targets) else "lora"
    c_h, c_i = RECOMPUTE_GRAD_BYTES[kind]
    # the layer recomputed is one of either attention where a model has both: the larger
    kinds = (False, True) if shape.linear else (None,)
    layer = max(_layer_bytes(shape, tier, precision, lora, linear) for linear in kinds)
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


def _loss_bytes(
    shape: ModelShape, tier: str, tokens: int, precision: str, lora: LoraShape | None, kernel: LossKernel
) -> int:
    """`fast`'s loss: its parts, and the fused loss's fp32 gradient of the output layer with autocast's copy."""
    kept, chunk = _loss_parts(shape, tier, tokens, precision, lora, kernel)
    head = 0
    if tokens and lora is None:
        head = shape.vocab * shape.hidden * (MASTER_BYTES + (0 if precision == "fp32" else HALF_BYTES))
    return kept + chunk + head


def estimate(
    shape: ModelShape,
    *,
    tier: str,
    seq_len: int,
    micro_batch: int,
    world_size: int,
    lora: LoraShape | None = None,
    checkpointing: bool | None = None,
    attention: Attention = "sdpa",
    precision: Precision = "bf16",
    sample_scale: float = 1.0,
    grad_accum: int = 2,
    packed: bool = False,
    loss_kernel: LossKernel = "chunked",
    quantize: str | None = None,
    rows: int = 1,
    sampling: bool = False,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Bytes one GPU needs to train `shape` at `tier` over `world_size` data-parallel ranks.

    `sample_scale` corrects the per-sample bytes (activations and logits) by what a run measured
    (jobspec/plan/calibration.py); 1.0 is the model as derived. `grad_accum`: micro-batches per optimizer step.
    When it accumulates (2 or more), the gradients of the earlier micro-batches are alive at the activations'
    peak; with one micro-batch a step they are not yet, and the step peaks at whichever is larger, the
    activations and loss or, after backward, the gradients: `gradients` is then only what they add beyond.
    `packed`: rows of several records (`data.packing`), whose attention mask sdpa then holds whole.
    `loss_kernel`: `training.loss_kernel`, which sizes the cross-entropy's chunk. `quantize`: the LoRA base's blocks
    in 4 bits ("nf4"; "auto" is the 16-bit base here, `plan_tier` tries both). `rows`: sequences a sample is (a DPO
    pair is 2, its chosen and rejected rows in one micro-batch). `sampling`: the micro-batch's rows are first sampled
    by the model (GRPO), whose KV cache then stands where the activations will (`sampling_bytes`): the larger of the
    two is counted, and the whole of the states beside it (the gradients, freed while it samples, too: the safe
    side). `optimizer`: `training.optimizer` (`optimizer_bytes`; "auto" counts AdamW, `plan_tier` decides)."""
    if seq_len < 1 or micro_batch < 0 or world_size < 1 or rows < 1:
        raise ConfigError(
            f"seq_len {seq_len}, micro_batch {micro_batch}, world_size {world_size}: "
            "need seq_len >= 1, micro_batch >= 0, world_size >= 1"
        )
    ckpt = CHECKPOINTING[TIERS[tier_index(tier)]] if checkpointing is None else checkpointing
    quantize = base_quantization(quantize, lora)
    optimizer = "adamw" if optimizer == "auto" else optimizer  # AdamW first; plan_tier decides 8-bit per tier
    st = _states(shape, tier, world_size, lora, quantize, optimizer)
    tokens = seq_len * micro_batch * rows
    acts = _activations(shape, tier, tokens, seq_len, ckpt, attention, precision, lora)
    recompute = _recompute(shape, tier, tokens, seq_len, attention, precision, lora) if ckpt else 0
    working = st.working
    if tier == "fast":
        logits = _loss_bytes(shape, tier, tokens, precision, lora, loss_kernel)
        acts += max(0, recompute - logits)  # the recomputed layer, where it outgrows the loss's peak
    else:
        kept, chunk = _loss_parts(shape, tier, tokens, precision, lora, loss_kernel)
        gathered, acts, logits = _fsdp_peak(shape, tier, world_size, lora, acts=acts, loss_hidden=kept, chunk=chunk,
                                            recompute=recompute, kept=st.working, quantize=quantize)  # fmt: skip
        working += gathered
    if packed and attention == "sdpa":  # the block-diagonal mask, and each layer's saved copy of it
        per_pair = PACKED_MASK_CHECKPOINTED_BYTES if ckpt else shape.layers * PACKED_MASK_LAYER_BYTES[_family(shape)]
        acts += int(per_pair * micro_batch * rows * seq_len * seq_len)
    acts, logits = int(acts * sample_scale), int(logits * sample_scale)
    if sampling:
        acts = max(acts, sampling_bytes(shape, tokens, micro_batch * rows, precision) - logits)
    grads = st.gradients if grad_accum > 1 else max(0, st.gradients - acts - logits)
    states = st.weights + grads + st.optimizer + st.buckets + working
    overhead = overhead_bytes(states + acts + logits)
    return MemoryEstimate(tier, micro_batch, ckpt, st.trainable, st.weights, grads, st.optimizer, st.buckets,
                          working, acts, logits, overhead, st.host)  # fmt: skip


def sampling_bytes(shape: ModelShape, tokens: int, sequences: int, precision: str) -> int:
    """What sampling `sequences` rows of `tokens` in all holds besides the model (transformers' `generate`, a dynamic
    cache): every softmax-attention layer's keys and values at the compute width (an upper bound for sliding-window
    layers), every linear-attention layer's fp32 recurrent state and convolution window per sequence, and the last
    position's fp32 logits with the sampler's noise beside them (runner/rl/sampling.py)."""
    width = 4 if precision == "fp32" else 2
    recurrent = 0
    if shape.linear:
        _, v_heads, k_dim, v_dim, conv = shape.linear
        key, value = shape.linear_widths
        recurrent = len(shape.linear_at) * sequences * (4 * v_heads * k_dim * v_dim + width * (2 * key + value) * conv)
    return (shape.attention_layers * 2 * shape.kv_width * width * tokens + recurrent
            + sequences * shape.vocab * 4 * 3)  # fmt: skip


@dataclass(frozen=True)
class TierPlan:
    """What one tier gives on one GPU: the micro-batch, its accumulation, and the memory."""

    tier: str
    useful: bool  # False: skipped by `auto` (reason says why) but still reported
    reason: str  # why not useful / why it does not fit; "" when it fits and is useful
    fits: bool  # micro_batch >= 1 (the spec's micro-batch, when fixed, within the budget)
    max_micro_batch: int  # largest that fits the budget, before rounding to a divisor
    micro_batch: int  # largest divisor of the per-rank batch <= max_micro_batch, 0 if none fits; or the spec's
    grad_accum: int  # global_batch / (micro_batch * world_size); 0 if none fits (auto)
    budget: int  # utilization * gpu_bytes
    estimate: MemoryEstimate  # at micro_batch (at 1 when nothing fits, to show the shortfall)
    fixed: bool = False  # micro_batch is the spec's `training.micro_batch`, not the model's choice
    quantize: str | None = None  # the LoRA base's blocks in 4 bits ("nf4"), as planned; None: 16 bits
    note: str = ""  # a choice made beyond the tier and micro-batch (`model.quantize: auto`), with its numbers
    optimizer: str = "adamw"  # the optimizer's states as planned at this tier (`training.optimizer: auto` decides)

    @property
    def margin(self) -> int:
        """Budget left at the micro-batch shown (negative: short by that much)."""
        return self.budget - self.estimate.gpu_bytes


def plan_tier(
    shape: ModelShape,
    *,
    tier: str,
    gpu_bytes: int,
    global_batch: int,
    world_size: int,
    seq_len: int,
    utilization: float = 0.9,
    lora: LoraShape | None = None,
    checkpointing: bool | None = None,
    attention: Attention = "sdpa",
    precision: Precision = "bf16",
    sample_scale: float = 1.0,
    micro_batch: int | None = None,
    packed: bool = False,
    loss_kernel: LossKernel = "chunked",
    quantize: str | None = None,
    rows: int = 1,
    sampling: bool = False,
    optimizer: str = "adamw",
) -> TierPlan:
    """The largest micro-batch at `tier` that fits `utilization * gpu_bytes` and divides the per-rank batch,
    or, with `micro_batch` (the spec's fixed one), whether that one fits and by how much.

    `quantize` "auto" (`model.quantize: auto`, LoRA): the 16-bit base where it fits, else the 4-bit one where that
    fits (`TierPlan.quantize` says which, and its reason why); "nf4": the 4-bit base.

    `gpu_bytes` is the memory one GPU gives the job: the card's total before submit, the probed free
    memory in the pod. The effective batch never changes: grad_accum * micro_batch * world_size ==
    global_batch exactly.
    """
    if global_batch < 1 or world_size < 1 or global_batch % world_size:
        raise ConfigError(f"global_batch {global_batch} must be a positive multiple of world_size {world_size}")
    if not 0 < utilization <= 1:
        raise ConfigError(f"utilization {utilization} must be in (0, 1]")
    per_rank = global_batch // world_size
    if micro_batch is not None and (micro_batch < 1 or per_rank % micro_batch):
        raise ConfigError(f"micro_batch {micro_batch} does not divide the per-rank batch {per_rank}")
    # the `auto` settings decide here, each planning the tier again with its choices (a keyword at the call wins)
    again = partial(plan_tier, shape, tier=tier, gpu_bytes=gpu_bytes, global_batch=global_batch, world_size=world_size,
                    seq_len=seq_len, utilization=utilization, lora=lora, checkpointing=checkpointing,
                    attention=attention, precision=precision, sample_scale=sample_scale, micro_batch=micro_batch,
                    packed=packed, loss_kernel=loss_kernel, quantize=quantize, rows=rows,
                    sampling=sampling)  # fmt: skip
    if optimizer == "auto":
        return _plan_auto_optimizer(again, tier)
    if tier in HOST_OPTIMIZER_TIERS and optimizer != "sgd":  # their host AdamW keeps fp32 moments
        optimizer = "adamw"
    if quantize == "auto" and lora is not None:
        return _plan_auto_base(partial(again, optimizer=optimizer))
    quantize = base_quantization(quantize, lora)
    budget = int(utilization * gpu_bytes)
    est = partial(
        estimate,
        shape,
        tier=tier,
        seq_len=seq_len,
        world_size=world_size,
        lora=lora,
        checkpointing=checkpointing,
        attention=attention,
        precision=precision,
        sample_scale=sample_scale,
        packed=packed,
        loss_kernel=loss_kernel,
        quantize=quantize,
        rows=rows,
        sampling=sampling,
        optimizer=optimizer,
    )

    def at(m: int) -> MemoryEstimate:  # at micro-batch m, accumulating unless m is the whole per-rank batch
        return est(micro_batch=m, grad_accum=max(1, per_rank // m) if m else 2)

    one = at(1)
    top = _largest_fitting(lambda m: est(micro_batch=m).gpu_bytes <= budget)  # accumulating: monotone in m
    if top < per_rank and at(per_rank).gpu_bytes <= budget:  # one micro-batch a step: no gradients alongside
        top = per_rank
    useful = not (world_size == 1 and tier in SHARD_ONLY)
    reason = "" if useful else "one rank: sharding saves nothing, use fast"
    gib = 1024**3
    if micro_batch is not None:
        need = at(micro_batch)
        fits = need.gpu_bytes <= budget
        if not fits:
            short = (need.gpu_bytes - budget) / gib
            reason = reason or (
                f"micro-batch {micro_batch} (spec) needs {need.gpu_bytes / gib:.1f} GiB, budget {budget / gib:.1f} "
                f"GiB: {short:.1f} GiB short (largest that fits: {top})"
            )
        return TierPlan(tier, useful, reason, fits, top, micro_batch, per_rank // micro_batch, budget, need, fixed=True,
                        quantize=quantize, optimizer=optimizer)  # fmt: skip
    mbs = max((d for d in divisors(per_rank) if d <= top), default=0)
    if not mbs:
        reason = reason or f"needs {one.gpu_bytes / gib:.1f} GiB at micro-batch 1, budget {budget / gib:.1f} GiB"
    return TierPlan(
        tier,
        useful,
        reason,
        mbs > 0,
        top,
        mbs,
        per_rank // mbs if mbs else 0,
        budget,
        at(mbs) if mbs else one,
        quantize=quantize,
        optimizer=optimizer,
    )


def _plan_auto_base(plan: Callable[..., TierPlan]) -> TierPlan:
    """`model.quantize: auto` at one tier: the 16-bit base where it fits, else the 4-bit base where that fits (its
    reason says so, with both figures); the 16-bit plan when neither fits."""
    return _auto_choice(plan(quantize=None), lambda: plan(quantize="nf4"), "quantize auto -> nf4",
                        "the 16-bit base needs", "the 4-bit one")  # fmt: skip


def _plan_auto_optimizer(plan: Callable[..., TierPlan], tier: str) -> TierPlan:
    """`training.optimizer: auto` at one tier: AdamW's fp32 moments where they fit, else 8-bit ones where those fit,
    before any offloading (its note says so, with both figures); AdamW at the offload tiers (host moments)."""
    if tier in HOST_OPTIMIZER_TIERS:
        return plan(optimizer="adamw")
    return _auto_choice(plan(optimizer="adamw"), lambda: plan(optimizer="adamw_8bit"), "optimizer auto -> adamw_8bit",
                        "AdamW's fp32 moments need", "8-bit ones")  # fmt: skip


def _auto_choice(plain: TierPlan, other: Callable[[], TierPlan], choice: str, plain_words: str,
                 other_words: str) -> TierPlan:  # fmt: skip
    """An `auto` setting at one tier: `plain` where it fits, else `other()` where that fits, its note saying so with
    both figures (after any note it has); `plain` when neither fits."""
    if plain.fits:
        return plain
    alt = other()
    if not alt.fits:
        return plain
    gib = 1024**3
    why = (f"{choice}: {plain_words} {plain.estimate.gpu_bytes / gib:.1f} GiB at micro-batch "
           f"{max(1, plain.micro_batch)}, {other_words} {alt.estimate.gpu_bytes / gib:.1f} GiB at {alt.micro_batch}")
    return replace(alt, note="; ".join(filter(None, (alt.note, why))))


def plan_all(
    shape: ModelShape,
    *,
    gpu_bytes: int,
    global_batch: int,
    world_size: int,
    seq_len: int,
    utilization: float = 0.9,
    lora: LoraShape | None = None,
    checkpointing: bool | None = None,
    attention: Attention = "sdpa",
    precision: Precision = "bf16",
    sample_scale: dict[str, float] | None = None,
    micro_batch: int | None = None,
    packed: bool = False,
    loss_kernel: LossKernel = "chunked",
    quantize: str | None = None,
    rows: int = 1,
    sampling: bool = False,
    optimizer: str = "adamw",
) -> list[TierPlan]:
    """`plan_tier` for every tier, in TIERS order (cheapest first); `sample_scale`: measured corrections by tier;
    `micro_batch`: the spec's fixed micro-batch (each tier then says whether it fits)."""
    return [
        plan_tier(
            shape,
            tier=t,
            gpu_bytes=gpu_bytes,
            global_batch=global_batch,
            world_size=world_size,
            seq_len=seq_len,
            utilization=utilization,
            lora=lora,
            checkpointing=checkpointing,
            attention=attention,
            precision=precision,
            sample_scale=(sample_scale or {}).get(t, 1.0),
            micro_batch=micro_batch,
            packed=packed,
            loss_kernel=loss_kernel,
            quantize=quantize,
            rows=rows,
            sampling=sampling,
            optimizer=optimizer,
        )
        for t in TIERS
    ]


def _largest_fitting(fits: Callable[[int], bool], limit: int = 2**40) -> int:
    """The largest micro-batch m with fits(m) (0 if not even 1), for `fits` monotone in m: doubling, then bisection.
    The estimate is nearly affine in m (the loss's one chunk bends it), so no closed form is trusted."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi < limit and fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def pick_tier(plans: list[TierPlan]) -> TierPlan | None:
    """What `tier: auto` runs: the first useful plan that fits, None when no tier fits."""
    return next((p for p in plans if p.useful and p.fits), None)
