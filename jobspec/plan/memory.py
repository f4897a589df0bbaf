"""Memory model: bytes per GPU for a model shape, tier, sequence length and micro-batch.

Shared by `jobspec plan` (before submit) and the runner (in the pod), so it takes plain numbers
and a `ModelShape`, never the spec, and imports neither torch nor pydantic. All sizes are bytes
(ints). Formulas and tiers: DESIGN.md, "Memory model" and "Memory tiers". The runner verifies the
plan with real optimizer steps; this model only has to rank the tiers and land near the answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import CHECKPOINTING, SHARD_ONLY, TIERS, divisors, tier_index
from jobspec.errors import ConfigError

Attention = Literal["sdpa", "flash", "flash_attention_2", "eager"]
Precision = Literal["bf16", "fp16", "fp32"]

# Mixed-precision Adam: bf16 weights (2) + bf16 grads (2) + fp32 master, m, v (12) = 16 bytes/param.
WEIGHT_BYTES = 2
GRAD_BYTES = 2
OPTIM_BYTES = 12
# DDP (`fast` on more than one rank) copies the grads into flat all-reduce buckets of the grad dtype
# unless gradient_as_bucket_view=True: one more 2 bytes per trainable param. On one rank accelerate
# does not wrap the model in DDP, so there are no buckets.
DDP_BUCKET_BYTES = 2
# Offload tiers keep the fp32 grad partition that CPU Adam reads on the host next to the 12 bytes of
# optimizer state (fp32 parameter copy, m, v): host needs 16 bytes per trainable param per rank's shard.
HOST_GRAD_BYTES = 4
# zero2_offload (FSDP2 + torchao's CPU-offload optimizer) keeps FSDP2's own shards on the GPU: the fp32
# parameter (the all-gather's source) and the fp32 gradient (reduce_dtype fp32), 4 bytes each.
SHARD_MASTER_BYTES = 4
SHARD_GRAD_BYTES = 4
# ZeRO-3 / FSDP FULL_SHARD gather one module's bf16 weights at a time. Factor 3: the module in use,
# the one prefetched, and the module's unsharded grads before reduce-scatter, all sized like the
# largest module (block, embedding or untied head); an upper bound, as the largest is gathered once.
GATHER_FACTOR = 3
# Logits: fp32 (4) and, alive with them when backward starts, their fp32 gradient (4). HF's bf16
# copy and the log-softmax buffer come and go around that peak; the overhead fraction absorbs them.
LOGITS_BYTES = 8
# Korthikanti et al. 2022: 34*s*b*h bytes per layer besides the attention matrix (5*a*s^2*b).
ACT_BYTES = 34
CKPT_BYTES = 2  # full checkpointing keeps each layer's bf16 input: 2*s*b*h per layer
# CUDA/HIP context (~0.3-0.6 GiB), cuBLAS/NCCL workspaces: a fixed 1 GiB; allocator fragmentation
# grows with what is allocated: 5 % of states + activations + logits.
OVERHEAD_FIXED = 1024**3
OVERHEAD_PERCENT = 5



@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters: rank r and the module names they wrap (PEFT `target_modules`, by suffix)."""

    rank: int
    targets: tuple[str, ...]


def _lora_modules(shape: ModelShape) -> dict[str, list[tuple[str, int, int]]]:
    """Target name -> (module, in, out features) of the linear layers it matches in one block."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":  # Conv1D layers; `c_proj` is the suffix of both projections
        attn, mlp = ("attn.c_proj", h, h), ("mlp.c_proj", i, h)
        return {
            "c_attn": [("c_attn", h, 3 * h)],
            "c_fc": [("c_fc", h, i)],
            "c_proj": [attn, mlp],
            "attn.c_proj": [attn],
            "mlp.c_proj": [mlp],
        }
    kv = (shape.kv_heads or shape.heads) * (h // shape.heads)  # grouped-query k/v width
    shapes = {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (h, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }
    return {name: [(name, fin, fout)] for name, (fin, fout) in shapes.items()}


def trainable_params(shape: ModelShape, lora: LoraShape | None) -> int:
    """Trainable parameters: all of them, or sum over layers and target modules of r*(in+out)."""
    if lora is None:
        return shape.params
    table = _lora_modules(shape)
    unknown = [t for t in lora.targets if t not in table]
    if unknown or not lora.targets or lora.rank < 1:
        raise ConfigError(
            f"LoRA rank {lora.rank} with targets {list(lora.targets)}: rank must be >= 1 and targets "
            f"non-empty, from {', '.join(table)} for a {shape.family} model"
        )
    modules = {m for t in lora.targets for m in table[t]}  # a set: `c_proj` + `mlp.c_proj` count once
    return shape.layers * sum(lora.rank * (fin + fout) for _, fin, fout in modules)


def _largest_module(shape: ModelShape) -> int:
    """Params of the largest module gathered whole: a block, the token embedding, or the head."""
    h, i = shape.hidden, shape.intermediate
    if shape.family == "gpt2":
        block = 4 * h * h + 2 * h * i + 9 * h + i
    else:
        kv = (shape.kv_heads or shape.heads) * (h // shape.heads)
        block = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return max(block, shape.vocab * h)  # an untied head is the same size as the embedding


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one GPU (and on the host for offload tiers) at one micro-batch."""

    tier: str
    micro_batch: int
    checkpointing: bool
    trainable_params: int
    states: int  # weights, grads, optimizer state, DDP buckets, gathered modules (GPU part)
    activations: int  # all transformer layers
    logits: int  # output logits and their gradient
    overhead: int  # context, workspaces, fragmentation
    host: int  # per rank: offloaded optimizer state, fp32 grads, params (0 without offload)

    @property
    def gpu_bytes(self) -> int:
        return self.states + self.activations + self.logits + self.overhead


def _states(shape: ModelShape, tier: str, world_size: int, lora: LoraShape | None) -> tuple[int, int, int]:
    """(GPU bytes, host bytes per rank, trainable params) of the model states.

    Host bytes are per rank: a node's need is that times its GPUs. With LoRA the weights held are the
    frozen base plus the adapters (2 bytes each) and only the adapters carry grads and optimizer state;
    zero2 tiers shard that trainable part, zero3 shards every weight (FULL_SHARD does not tell frozen
    from trainable), minimal moves every weight to the host.

    zero2_offload, what runner/train/engine.py builds (FSDP2 reshard_after_forward=False, 16-bit mixed
    precision, Adam through torchao's CPUOffloadOptimizer), w weights held, t trainable, N ranks:
        GPU   2w                   every weight gathered in 16 bits, held from forward to backward
            + (2(w - t) + 4t) / N  FSDP2's shards: frozen weights in 16 bits, trainable ones in fp32
            + 4t / N               the fp32 gradient shards (reduce_dtype fp32)
            = 2w + (2w + 6t) / N   (full fine-tuning: 2P + 8P/N)
        host  16t / N              torchao's pinned fp32 copy of each shard, of its gradient, and Adam's
                                   m and v (4 + 4 + 8)
    FSDP2 keeps its fp32 shard on the GPU (the all-gather's source), so only Adam's 8t/N leave it; the
    host copy is a second one. Transient buffers (one module's gradients around its reduce-scatter) are
    left to the overhead, as for zero2. Several ranks accumulating over micro-batches without gradient
    sync hold unsharded fp32 gradients (4t) until the last one, which this does not count.
    tests/runner/train/test_offload.py counts these bytes on real tensors.
    """
    t = trainable_params(shape, lora)
    w = shape.params + (t if lora else 0)  # weights held: base (frozen with LoRA) + adapters
    n = world_size
    per_trainable = GRAD_BYTES + OPTIM_BYTES  # 14: what ZeRO-2 shards on top of the weights
    host_opt = (OPTIM_BYTES + HOST_GRAD_BYTES) * t // n
    gathered = GATHER_FACTOR * WEIGHT_BYTES * _largest_module(shape)
    if tier == "fast":
        buckets = DDP_BUCKET_BYTES * t if n > 1 else 0
        return WEIGHT_BYTES * w + per_trainable * t + buckets, 0, t
    if tier == "zero2":
        return WEIGHT_BYTES * w + per_trainable * t // n, 0, t
    if tier == "zero2_offload":  # formula in the docstring
        shards = WEIGHT_BYTES * (w - t) + (SHARD_MASTER_BYTES + SHARD_GRAD_BYTES) * t
        return WEIGHT_BYTES * w + shards // n, host_opt, t
    if tier == "zero3":
        return (WEIGHT_BYTES * w + per_trainable * t) // n + gathered, 0, t
    tier_index(tier)  # raises for unknown names
    # minimal: params and optimizer on the host; the GPU keeps only the gathered modules
    return gathered, host_opt + WEIGHT_BYTES * w // n, t


def _activations(
    shape: ModelShape, seq_len: int, micro_batch: int, checkpointing: bool, attention: str, precision: str
) -> int:
    s, b, h = seq_len, micro_batch, shape.hidden
    if precision not in ("bf16", "fp16", "fp32"):
        raise ConfigError(f"unknown precision {precision!r}; expected bf16, fp16 or fp32")
    width = 2 if precision == "fp32" else 1  # Korthikanti's bytes assume 16-bit activations
    if attention == "eager":  # the a*s*s attention scores and their softmax/dropout stay in memory
        layer = s * b * (ACT_BYTES * h + 5 * shape.heads * s)
    elif attention in ("sdpa", "flash", "flash_attention_2"):
        layer = ACT_BYTES * s * b * h
    else:
        raise ConfigError(f"unknown attention {attention!r}; expected sdpa, flash or eager")
    if checkpointing:  # each layer's input, plus one layer recomputed at a time in backward
        return width * (shape.layers * CKPT_BYTES * s * b * h + layer)
    return width * shape.layers * layer


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
) -> MemoryEstimate:
    """Bytes one GPU needs to train `shape` at `tier` over `world_size` data-parallel ranks.

    `sample_scale` corrects the per-sample bytes (activations and logits) by what a run measured
    (jobspec/plan/calibration.py); 1.0 is the model as derived."""
    if seq_len < 1 or micro_batch < 0 or world_size < 1:
        raise ConfigError(
            f"seq_len {seq_len}, micro_batch {micro_batch}, world_size {world_size}: "
            "need seq_len >= 1, micro_batch >= 0, world_size >= 1"
        )
    ckpt = CHECKPOINTING[TIERS[tier_index(tier)]] if checkpointing is None else checkpointing
    states, host, t = _states(shape, tier, world_size, lora)
    acts = int(_activations(shape, seq_len, micro_batch, ckpt, attention, precision) * sample_scale)
    logits = int(LOGITS_BYTES * seq_len * micro_batch * shape.vocab * sample_scale)
    overhead = OVERHEAD_FIXED + (states + acts + logits) * OVERHEAD_PERCENT // 100
    return MemoryEstimate(tier, micro_batch, ckpt, t, states, acts, logits, overhead, host)


@dataclass(frozen=True)
class TierPlan:
    """What one tier gives on one GPU: the micro-batch, its accumulation, and the memory."""

    tier: str
    useful: bool  # False: skipped by `auto` (reason says why) but still reported
    reason: str  # why not useful / why it does not fit; "" when it fits and is useful
    fits: bool  # micro_batch >= 1
    max_micro_batch: int  # largest that fits the budget, before rounding to a divisor
    micro_batch: int  # largest divisor of the per-rank batch <= max_micro_batch; 0 if none fits
    grad_accum: int  # global_batch / (micro_batch * world_size); 0 if none fits
    budget: int  # utilization * gpu_bytes
    estimate: MemoryEstimate  # at micro_batch (at 1 when nothing fits, to show the shortfall)


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
) -> TierPlan:
    """The largest micro-batch at `tier` that fits `utilization * gpu_bytes` and divides the per-rank batch.

    `gpu_bytes` is the memory one GPU gives the job: the card's total before submit, the probed free
    memory in the pod. The effective batch never changes: grad_accum * micro_batch * world_size ==
    global_batch exactly.
    """
    if global_batch < 1 or world_size < 1 or global_batch % world_size:
        raise ConfigError(f"global_batch {global_batch} must be a positive multiple of world_size {world_size}")
    if not 0 < utilization <= 1:
        raise ConfigError(f"utilization {utilization} must be in (0, 1]")
    per_rank = global_batch // world_size
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
    )
    fixed, one = est(micro_batch=0), est(micro_batch=1)
    per_sample = one.gpu_bytes - fixed.gpu_bytes  # bytes each sequence of the micro-batch adds
    # mbs = floor((U * gpu - states - overhead) / activations(mbs=1)); the integer 5 % rounding
    # can move the edge by one, so settle it against estimate() itself.
    top = max(0, (budget - fixed.gpu_bytes) // per_sample)
    while top > 0 and est(micro_batch=top).gpu_bytes > budget:
        top -= 1
    while est(micro_batch=top + 1).gpu_bytes <= budget:
        top += 1
    mbs = max((d for d in divisors(per_rank) if d <= top), default=0)
    useful = not (world_size == 1 and tier in SHARD_ONLY)
    reason = "" if useful else "one rank: sharding saves nothing, use fast"
    if not mbs:
        gib = 1024**3
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
        est(micro_batch=mbs) if mbs else one,
    )


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
) -> list[TierPlan]:
    """`plan_tier` for every tier, in TIERS order (cheapest first); `sample_scale`: measured corrections by tier."""
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
        )
        for t in TIERS
    ]


def pick_tier(plans: list[TierPlan]) -> TierPlan | None:
    """What `tier: auto` runs: the first useful plan that fits, None when no tier fits."""
    return next((p for p in plans if p.useful and p.fits), None)
