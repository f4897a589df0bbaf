"""The memory oracle: the runner's training step traced on FakeTensors, bytes per category at the peak.

`trace_step(model, tier=..., world_size=..., micro_batch=..., seq_len=...)` builds the model the
way runner/model/build.py does (transformers config, peft LoRA, the frozen base at 16 bits), on the meta device,
switches on non-reentrant activation checkpointing as runner/train/engine.py does, wraps it as accelerate does
for the tier (`fast`: fp32 weights, torch.autocast and fp32 outputs; the others: FSDP2 through accelerate's own
`fsdp2_prepare_model`, MixedPrecisionPolicy bf16/fp32/bf16, one unit per block plus the embedding, the tail and
the root, reshard_after_forward per tier), materialises it as FakeTensors, runs a first step on one micro-batch
(Adam's moments, FSDP2's recorded order), and then the runner's step: forward, the runner's own loss
(`runner_loss`: Stepper.loss_sum with its chunked head), backward over `grad_accum` micro-batches, gradient
clipping, AdamW. That step is the one that counts; torch's MemTracker (`fast`) or FSDPMemTracker (FSDP2 tiers)
reports the peak and its parts. Fakes hold no data: a 7B model costs seconds and a few hundred MB of host memory.
With `fake=False` the same step runs on real tensors (tests).

What the trace cannot run and adds or moves by arithmetic (each one is a field of TraceResult):
- DDP (`fast` over several ranks) does not run on fakes: its fp32 gradient buckets, 4 bytes per trainable
  parameter, are added to the peak (`ddp_buckets`).
- Offload tiers trace as their unoffloaded twin (zero2_offload as zero2, minimal as zero3), as the runner runs
  them on CPU. `host` holds what leaves the device: Adam's states (zero2_offload: torchao also keeps fp32 host
  copies of each parameter and gradient shard), and for minimal the parameter and gradient shards too.
  `peak` is the device part at the moment of the traced peak, not a peak of its own.
- The trace runs on the CPU device: a CPU-only torch cannot run autograd on fake CUDA tensors. torch.autocast
  is then CPU autocast (bf16 matmuls, linear and attention in both; RMSNorm upcasts explicitly) and SDPA picks
  the CPU flash kernel (saves out and a (b, h, s) fp32 logsumexp, as CUDA's flash kernel). Where a GPU decides
  otherwise, the trace takes the GPU's decision (`gpu_decisions`): CUDA autocast's fp32 ops (LayerNorm, softmax,
  `pow`), attention dropout inside the SDPA kernel, 1-byte dropout masks.

transformers takes FakeTensors for tracing (`is_tracing`): `find_packed_sequence_indices` would return a
packed-sequence mask where eager returns None for the arange positions the runner's forward makes, which makes
it build a (b, 1, s, s) mask and expand K/V for grouped-query attention. The trace gives it the runner's answer,
the eager one (`internals.packed_search`, which the runner's forwards give it to spare eager's host sync), so the
traced graph is the eager one (tests/runner/sizing/test_trace.py checks it against real tensors to the byte). With
`packed=True` (`data.packing`) the traced micro-batch is packed as the runner's are, two records a row with their own
position ids (`Batch.position_ids`), and there the answer is the (b, 1, s, s) block-diagonal mask eager builds too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import CHECKPOINTING, TIERS, tier_index
from jobspec.errors import ConfigError
from jobspec.plan.memory import LossKernel
from jobspec.plan.planner import model_attention, rows_per_sample
from jobspec.plan.quantize import base_quantization
from jobspec.spec.models import LoraSpec
from runner import internals
from runner.data.dataset import Batch
from runner.model.build import (
    apply_lora,
    frozen_base_width,
    liger_blocks,
    preset_config,
    ready_for_training,
    router_aux_coef,
    text_part,
)
from runner.model.quantize import parts_to_empty, quantize_base
from runner.train import engine, trace_compiled

log = logging.getLogger("jobspec.runner")

# The runner's loss, given the prepared model and its device: a function of a micro-batch that returns its summed
# token cross-entropy (what Stepper builds in its constructor and calls as `loss_sum`).
LossFactory = Callable[[nn.Module, torch.device], Callable[[Batch], torch.Tensor]]
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TRACED_AS = {"zero2_offload": "zero2", "minimal": "zero3"}  # offload tiers: what runs, then moved by arithmetic
DDP_BUCKET_BYTES = 4  # DDP's flat gradient buckets, in the dtype of the (fp32) trainable parameters
HOST_COPY_BYTES = 8  # zero2_offload: torchao's pinned fp32 copy of each parameter shard and of its gradient

# MemTracker / FSDPMemTracker categories -> the parts reported
PARTS = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Sharded Param": "parameters",
    "Unsharded Param": "parameters",
    "All Gather": "parameters",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Reduce Scatter": "gradients",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "temporaries",
    "Inputs": "other",
    "Other": "other",
}


@dataclass(frozen=True)
class TraceResult:
    """One rank's memory at the peak of a traced optimizer step, in bytes."""

    tier: str
    world_size: int
    micro_batch: int
    seq_len: int
    checkpointing: bool
    peak: int  # device bytes: the tracker's peak + ddp_buckets - what an offload tier keeps on the host
    parts: dict[str, int]  # parameters, gradients, optimizer, activations, temporaries, other at the peak
    raw: dict[str, int]  # the tracker's own categories at the peak (before offload and DDP are applied)
    host: int  # per rank, offload tiers: bytes kept in host memory (0 otherwise)
    ddp_buckets: int  # added for `fast` over several ranks (0 otherwise)
    params: int
    trainable: int
    seconds: float
    fake: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


def hf_config(model: ModelShape | dict[str, Any] | Any) -> Any:
    """A transformers config: from a preset shape (as runner/model/build.py), a config.json dict, or a config."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, ModelShape):
        cfg = preset_config(model, bos=0, eos=min(1, model.vocab - 1))  # token ids do not change memory
    elif isinstance(model, dict):
        kwargs = dict(model)
        model_type = kwargs.pop("model_type", None)
        if model_type is None:
            raise ConfigError("trace: a config.json dict needs its `model_type` (e.g. llama, qwen2, mistral)")
        for key in ("architectures", "torch_dtype", "dtype", "transformers_version", "auto_map"):
            kwargs.pop(key, None)
        cfg = AutoConfig.for_model(model_type, **kwargs)
    elif isinstance(model, PretrainedConfig):
        cfg = model
    else:
        raise ConfigError(f"trace: cannot make a transformers config of {type(model).__name__}")
    cfg = text_part(cfg)  # a multimodal checkpoint's text model, as build_model trains it (Gemma 3 4B+)
    cfg.use_cache = False  # as build_model: no KV cache in training
    return cfg


def _build(cfg: Any, *, lora: LoraSpec | None, precision: str, attention: str, meta: bool, quantize: str | None = None,
           shards: int = 1, block_kernels: str = "plain") -> nn.Module:  # fmt: skip
    """The model as build_model makes it (fp32 weights; with LoRA a 16-bit frozen base, 4-bit blocks with `quantize`,
    and fp32 adapters; Liger's block kernels with `block_kernels` "liger", as for a GPU)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta") if meta else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention)
    ready_for_training(model)
    if block_kernels == "liger":
        liger_blocks(model, "cuda")
    if lora is not None:
        frozen_base_width(model, precision)
        if quantize:
            quantize_base(model, quantize, shards=shards)
        model = apply_lora(model, lora)
    elif quantize:
        raise ConfigError(f"model.quantize {quantize}: a quantized base trains LoRA adapters only; add model.lora")
    return model


def _autocast(model: nn.Module, precision: str, device: torch.device) -> None:
    """What accelerate's prepare_model does for native AMP (`fast`): autocast the forward, fp32 outputs. Its FSDP2
    path (`_prepare_fsdp2`) does not: there FSDP2's MixedPrecisionPolicy casts the gathered weights."""
    if precision == "fp32":
        return
    from accelerate.utils import convert_outputs_to_fp32

    forward = model.forward.__func__  # type: ignore[union-attr]
    autocast = torch.autocast(device_type=device.type, dtype=DTYPE[precision])
    model.forward = convert_outputs_to_fp32(autocast(forward)).__get__(model)  # type: ignore[method-assign]


def _shard(model: nn.Module, tier: str, precision: str) -> nn.Module:
    """FSDP2 as accelerate's `fsdp2_prepare_model` does it, with the plugin engine.fsdp_plugin builds."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = engine.sharding_plugin(tier, precision, model, offload=False)  # traced without offload: see above
    # the parts of an Accelerator that fsdp2_prepare_model reads (a real one is a process-wide singleton)
    shim = _AcceleratorView(plugin, "no" if precision == "fp32" else precision)
    return fsdp2_prepare_model(shim, model)


class _AcceleratorView:
    def __init__(self, plugin: Any, mixed_precision: str):
        self.state = type("State", (), {"fsdp_plugin": plugin})()
        self.mixed_precision = mixed_precision
        self.is_main_process = True
        self.torch_device_mesh = None
        self.parallelism_config = None
        self.device = torch.device("cpu")


def _optimizer(model: nn.Module, fused: bool | None, sharded: bool) -> torch.optim.Optimizer:
    """AdamW over two groups (decay on matrices only), as engine.make_optimizer builds it.

    Sharded (DTensor) parameters on fakes step one parameter at a time: under FakeTensorMode the tracker cannot
    tell DTensor's shape propagation of the fused and foreach kernels from real allocations and counts whole
    unsharded tensors as optimizer state (torch 2.13). The loop's temporaries are one shard's size."""
    groups = engine.param_groups(model, weight_decay=0.1)
    if sharded:
        return torch.optim.AdamW(groups, lr=1e-5, betas=engine.BETAS, foreach=False, fused=False)
    return torch.optim.AdamW(groups, lr=1e-5, betas=engine.BETAS, fused=fused)


# CUDA's autocast runs these ops in fp32 (torch's autocast_mode.cpp, the CUDA fp32 and fp32-set-opt-dtype lists, as
# far as transformer blocks call them); the CPU's autocast runs them in the input's 16-bit dtype. For GPT-2 blocks
# (LayerNorm, tanh GELU's `pow`) that is 40 % more activation memory on a GPU.
_CUDA_FP32_OPS: tuple[tuple[Any, str], ...] = tuple(
    [(torch, name) for name in ("pow", "layer_norm", "group_norm", "softmax", "log_softmax", "exp", "log", "rsqrt",
                                "reciprocal", "cumsum", "logsumexp")]
    + [(torch.Tensor, name) for name in ("pow", "__pow__", "softmax", "log_softmax", "exp", "log", "rsqrt",
                                         "reciprocal", "cumsum", "logsumexp")]
    + [(torch.nn.functional, name) for name in ("layer_norm", "group_norm", "softmax", "log_softmax", "softplus")]
)  # fmt: skip


@contextlib.contextmanager
def gpu_decisions() -> Iterator[None]:
    """What a GPU decides where the CPU trace would decide otherwise, for the ops that change the step's memory.

    - Autocast: while it is on, the ops of CUDA's fp32 list get fp32 inputs, as CUDA's (and ROCm's) autocast casts
      them. The CPU's autocast keeps LayerNorm, softmax, `pow`... in 16 bits; on a GPU their outputs, and what they
      save for backward, are fp32. Checked against an H100: GPT-2 small, `fast`, micro-batch 72 at 1024 tokens,
      `torch.cuda.max_memory_allocated` 58.17 GiB; this trace 58.10 GiB, the CPU's policy 41.44 GiB.
    - Attention dropout (a config's attn_pdrop > 0, GPT-2's default): a GPU's flash and memory-efficient SDPA
      kernels drop out inside the kernel, keeping no (b, h, s, s) tensor; the CPU's flash kernel cannot, and SDPA
      falls back to its math path, which keeps the probabilities and a mask. The trace runs SDPA without dropout,
      the memory of the GPU's kernel (its RNG state aside). Other dropout (residual, embedding) keeps a 1-byte mask
      as CUDA's fused kernel does, where the CPU's keeps a noise tensor of the input's width.
    - Values narrower than queries and keys (DeepSeek-V2's latent attention: q/k 192 wide a head, v 128): CUDA's
      memory-efficient kernel takes them (only flash needs one width), keeping out and a logsumexp; the CPU's flash
      kernel refuses them and SDPA falls back to its math path, which keeps the (b, h, s, s) probabilities: 64-128
      KB a token a layer at 2048 tokens, 8 % of DeepSeek-V2-Lite's zero2 peak at micro-batch 1 and 15 % at 2. The
      trace pads v to the query's width for the CPU's flash kernel and slices the output back: it keeps a v and an
      output 1.5 times their width (about 4 KB a token a layer more than the GPU's kernel, under 1 % of those peaks).

    The functions are wrapped (not a TorchFunctionMode: activation checkpointing recomputes in backward outside
    the modes of the forward)."""
    halves = (torch.bfloat16, torch.float16)

    def upcast(value: Any) -> Any:
        return value.float() if isinstance(value, torch.Tensor) and value.dtype in halves else value

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def in_fp32(*args: Any, **kwargs: Any) -> Any:
            if torch.is_autocast_enabled("cpu"):
                args, kwargs = tuple(map(upcast, args)), {k: upcast(v) for k, v in kwargs.items()}
            return fn(*args, **kwargs)

        return in_fp32

    sdpa, dropout = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.dropout

    def fused_mask(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if training and 0 < p < 1 and not inplace and input.numel():  # what CUDA's dropout runs: a 1-byte mask
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def fused_dropout(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        kwargs = {**kwargs, "dropout_p": 0.0} if "dropout_p" in kwargs else kwargs
        q, v = args[0] if args else kwargs["query"], args[2] if len(args) > 2 else kwargs["value"]
        wider = q.size(-1) - v.size(-1)
        if wider > 0:  # DeepSeek's latent attention: values narrower than queries and keys (see above)
            padded = torch.nn.functional.pad(v, (0, wider))
            args, kwargs = ((*args[:2], padded, *args[3:]), kwargs) if len(args) > 2 else (args, {**kwargs,
                                                                                                "value": padded})
            return sdpa(*args, **kwargs)[..., : v.size(-1)]
        return sdpa(*args, **kwargs)

    with contextlib.ExitStack() as stack:
        for owner, name in _CUDA_FP32_OPS:
            if hasattr(owner, name):
                stack.enter_context(mock.patch.object(owner, name, wrap(getattr(owner, name))))
        stack.enter_context(mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", fused_dropout))
        stack.enter_context(mock.patch.object(torch.nn.functional, "dropout", fused_mask))
        yield


@contextlib.contextmanager
def _process_group(world_size: int, fake: bool) -> Iterator[None]:
    """A process group of `world_size` for FSDP2: torch's fake backend (collectives do nothing) or gloo (1 rank)."""
    if dist.is_initialized():
        raise ConfigError("trace: a process group already exists; trace FSDP tiers in a process of their own")
    if not fake and world_size != 1:
        raise ConfigError(f"trace: real tensors over {world_size} ranks need real processes; use fake=True")
    dist.init_process_group("fake" if fake else "gloo", store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _to_empty(model: nn.Module, device: torch.device) -> None:
    """`Module.to_empty` that keeps tied parameters tied (it gives each module's reference a tensor of its own)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    parts_to_empty(model, device)
    for first, *others in (n for n in names.values() if len(n) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)


def trace_step(
    model: ModelShape | dict[str, Any] | Any,
    *,
    tier: str,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    loss: LossFactory | None = None,
    precision: str = "bf16",
    lora: LoraSpec | None = None,
    checkpointing: bool | None = None,
    attention: str = "sdpa",
    max_grad_norm: float | None = 1.0,
    fused: bool | None = True,
    fake: bool = True,
    seed: int = 0,
    grad_accum: int = 2,
    packed: bool = False,
    gpu: bool = True,
    loss_kernel: LossKernel = "chunked",
    quantize: str | None = None,
    warmup: str = "one",
    block_kernels: str = "plain",
    compile_scope: str = "off",
) -> TraceResult:
    """One rank's bytes at the peak of the runner's optimizer step at `tier` (see the module docstring).

    `model`: a preset ModelShape, a config.json dict (with `model_type`) or a transformers config. `loss`: a
    factory of the loss of a micro-batch, `(model, device) -> (Batch -> summed token cross-entropy)` (default
    `runner_loss`, the runner's own). `checkpointing` None: the tier's default.
    `fused`: AdamW's fused kernel as the runner uses on a GPU (None: what it does on a CPU, a loop over
    parameters with their temporaries). `fake=False` runs real tensors on the CPU (FSDP tiers on one rank).
    `grad_accum`: micro-batches per optimizer step, as Stepper.train_step runs them (2: the gradients of the first
    are alive during the second, the runner's usual case; 1 when the micro-batch is the whole per-rank batch).
    `packed`: rows of two records each with their own position ids, as `data.packing` trains (see the docstring).
    `gpu`: autocast decides which ops run in fp32 as CUDA's (and ROCm's) autocast does, and attention dropout runs
    inside the SDPA kernel, as where the step will run (`gpu_decisions`); False: as on the CPU.
    `loss_kernel`: `training.loss_kernel` for the default loss (Liger's kernel writes in place: on fakes it is the
    one call skipped, `internals.liger_rows`).
    `quantize`: the frozen base's blocks in 4 bits ("nf4", with LoRA: runner/model/quantize.py), as the runner builds
    it for a plan that quantizes.
    `warmup`: the step before the measured one: "one" micro-batch (Adam's moments, FSDP2's recorded forward order) or
    the whole "step" of `grad_accum` micro-batches (bench/trace_warmup.py compares the two).
    `block_kernels`: `training.block_kernels`; with "liger" the blocks run Liger's autograd functions (what they
    allocate and keep for backward), their Triton launches skipped on fakes (`internals.triton_skips_fakes`).
    `compile_scope`: `training.compile`; the blocks still step eagerly, and what compiled ones keep less for backward
    is measured on one block and taken off the peak (runner/train/trace_compiled.py).
    """
    tier_index(tier)  # raises for unknown names
    if precision not in DTYPE or micro_batch < 1 or seq_len < 1 or world_size < 1:
        raise ConfigError(
            f"trace: precision {precision!r} (bf16, fp16 or fp32), micro_batch {micro_batch}, seq_len {seq_len}, "
            f"world_size {world_size}: need positive sizes"
        )
    start = time.perf_counter()
    loss = loss or partial(runner_loss, kernel=loss_kernel)
    ckpt = CHECKPOINTING[TIERS[tier_index(tier)]] if checkpointing is None else checkpointing
    traced = TRACED_AS.get(tier, tier)
    fsdp = traced != "fast"
    device = torch.device("cpu")
    torch.manual_seed(seed)
    cfg = hf_config(model)
    net = _build(cfg, lora=lora, precision=precision, attention=attention, meta=fake, quantize=quantize,
                 shards=world_size if fsdp else 1, block_kernels=block_kernels)
    params = sum(p.numel() for p in net.parameters())
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    if ckpt:
        engine.enable_checkpointing(net, lora=lora is not None)
    group = _process_group(world_size, fake) if fsdp else contextlib.nullcontext()
    policy = gpu_decisions() if gpu else contextlib.nullcontext()
    kernels = internals.triton_skips_fakes() if block_kernels != "plain" and fake else contextlib.nullcontext()
    compiled = compile_scope != "off" and not ckpt  # (`model` as `blocks`; checkpointed tiers keep eager's figure)
    with contextlib.ExitStack() as stack:
        stack.enter_context(group)  # the fake process group's start clears dynamo's tables of torch's functions
        if compiled:
            trace_compiled.prime()  # so they are built again here, before gpu_decisions wraps some of them
        for context in (internals.packed_search(packed), policy, kernels):
            stack.enter_context(context)
        saving = _compiled_saving(net, fsdp, precision, micro_batch, seq_len) if compiled else None
        if fsdp:  # on the meta device for fakes: FSDP2's device mesh cannot be built under FakeTensorMode
            net = _shard(net, traced, precision)  # accelerate's FSDP2 path casts by the mixed-precision policy only
        else:
            _autocast(net, precision, device)
        result = _run(net, cfg, loss, fsdp=fsdp, fused=fused, fake=fake, micro_batch=micro_batch, seq_len=seq_len,
                      world_size=world_size, max_grad_norm=max_grad_norm, grad_accum=grad_accum,
                      packed=packed, warmup=warmup)  # fmt: skip
    raw = {str(getattr(k, "value", k)): int(v) for k, v in result.get(device, {}).items()}
    total = raw.pop("Total", 0)
    parts = dict.fromkeys(("parameters", "gradients", "optimizer", "activations", "temporaries", "other"), 0)
    for name, nbytes in raw.items():
        parts[PARTS.get(name, "other")] += nbytes
    peak, host, buckets, notes = total, 0, 0, []
    if saving is not None:
        cut = trace_compiled.apply(saving, parts["activations"])
        peak, parts["activations"] = peak - cut, parts["activations"] - cut
        notes.append(trace_compiled.note(saving, cut))
    if tier == "fast" and world_size > 1:
        buckets = DDP_BUCKET_BYTES * trainable
        peak += buckets
        notes.append(f"DDP buckets added: {DDP_BUCKET_BYTES} B x {trainable} trainable parameters")
    if tier == "zero2_offload":
        host = raw.get("OptState", 0) + HOST_COPY_BYTES * trainable // world_size
        peak -= raw.get("OptState", 0)
        notes.append("traced as zero2; Adam's states moved to the host, plus torchao's fp32 shard copies")
    if tier == "minimal":
        moved = raw.get("OptState", 0) + raw.get("Sharded Param", 0) + raw.get("Sharded Grad", 0)
        host, peak = moved, peak - moved
        notes.append("traced as zero3; sharded parameters, gradients and Adam's states moved to the host")
    return TraceResult(
        tier, world_size, micro_batch, seq_len, ckpt, peak, parts, raw, host, buckets, params, trainable,
        time.perf_counter() - start, fake, tuple(notes),
    )  # fmt: skip



def _compiled_saving(net: nn.Module, fsdp: bool, precision: str, micro_batch: int,
                     seq_len: int) -> trace_compiled.BlockSaving:  # fmt: skip
    """What a compiled block keeps less (runner/train/trace_compiled.py), at the tier's dtypes: FSDP2's 16-bit
    weights, or `fast`'s autocast (with `model` as with `blocks`: the embedding and the final norm stay eager's)."""
    half = DTYPE[precision] if precision != "fp32" else None
    return trace_compiled.block_saving(net, micro_batch=micro_batch, seq_len=seq_len, dtype=half if fsdp else None,
                                       autocast=None if fsdp else half, mode=internals.fake_mode())  # fmt: skip


def _run(
    net: nn.Module,
    cfg: Any,
    loss: LossFactory,
    *,
    fsdp: bool,
    fused: bool | None,
    fake: bool,
    micro_batch: int,
    seq_len: int,
    world_size: int,
    max_grad_norm: float | None,
    grad_accum: int,
    packed: bool = False,
    warmup: str = "one",
) -> dict[Any, dict[Any, int]]:
    """Two optimizer steps of the runner under the tracker; the second one's peak snapshot (device -> category ->
    bytes).

    The first step creates Adam's moments and lets FSDP2 record its forward order (which its backward prefetching
    follows from then on: moments made from zero gradients without a forward gave another peak, 10 % lower on some
    zero3 models), on one micro-batch (`warmup="one"`): a quarter of the time at the usual two. Against a first step
    of `grad_accum` micro-batches, the measured peak is the same but for what each forward and backward leaves behind
    (2 KiB, and with LoRA and activation checkpointing a 16-bit (micro-batch, seq, hidden) tensor: measured 0.2-0.5 %
    of the peak of 3-layer models, bench/trace_warmup.py)."""
    device = torch.device("cpu")
    with internals.fake_mode() if fake else contextlib.nullcontext():
        if fake:
            _to_empty(net, device)
        net.train()
        optimizer = _optimizer(net, fused, fsdp and fake)
        loss_sum = loss(net, device)
        vocab = int(cfg.vocab_size)
        ids = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
        positions = packed_positions(micro_batch, seq_len, device) if packed else None
        batch = Batch(ids, ids.clone(), micro_batch * seq_len, micro_batch * seq_len, (), positions)
        scale = world_size / batch.targets  # as Stepper.train_step: the global per-token mean
        trained = [p for p in net.parameters() if p.requires_grad]
        inputs = (batch.input_ids, batch.labels, *([] if positions is None else [positions]))
        tracker = internals.memory_tracker(net, optimizer, fsdp, inputs)

        def step(micro_batches: int) -> None:
            optimizer.zero_grad(set_to_none=True)
            for _ in range(micro_batches):  # from the second micro-batch on, the gradients are alive
                tracker.reset_mod_stats()  # per-module figures are per forward; the peak is kept
                (loss_sum(batch) * scale).backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(trained, max_norm=max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        with tracker:
            step(1 if warmup == "one" else grad_accum)  # Adam's moments, FSDP2's recorded order (see the docstring)
            tracker.reset_mod_stats()
            tracker.reset_peak()
            step(grad_accum)  # the runner's steady state
        snapshot = tracker.get_tracker_snapshot("peak")
    return snapshot


def per_sample_bytes(a: TraceResult, b: TraceResult) -> float:
    """Bytes each sample of the micro-batch adds, from two traces at one tier, rank count and sequence length."""
    if (a.tier, a.world_size, a.seq_len) != (b.tier, b.world_size, b.seq_len) or a.micro_batch == b.micro_batch:
        raise ConfigError("per_sample_bytes: two traces of one tier, world size and seq_len, at two micro-batches")
    return (b.peak - a.peak) / (b.micro_batch - a.micro_batch)


def fixed_bytes(a: TraceResult, b: TraceResult) -> float:
    """Bytes at micro-batch 0 on the line through two traces (the states and what does not grow with the batch)."""
    return a.peak - per_sample_bytes(a, b) * a.micro_batch


def largest_micro_batch(a: TraceResult, b: TraceResult, budget: int) -> int:
    """The largest micro-batch whose peak, on the line through two traces, fits `budget` bytes (0: none)."""
    slope = per_sample_bytes(a, b)
    return max(0, int((budget - fixed_bytes(a, b)) // slope)) if slope > 0 else 0


def runner_loss(
    model: nn.Module, device: torch.device, kernel: LossKernel = "chunked"
) -> Callable[[Batch], torch.Tensor]:
    """The runner's own loss for a prepared model: `runner.train.step.summed_loss` (what Stepper.loss_sum calls)
    with the chunked-loss head installed as Stepper's constructor installs it (runner/train/loss.py). On fakes
    the head's install probe, which reads the values the model passes out, cannot run: it is taken as passing,
    as it does for the GPT-2, Llama, Qwen and Mistral blocks; a model that rescales its logits (Gemma-2's
    soft-capping) keeps the full logits in a real run, and its trace then under-counts the loss."""
    from runner.train.loss import ChunkedLossHead, install_chunked_loss
    from runner.train.step import summed_loss

    fake = any(internals.is_fake(p) for p in model.parameters())
    with mock.patch.object(ChunkedLossHead, "probe", return_value=None) if fake else contextlib.nullcontext():
        head = install_chunked_loss(model, run=model, device=device, kernel=kernel)

    coef = router_aux_coef(model)  # a mixture-of-experts model's load-balancing loss, as Stepper adds it

    def loss_sum(batch: Batch) -> torch.Tensor:
        positions = None if batch.position_ids is None else batch.position_ids.to(device)
        router: list[torch.Tensor] | None = [] if coef else None
        ce = summed_loss(model, head, batch.input_ids.to(device), batch.labels.to(device), positions, router)
        return ce + router[0] * (coef * batch.targets) if router else ce  # the caller scales by 1 / targets

    return loss_sum


def packed_positions(micro_batch: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """(micro_batch, seq_len) position ids of packed rows: two records a row, the second from seq_len // 2 (a row
    of one token holds one record). The memory of a packed step does not depend on where the records split."""
    pos = torch.arange(seq_len, device=device)
    half = seq_len // 2
    pos = torch.where(pos >= half, pos - half, pos) if half else pos
    return pos.expand(micro_batch, -1).contiguous()


def spec_model(spec: Any) -> ModelShape | Any:
    """What `trace_step` builds for a spec: the preset's or short-form architecture's shape, an inline config.json
    as written (its family's own blocks: experts, latent attention, soft caps), else the local config.json."""
    from jobspec.plan.planner import model_shape

    config = getattr(spec.model.architecture, "config", None)
    if callable(config):  # the inline config.json form (jobspec/spec/models.py ArchitectureConfig)
        return config()
    if spec.model.preset or spec.model.architecture:
        return model_shape(spec)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(spec.model.path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model.path {spec.model.path!r}: no config to trace ({str(err).splitlines()[0]})") from None


def trace_spec(spec: Any, tiers: list[tuple[str, int]], world_size: int, precision: str) -> list[dict[str, Any]]:
    """`trace_step` for each (tier, micro-batch) pair, as JSON-ready dicts. `model.quantize: auto` traces the 16-bit
    base: a caller whose plan chose the 4-bit one passes the spec with `model.quantize: nf4`."""
    model = spec_model(spec)
    forced = {"on": True, "off": False}.get(spec.training.gradient_checkpointing)
    per_rank = spec.training.global_batch // world_size
    out = []
    for tier, mbs in tiers:
        r = trace_step(model, tier=tier, world_size=world_size, micro_batch=mbs * rows_per_sample(spec),
                       seq_len=spec.data.max_seq_len,
                       loss_kernel=spec.training.loss_kernel, precision=precision, lora=spec.model.lora,
                       checkpointing=forced, attention=model_attention(spec), max_grad_norm=spec.training.max_grad_norm,
                       grad_accum=2 if per_rank // mbs > 1 else 1, packed=spec.data.packing,
                       quantize=base_quantization(spec.model.quantize, spec.model.lora),
                       block_kernels=spec.training.block_kernels, compile_scope=spec.training.compile)  # fmt: skip
        out.append({"tier": tier, "micro_batch": mbs, "peak": r.peak, "parts": r.parts, "host": r.host,
                    "ddp_buckets": r.ddp_buckets, "seconds": round(r.seconds, 2), "notes": list(r.notes)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m runner.train.trace SPEC --tiers fast=4,zero3=8 --world-size N --precision bf16`: one JSON list on
    stdout (what `jobspec plan --trace` runs in a process of its own, so that the submitter never imports torch, and
    the runner's rank 0 to size its micro-batch: runner/sizing/traced.py). A tier may come twice (zero3=2,zero3=4)."""
    import argparse
    import json
    import os
    import sys

    from jobspec.errors import JobspecError
    from jobspec.spec.loader import load_spec

    ap = argparse.ArgumentParser(prog="python -m runner.train.trace", description=main.__doc__)
    ap.add_argument("spec")
    ap.add_argument("--tiers", required=True, help="tier=micro-batch pairs, comma-separated")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--precision", default="bf16", choices=sorted(DTYPE))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config is read from disk or the local cache, never fetched
    try:
        tiers = [(t, int(m)) for t, m in (pair.split("=") for pair in args.tiers.split(","))]
        result = trace_spec(load_spec(args.spec, args.overrides), tiers, args.world_size, args.precision)
    except JobspecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
