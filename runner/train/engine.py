"""Device and accelerate for one plan: mixed precision, DDP for `fast`, FSDP2 for the other tiers, the optimizer.

Tier -> FSDP2 (accelerate `fsdp_version=2`, one FSDP unit per transformer block):
    zero2          reshard_after_forward=False: grads and optimizer state sharded, parameters kept
                   gathered between forward and backward (FSDP1's SHARD_GRAD_OP)
    zero2_offload  as zero2, with Adam's states and step on the host (`offload_optimizer`: torchao's
                   CPUOffloadOptimizer, runner/train/offload.py); parameters and gradients stay on the GPU.
                   FSDP2's CPUOffloadPolicy is not used: it would offload the parameters too
    zero3          reshard_after_forward=True: parameters sharded too (FULL_SHARD)
    minimal        as zero3 plus CPUOffloadPolicy (parameters, gradients and the optimizer step on the host)
Activation checkpointing follows `plan.checkpointing` (transformers' non-reentrant checkpointing).
What each tier holds, per device: jobspec/plan/memory.py `_states`, checked by tests/runner/train/test_offload.py.

CPU: accelerate 1.15 turns an `fsdp_plugin` into DistributedType.FSDP only for accelerator device
types (MULTI_GPU, ...); for MULTI_CPU it silently trains with DDP. torch's FSDP2 itself runs on CPU
over gloo, so for sharded tiers on CPU the runner sets the accelerator state to FSDP itself (the same
`fsdp2_prepare_model` path as on GPU). On CPU there is no host to offload to: CPUOffloadPolicy cannot run
(it pins host memory, which needs an accelerator) and torchao's optimizer asserts a CUDA/XPU device, and
either would move nothing, so `minimal` trains as zero3 and `zero2_offload` as zero2 there.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from jobspec.catalog.tiers import HOST_OPTIMIZER_TIERS
from jobspec.errors import ConfigError
from jobspec.spec.models import JobSpec
from runner import internals
from runner.model.build import block_class_names, transformer_blocks
from runner.model.quantize import unsharded_on_one_rank
from runner.sizing.hostmem import HostInfo
from runner.sizing.plan import Plan
from runner.sizing.probe import DeviceInfo, probe_device

log = logging.getLogger("jobspec.runner")
MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}  # plan precision -> accelerate mixed_precision
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PARAM_OFFLOAD_TIERS = ("minimal",)  # FSDP2 CPUOffloadPolicy: parameters, gradients and the step on the host
OPTIMIZER_OFFLOAD_TIERS = ("zero2_offload",)  # torchao: optimizer states and the step on the host
RESHARD_TIERS = ("zero3", "minimal")
BETAS = (0.9, 0.95)
# accelerate's engine switches in the environment: its launcher sets them, a shell may have them, and accelerate sets
# ACCELERATE_USE_FSDP itself whenever it is given an FSDP plugin, for the rest of the process and every process it
# starts. Left there, the next `Accelerator` without a plugin (the `fast` tier after a sharded one in the same
# process, or in a process started from it) builds FSDP1 around the model on a GPU, whose state an OOM mid-backward
# leaves dirty: the H100's relaunch crash (bench/gpu/records/2026-11-25-h100, "Expects the handle training to be
# IDLE"). transformers reads ACCELERATE_USE_FSDP too (meta-device loading). The plan decides the engine, so they are
# removed before each Accelerator is built and after.
ACCELERATE_SWITCHES = (
    "ACCELERATE_USE_FSDP",
    "ACCELERATE_USE_DEEPSPEED",
    "ACCELERATE_USE_MEGATRON_LM",
    "ACCELERATE_USE_PARALLELISM_CONFIG",
)


def pick_device(spec: JobSpec, local_rank: int, host: HostInfo) -> tuple[torch.device, DeviceInfo]:
    """This rank's GPU (index = local rank), or the CPU for vendor cpu or when no GPU is visible."""
    use_gpu = spec.hardware.vendor != "cpu" and torch.cuda.is_available()
    if spec.hardware.vendor != "cpu" and not use_gpu:
        log.warning("hardware.vendor is %s but no GPU is visible: training on the CPU", spec.hardware.vendor)
    if not use_gpu:  # also when GPUs exist but the spec says cpu: the planner must see the CPU
        return torch.device("cpu"), DeviceInfo(
            "cpu", "cpu", host.total_bytes, host.available_bytes, None, False, 0, "cpu", 0
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device, probe_device(local_rank, host=host)


def make_optimizer(model: nn.Module, spec: JobSpec, device: torch.device, tier: str,
                   planned: str = "adamw") -> torch.optim.Optimizer:  # fmt: skip
    """AdamW on the trainable parameters; weight decay on matrices only (not biases, norms); fused, on every device.

    The fused kernel (CUDA's, and the CPU's for `minimal`'s host parameters and CPU runs) updates a parameter group
    in one op that allocates nothing, so an OOM cannot land half-way through the update (runner/train/update.py);
    on the CPU it is also faster than torch's default loop (tiny preset: measured in bench/overhead.py). For
    zero2_offload on a GPU this AdamW only carries the parameter groups: `prepare` hands them, once FSDP2 has
    sharded them, to `offload_optimizer` (whose host AdamWs are fused CPU ones, runner/train/offload.py).

    `training.optimizer: adamw_8bit` (or auto, where the plan chose it: `planned`): torchao's AdamW8bit (runner/
    internals/lowbit.py) on the tiers whose optimizer state is on the GPU; the offload tiers keep this fp32 AdamW,
    its moments on the host (`uses_low_bit`). `sgd`: torch's SGD, no momentum: no state; fused at `fast`, and on
    FSDP2's tiers the foreach step (torch's fused SGD kernel has no DTensor sharding rule: NotImplementedError), which
    without weight decay adds the gradients in place and allocates nothing either."""
    groups = param_groups(model, spec.training.weight_decay)
    asked = spec.training.optimizer
    if asked == "sgd":  # fused where the parameters are plain tensors; FSDP2's DTensors have no rule for its kernel
        log.info("optimizer: SGD without momentum (training.optimizer sgd): no optimizer state")
        fused = tier == "fast"
        return torch.optim.SGD(groups, lr=spec.training.peak_lr, momentum=0.0, fused=fused, foreach=not fused)
    if uses_low_bit(spec, tier, planned):
        log.info("optimizer: torchao AdamW8bit (training.optimizer %s%s): Adam's moments in 8 bits; its first step "
                 "compiles one kernel per parameter shape (torch.compile), later steps reuse them", asked,
                 ": AdamW's fp32 moments do not fit at tier " + tier if asked == "auto" else "")  # fmt: skip
        return internals.adamw_8bit(groups, spec.training.peak_lr, BETAS)
    if asked == "adamw_8bit":
        log.info("optimizer: AdamW with fp32 moments at tier %s, which keeps them in host memory (training.optimizer "
                 "adamw_8bit quantizes them on the tiers that keep them on the GPU)", tier)  # fmt: skip
    return torch.optim.AdamW(groups, lr=spec.training.peak_lr, betas=BETAS, fused=True)


def uses_low_bit(spec: JobSpec, tier: str, planned: str = "adamw") -> bool:
    """Whether `tier` steps with 8-bit Adam states: the spec asks for them (adamw_8bit, or auto where the plan chose
    them: `planned`) and the tier keeps its optimizer state on the GPU (an offload tier's states cost host memory
    only, and its host AdamW is torch's fused fp32 one)."""
    asked = spec.training.optimizer == "adamw_8bit" or planned == "adamw_8bit"
    return asked and tier not in HOST_OPTIMIZER_TIERS


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The trainable parameters in two AdamW groups: weight decay on matrices only (not biases, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def offload_optimizer(optimizer: torch.optim.Optimizer, device: torch.device, tier: str) -> torch.optim.Optimizer:
    """The optimizer a tier steps with, given `optimizer` over the parameters as FSDP2 left them.

    zero2_offload on a GPU: `HostAdamW` over the same groups (runner/train/offload.py: torchao's CPUOffloadOptimizer,
    Adam's states and step on the host); SGD, which has no state, steps on the GPU. Otherwise `optimizer` itself:
    `minimal` offloads through FSDP2's CPUOffloadPolicy, and on CPU the parameters already live where the states
    would go."""
    if tier not in OPTIMIZER_OFFLOAD_TIERS or device.type != "cuda" or not isinstance(optimizer, torch.optim.AdamW):
        return optimizer  # SGD: no state to offload
    from runner.train.offload import HostAdamW

    return HostAdamW(optimizer)


def clear_switches(*, warn: bool) -> list[str]:
    """Remove accelerate's engine switches (`ACCELERATE_SWITCHES`) from this process's environment; the ones that
    were on. With `warn`, a user's setting is logged once: the tier decides the engine."""
    on = [name for name in ACCELERATE_SWITCHES if os.environ.pop(name, "").strip().lower() in ("1", "true", "yes")]
    if on and warn:
        log.warning("ignoring %s from the environment: the memory tier decides the engine (FSDP2 or DDP)",
                    ", ".join(on))  # fmt: skip
    return on


def fsdp_plugin(plan: Plan, model: nn.Module, device: torch.device) -> Any:
    """accelerate's FSDP2 plugin for `plan.tier`, or None for `fast` (DDP over several ranks)."""
    if plan.tier == "fast":
        return None
    offload = plan.tier in PARAM_OFFLOAD_TIERS
    if offload and device.type != "cuda":
        log.info("tier %s on CPU: sharding without CPU offload (the weights already live on the CPU)", plan.tier)
        offload = False
    return sharding_plugin(plan.tier, plan.precision, model, offload=offload)


def sharding_plugin(tier: str, precision: str, model: nn.Module, *, offload: bool) -> Any:
    """accelerate's FSDP2 plugin for a sharded tier: one unit per block, mixed precision, resharding per tier."""
    from accelerate import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    mp = None
    if precision != "fp32":  # compute in bf16/fp16, keep fp32 masters, reduce gradients in fp32
        dt = DTYPE[precision]
        mp = {"param_dtype": dt, "reduce_dtype": torch.float32, "output_dtype": dt}
    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=tier in RESHARD_TIERS,
        cpu_offload=CPUOffloadPolicy(pin_memory=True) if offload else False,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=block_class_names(model),
        state_dict_type="SHARDED_STATE_DICT",
        mixed_precision_policy=mp,
        ignored_modules=unsharded_on_one_rank(model) or None,  # a 4-bit base on one rank (runner/model/quantize.py)
    )


def enable_checkpointing(model: nn.Module, *, lora: bool) -> None:
    """transformers' non-reentrant activation checkpointing of every block."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora:  # frozen embeddings: let the checkpointed blocks' inputs carry grad
        model.enable_input_require_grads()


def compile_model(model: nn.Module, scope: str) -> int:
    """torch.compile `model` in place (`training.compile`), state-dict keys unchanged; the modules compiled.

    `blocks`: each transformer block on its own (regional compilation, as torchtitan and accelerate do it): the
    blocks share their code, so dynamo compiles it once and every layer reuses it, where one graph of the whole model
    takes a compile per layer; FSDP2's hooks run eagerly between the blocks (dynamo skips them), a checkpointed block
    recomputes its compiled forward, and the chunked loss head stays eager (runner/train/loss.py). `model`: the whole
    model in one graph (slower to compile, graph breaks at FSDP2's hooks). `off`: nothing."""
    if scope == "off":
        return 0
    if scope == "model":
        model.compile()
        return 1
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile()
    return len(blocks)


COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "triton")  # where its errors are defined


def compile_failure(err: BaseException, scope: str) -> ConfigError | None:
    """The ConfigError (exit 2) for an error of torch.compile's own (dynamo, AOT autograd, inductor, Triton's
    compiler: the error or one it was raised from), None for any other. Compiling the same model with the same torch
    fails again at the next attempt, so it is no crash to retry (exit 1 and a traceback before: seen with no C++
    compiler for inductor's CPU code, and with inductor 2.11's C++ for Qwen3-Next's linear attention)."""
    if scope == "off":
        return None
    chain: list[BaseException] = []
    cause: BaseException | None = err
    while cause is not None and all(cause is not c for c in chain):
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    if any(isinstance(c, torch.OutOfMemoryError) for c in chain):
        return None  # memory, not the compiler (inductor's autotuning allocates): the OOM handling's
    for cause in chain:
        if type(cause).__module__.startswith(COMPILER_MODULES):
            first = " ".join(str(err).split("Set TORCHDYNAMO_VERBOSE")[0].split())[:300]  # its reason, one line
            return ConfigError(
                f"training.compile {scope}: torch {torch.__version__} could not compile the model "
                f"({type(err).__name__}: {first}); set training.compile: off to train it without compiling, or "
                "fix what torch names (inductor's CPU code needs a C++ compiler; its GPU code needs Triton)"
            )
    return None


_UNLOG: list[Callable[[], None]] = []  # removes the registration `log_compilations` made last in this process


def log_compilations() -> None:
    """Log each torch.compile compilation as it begins and ends (`internals.on_compilations`), as a phase is logged:
    a compiled model's first steps, an evaluation's graphs and a new micro-batch's shapes compile inside steps, for
    seconds to minutes, and the log says so. Registered once per process (again after each call: a model built again
    after a tier step-down, or `torch.compiler.reset()`, which clears torch's handler)."""
    while _UNLOG:
        _UNLOG.pop()()
    began: dict[str, tuple[float, float]] = {}

    def start(what: str, cid: str) -> None:
        began[cid] = (time.perf_counter(), time.process_time())
        log.info("torch.compile %s: compiling %s ...", cid, what)

    def end(what: str, cid: str) -> None:  # torch calls it on the way out of the compilation, raising or not
        wall, cpu = began.pop(cid, (time.perf_counter(), time.process_time()))
        failed = sys.exc_info()[0]
        if failed is not None:
            log.info("torch.compile %s: compiling %s: failed after %.2f s (%s)", cid, what, time.perf_counter() - wall,
                     failed.__name__)  # fmt: skip
            return
        log.info("torch.compile %s: compiling %s: done in %.2f s (CPU %.2f s)", cid, what,
                 time.perf_counter() - wall, time.process_time() - cpu)  # fmt: skip

    remove = internals.on_compilations(start, end)
    if remove is None:
        log.warning("torch %s has no compile callback handler (torch._dynamo.callback): the compiled blocks compile "
                    "inside the first steps without a log line of their own", torch.__version__)  # fmt: skip
        return
    _UNLOG.append(remove)


def prepare(
    plan: Plan,
    spec: JobSpec,
    device: torch.device,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> tuple[Any, nn.Module, Any]:
    """(accelerator, model, optimizer) ready to train: placed, wrapped (DDP/FSDP2), autocast set up."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    if device.type == "cpu" and plan.precision == "fp16":
        raise ConfigError("training.precision fp16: fp16 autocast needs a GPU; use bf16 or fp32 on CPU")
    if plan.checkpointing:
        enable_checkpointing(model, lora=spec.model.lora is not None)
    plugin = fsdp_plugin(plan, model, device)
    clear_switches(warn=True)
    # dynamo_backend "no": accelerate would take ACCELERATE_DYNAMO_BACKEND from the environment; `training.compile` is
    # the spec's switch (below)
    accelerator = Accelerator(mixed_precision=MIXED[plan.precision], cpu=device.type == "cpu", fsdp_plugin=plugin,
                              dynamo_backend="no")  # fmt: skip
    clear_switches(warn=False)
    if plugin is not None and accelerator.distributed_type != DistributedType.FSDP:
        # accelerate ignores the plugin on CPU (and on one GPU without LOCAL_RANK): see the module docstring.
        # Left so, it would take the model for DDP (a no_sync that syncs every micro-step, clipping that
        # ignores the DTensor shards).
        internals.force_fsdp(accelerator, plugin)
    whole = unsharded_on_one_rank(model) if plugin is not None else []  # FSDP2 leaves them where they are
    model, optimizer = accelerator.prepare(model, optimizer)  # FSDP2 swaps the sharded parameters in
    for module in whole:
        module.to(device)
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wrapper
    stepping = offload_optimizer(inner, device, plan.tier)
    if stepping is not inner:
        placeholder = optimizer  # it holds no state yet; dropped so that fp16 unscaling sees each gradient once
        optimizer = accelerator.prepare_optimizer(stepping, device_placement=False)
        internals.forget_optimizer(accelerator, placeholder)
        log.info("engine: optimizer states and step on the host (torchao CPUOffloadOptimizer)")
    compiled = compile_model(model, spec.training.compile)
    if compiled:
        log_compilations()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls on tensor cores (TF32), Ampere and later
        torch.backends.cudnn.allow_tf32 = True
    where = "FSDP2" if plugin is not None else "DDP" if plan.world_size > 1 else "single process"
    log.info(
        "engine: accelerate %s, mixed precision %s, checkpointing %s, compile %s%s",
        where,
        MIXED[plan.precision],
        plan.checkpointing,
        spec.training.compile,
        f" ({compiled} module(s); the first steps compile them)" if compiled else "",
    )
    return accelerator, model, optimizer
