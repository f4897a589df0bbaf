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

from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import CHECKPOINTING, HOST_OPTIMIZER_TIERS, SHARD_ONLY, TIERS, divisors, tier_index
from jobspec.errors import ConfigError
from jobspec.plan.activations import (
    PACKED_MASK_CHECKPOINTED_BYTES,
    PACKED_MASK_LAYER_BYTES,
    LossKernel,
    _activations,
    _loss_parts,
    _recompute,
)
from jobspec.plan.adapters import LoraShape, _family, trainable_params
from jobspec.plan.fsdp_peak import _fsdp_peak, fsdp_padding
from jobspec.plan.quantize import base_quantization, gathered_saving, quantized_params, quantized_saving
from jobspec.plan.widths import ADAM_BYTES, FROZEN_BYTES, GRAD_BYTES, HALF_BYTES, MASTER_BYTES

Attention = Literal["sdpa", "flash", "flash_attention_2", "eager"]
Precision = Literal["bf16", "fp16", "fp32"]

# `training.optimizer: adamw_8bit` (torchao's AdamW8bit) on the tiers that keep the optimizer on the GPU: each moment a
# uint8 code per value and an fp32 scale per block of 256 (2 + 8/256 bytes a parameter; the few tensors under 4096
# values keep fp32 moments, counted as 8-bit here), and its step's fp32 working copies of one parameter (its value,
# gradient and two moments: an upper bound, not traced; the largest parameter's shard counts)
LOW_BIT_NUM, LOW_BIT_DEN = 65, 32  # 2.03125 bytes a parameter
LOW_BIT_STEP_BYTES = 16
OPTIMIZERS = ("adamw", "adamw_8bit", "sgd")  # sgd: plain SGD, no momentum, so no state at all
# DDP (`fast` on more than one rank) copies the grads into flat fp32 all-reduce buckets (the gradient's
# dtype) unless gradient_as_bucket_view=True. On one rank accelerate does not wrap the model in DDP.
DDP_BUCKET_BYTES = 4
# Offload tiers: the host holds what the GPU does not: the fp32 shard, its gradient and Adam's m and v
# (16 bytes per trainable parameter per rank's shard), the frozen shard in 16 bits.
HOST_TRAINABLE_BYTES = MASTER_BYTES + GRAD_BYTES + ADAM_BYTES
# CUDA/HIP context (~0.3-0.6 GiB), cuBLAS/NCCL workspaces: a fixed 1 GiB; allocator fragmentation
# grows with what is allocated: 5 % of the rest.
OVERHEAD_FIXED = 1024**3
OVERHEAD_PERCENT = 5


def overhead_bytes(body: int) -> int:
    """The allowance on top of the bytes the model counts: OVERHEAD_FIXED + OVERHEAD_PERCENT of them."""
    return OVERHEAD_FIXED + body * OVERHEAD_PERCENT // 100




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
    block_kernels: str = "plain",
    compile_scope: str = "off",
) -> MemoryEstimate:
    """Bytes one GPU needs to train `shape` at `tier` over `world_size` data-parallel ranks.

    `sample_scale` corrects the per-sample bytes (activations and logits) by what a run measured
    (jobspec/plan/calibration.py); 1.0 is the model as derived. `grad_accum`: micro-batches per optimizer step.
    When it accumulates (2 or more), the gradients of the earlier micro-batches are alive at the activations'
    peak; with one micro-batch a step they are not yet, and the step peaks at whichever is larger, the
    activations and loss or, after backward, the gradients: `gradients` is then only what they add beyond.
    `packed`: rows of several records (`data.packing`), whose attention mask sdpa then holds whole.
    `loss_kernel`: `training.loss_kernel`, which sizes the cross-entropy's chunk. `block_kernels`:
    `training.block_kernels` (Liger's keep fewer activations: `activations.LIGER_SAVED_BYTES`). `compile_scope`:
    `training.compile` (compiled blocks keep fewer: `activations.COMPILE_SAVED_BYTES`). `quantize`: the LoRA
    base's blocks in 4 bits ("nf4"; "auto" is the 16-bit base here, `plan_tier` tries both). `rows`: sequences a
    sample is (a DPO pair is 2, its chosen and rejected rows in one micro-batch). `sampling`: the micro-batch's rows
    are first sampled by the model (GRPO), whose KV cache then stands where the activations will (`sampling_bytes`):
    the larger of the two is counted, and the whole of the states beside it (the gradients, freed while it samples,
    too: the safe side). `optimizer`: `training.optimizer` (`optimizer_bytes`; "auto" counts AdamW, `plan_tier`
    decides)."""
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
    liger = block_kernels == "liger"
    acts = _activations(shape, tier, tokens, seq_len, ckpt, attention, precision, lora, liger=liger,
                        compiled=compile_scope != "off")  # fmt: skip
    recompute = _recompute(shape, tier, tokens, seq_len, attention, precision, lora, liger=liger) if ckpt else 0
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
    block_kernels: str = "plain",
    compile_scope: str = "off",
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
                    sampling=sampling, block_kernels=block_kernels, compile_scope=compile_scope)  # fmt: skip
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
        block_kernels=block_kernels,
        compile_scope=compile_scope,
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
    block_kernels: str = "plain",
    compile_scope: str = "off",
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
            block_kernels=block_kernels,
            compile_scope=compile_scope,
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
