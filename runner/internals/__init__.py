"""Every private name of torch, accelerate and torchao the runner relies on, and nothing else. Read in this order:

    __init__.py    this table, and the start-up check (`check`): which internals a tier needs, and the one
                   error (exit 2) or the one warning when this install lacks one
    versions.py    the versions each was checked on (`CHECKED`), the installed ones, that error's text
    fsdp.py        DDP and FSDP2 after an OOM: `reset_ddp`, `reset_fsdp` (and torch's reset by hand on torches
                   without one), the FSDP2 comms runner/oom/fsdp.py agrees on an OOM before
    states.py      accelerate's process singletons and optimizer registry; transformers' attention kernel and
                   its packed-sequence search
    amp.py         the end of a step: `foreach_mul_`, GradScaler's per-optimizer state (fp16)
    trace.py       the dispatch mode and op schemas (OOM-anywhere), FakeTensors and memory trackers (the trace)
    compiling.py   torch.compile's compilations as they happen (dynamo's callback handler), for the log
    kernels.py     Liger Kernel's cross-entropy kernel, transformers' mixture-of-experts matmul
    offload.py     torchao's CPUOffloadOptimizer, as zero2_offload's HostAdamW reads it
    lowbit.py      torchao's AdamW8bit (training.optimizer adamw_8bit): its states made, saved, handed over
    imports.py     transformers' torchao check, answered "absent" where the run needs no torchao through it
    checkpoint.py  DCP's metadata globals, for the restricted unpickler

Every function is re-exported here: callers write `from runner import internals; internals.reset_fsdp(model)`.

One release of a framework can move any of these; here is the one place to look when it does. Each
entry says what it is for, why no public API does it, what happens without it, and the versions it
was checked on. `check()` runs before each tier is built (runner/train/recipe.py `Recipe._build`): an internal that
the run needs and this install lacks stops the run there with one message naming it and the versions
that have it (exit 2: retrying cannot help), instead of an AttributeError in the middle of training.
An internal with a fallback only logs, once, what is lost without it.

Each internal: what it is for; why no public API does it; what a run loses without it.

- accelerate `AcceleratorState._reset_state`, `GradientState._reset_state`: a second `Accelerator` in one
  process (the in-process tier step-down, tests). accelerate's states are process singletons and only its
  own tests reset them. Required.
- accelerate `PartialState._shared_state`: sharded tiers where accelerate ignores the FSDP plugin (CPU, one
  GPU without LOCAL_RANK). Every later `AcceleratorState()` copies `distributed_type` back from here.
  Required for sharded tiers in one process.
- accelerate `Accelerator._optimizers`: `zero2_offload` drops the placeholder optimizer `prepare` wrapped
  before torchao's replaces it. `prepare` registers every optimizer and nothing unregisters one.
  Required for `zero2_offload`.
- torch DDP `Reducer._reset_state`: redo a step after an OOM inside DDP's backward. DDP has no public
  "abandon this iteration". Without it the shrink restarts the workers.
- torch FSDP2 `_fully_shard._fsdp_api.AllGather` / `ReduceScatter`, `_get_fsdp_state()._fsdp_param_groups`,
  a group's `_all_gather_comm` / `_reduce_scatter_comm`: agree on an OOM before each FSDP collective
  (runner/oom/fsdp.py). `set_custom_all_gather` is public; its base classes and the comm it replaces are
  not. Without them a rank-local OOM restarts all ranks.
- torch FSDP2 `_get_fsdp_state()._is_root`, `_state_ctx.all_states`, a state's parameter groups (2.13 on a list
  `_fsdp_param_groups`, 2.11 and 2.12 one `_fsdp_param_group` or None), `FSDPParam._unsharded_param`,
  `unsharded_accumulated_grad`: after the public `reset_iter_state`, drop the gradients a partial backward
  left, which the redo's backward would add to. Without them the shrink restarts the workers.
- torch FSDP2 iteration state, for torches without `reset_iter_state` (2.11, 2.12): `_fsdp_common.TrainingState`, a
  state's `_comm_ctx` (all-gather and reduce-scatter states, post-forward order), `_state_ctx.iter_forward_root`,
  `_modules_to_run_forward`, `_training_state`, and a parameter group's pending all-gather and reduce events,
  `_post_forward_indices`, `_to_sharded()`: `_reset_iter_state`, 2.13's reset done by hand, each attribute where this
  torch has it. Without them an OOM inside FSDP2 restarts the workers.
- torchao `CPUOffloadOptimizer.optim_dict`, `param_d2h_map`, `queue`, `stream`, `device`: `zero2_offload`'s
  `HostAdamW` (runner/train/offload.py) gives torch's optimizer layout and steps on clipped gradients;
  torchao exposes only `step`, `zero_grad` and `state_dict` in its own layout. Required for `zero2_offload`.

- torchao `_AdamBase._new_buffer`, and `OptimState8bit`'s `codes`, `scale`, `qmap` with `quant_utils`' quantize and
  dequantize: `training.optimizer: adamw_8bit` (runner/internals/lowbit.py). Its first step makes the states (the
  update's `prime` must, before anything changes) and its states are 8-bit blocks that no other layout can read;
  torchao exposes only the optimizer. Required for `adamw_8bit`; checked on torchao 0.18.

- torch `_foreach_mul_`: gradient clipping's in-place scaling with a coefficient allocated ahead of the optimizer
  step (runner/train/update.py), so that nothing in the step's mutating phase allocates. torch's public
  `clip_grads_with_norm_` allocates its coefficient in the middle. Without it: a loop of `mul_`, one kernel a tensor.
- torch `amp.grad_scaler._refresh_per_optimizer_state`, `GradScaler._per_optimizer_states`: fp16 only; forget that
  a step given up after an OOM had unscaled its gradients (runner/train/update.py `Update.abandon`). GradScaler
  resets that only in `update()`. Without it: the redone step's unscale raises. Its `found_inf_per_device` flags and
  the optimizer's `_step_supports_amp_scaling`: the fp16 step group by group, as GradScaler.step would run it whole
  (`scaler_found_inf`, `fused_amp_step`), so that an OOM inside the second group does not step the first twice.
- torch `utils._python_dispatch.TorchDispatchMode` and `OpOverload._schema` (its returns' alias annotations):
  which ATen ops allocate, for the OOM-anywhere injection (runner/oom/anywhere.py). Python reaches the mode and
  an op's schema only through these. Tests and the sweep only; training never uses them.
- torch `_subclasses.fake_tensor.FakeTensorMode`, `distributed._tools.mem_tracker.MemTracker` and
  `fsdp2_mem_tracker.FSDPMemTracker`, with MemTracker's `_update_peak_stats`, `_curr_mem_snap`, `_peak_mem`,
  `_peak_mem_snap` and `_param_to_grad_hook_handles`: the memory trace (runner/train/trace.py), the runner's
  step on FakeTensors. torch ships these as tools without a public namespace. The peak-only override drops the
  per-module peaks torch updates after every op (60 % of a 7B trace); the hook entries stand in for the gradient
  hooks a frozen parameter (LoRA's base) refuses. Needed by `jobspec plan --trace` only; training never uses them.
- torch DCP `filesystem._StorageInfo`, `metadata._MEM_FORMAT_ENCODING`, `serialization._get_layout` (by name): the
  globals a checkpoint's `.metadata` pickle names, admitted by the restricted unpickler (runner/checkpoint/
  unpickle.py). DCP reads its metadata only with pickle.load, which runs any callable the file names. Required
  to resume or export a checkpoint.

- Liger Kernel `liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel` (a Triton JIT function) and
  `liger_kernel.ops.fused_linear_cross_entropy.MAX_FUSED_SIZE`: `training.loss_kernel: liger`, one chunk's
  cross-entropy and its gradient in one kernel, inside the runner's own chunked loss (runner/train/loss.py). Liger's
  public functions take the whole loss (`LigerFusedLinearCrossEntropyFunction`, which returns a summed loss the
  runner's per-token head cannot pass through FSDP2's output cast, or recomputes every chunk in backward for
  per-token losses) or the whole logits (`LigerCrossEntropyFunction`, per-token losses in the logits' 16-bit
  dtype, with three host syncs a call); the kernel is called as their forward calls it, with keywords checked
  against its `arg_names`. Required for `liger` (`check_liger` stops the run with exit 2 before training).
- Liger Kernel `liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN` (its table of a family's
  apply function; each is public, the table is what `AutoLigerKernelForCausalLM` reads): `training.block_kernels:
  liger`, RMSNorm, the gated MLP and RoPE in a built model's blocks (`apply_liger_blocks`). The apply function also
  swaps classes in transformers' modeling module process-wide; those are put back by comparing the module's globals
  before and after. Triton's `JITFunction.run` / the interpreter's `InterpretedFunction.run`: a launch with a
  FakeTensor argument does nothing in the memory trace (`triton_skips_fakes`). Required for `block_kernels: liger`
  (exit 2 where the table or the family is missing).

- torch `_dynamo.callback.callback_handler` (`register_start_callback`, `register_end_callback`, their `remove_`
  twins; its arguments' `callback_trigger` and `compile_id`): each torch.compile compilation logged when it begins
  and ends (runner/train/engine.py `log_compilations`), so that `training.compile`'s first steps, an evaluation's
  graphs or a new micro-batch's are never silent. `torch.compiler` has no public hook. Without it: no such lines.

- transformers `PretrainedConfig._attn_implementation`: which attention kernel a built model runs (packed rows
  are flattened to one row for flash kernels: runner/model/packing.py). transformers sets it from
  `attn_implementation=` and keeps no public getter. Without it: "" (packed rows keep their shape).

- transformers `masking_utils.find_packed_sequence_indices` (module global): answered during the runner's forwards
  as transformers answers for rows the runner knows (`packed_search`: None for rows of one record, the block mask for
  packed rows), without its `.all()` on a device tensor: one host sync a micro-batch. transformers has no switch for
  it (it searches whenever a forward has position ids and neither a mask nor a cache). Without it (4.x releases): no
  search, nothing to skip.

- transformers `integrations.moe._grouped_mm` (module global): the experts' grouped matmul of mixture-of-experts
  models (Mixtral, Qwen MoE, OLMoE, DeepSeek-V2, gpt-oss), replaced by `experts_matmul` (installed by
  `install_experts_matmul`). transformers calls torch's grouped_mm whenever torch has it, and torch's CUDA kernel
  (and its meta function, which FakeTensors run) takes bf16 only: a `fast` tier's fp32 master weights, fp16 or fp32
  training would stop at the first MoE layer on a GPU, and the trace could not run them. `experts_matmul` runs the
  matmul at autocast's width (as autocast runs every linear layer: bf16 through grouped_mm, fp16 through
  transformers' own per-expert fallback op, which has a fake kernel) and, without autocast, at the weights' width.
  transformers' `experts_implementation` names only whole forwards. Without it: such runs fail (required for MoE).

Checked on (`CHECKED`; CI runs each torch, .ci/run and .ci/torch-leg): torch 2.11 (the GPU image's), 2.13 and 2.14
(2.14.1), accelerate 1.15, torchao 0.13 and 0.18, transformers 4.56
and 5.x (`_attn_implementation` only), liger-kernel 0.8.5 (under triton 3.9's interpreter, on CPU only so far),
transformers 5.24 (`integrations.moe`).
peft: no private name is used. Gradient buckets use `torch.cat`/`split` (public), not
`torch._utils._flatten_dense_tensors`.

On a version not checked (newer, older, or between), `check` tries every internal anyway and logs once, at
start-up, the version and what falls back (for torch: how FSDP2 is reset after an OOM); a required internal it
lacks stops the run with exit 2 as above.

The layer rule (`lint-imports`, pyproject.toml) lets only this package name these internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from jobspec.errors import ConfigError
from runner.internals.amp import foreach_mul_, fused_amp_step, reset_scaler, scaler_found_inf
from runner.internals.checkpoint import dcp_private_globals, dcp_storage_info
from runner.internals.compiling import compile_handler, on_compilations
from runner.internals.fsdp import (
    fsdp_comm_bases,
    fsdp_group_comms,
    fsdp_param_groups,
    fsdp_reset_way,
    reducer_class,
    reset_ddp,
    reset_fsdp,
)
from runner.internals.imports import keep_torchao_out_of_transformers
from runner.internals.kernels import (
    apply_liger_blocks,
    check_liger,
    install_experts_matmul,
    liger_blocks_for,
    liger_rows,
    triton_skips_fakes,
)
from runner.internals.lowbit import (
    adamw_8bit,
    check_low_bit,
    dequantized,
    is_low_bit,
    is_quantized,
    keep_tensor_lr,
    new_state,
    requantize_into,
    set_lr,
)
from runner.internals.offload import OFFLOAD_PARTS, OffloadParts, offload_parts
from runner.internals.states import (
    accelerate_states,
    attention_kernel,
    force_fsdp,
    forget_optimizer,
    packed_search,
    reset_accelerate,
)
from runner.internals.trace import allocates, dispatch_mode, fake_mode, is_fake, memory_tracker
from runner.internals.versions import CHECKED, has, installed, log, missing, unchecked

__all__ = [
    "CHECKED",
    "OFFLOAD_PARTS",
    "Internal",
    "OffloadParts",
    "adamw_8bit",
    "allocates",
    "apply_liger_blocks",
    "attention_kernel",
    "check",
    "check_liger",
    "check_low_bit",
    "compile_handler",
    "dcp_private_globals",
    "dcp_storage_info",
    "dequantized",
    "dispatch_mode",
    "fake_mode",
    "force_fsdp",
    "foreach_mul_",
    "forget_optimizer",
    "fsdp_comm_bases",
    "fsdp_group_comms",
    "fsdp_param_groups",
    "fsdp_reset_way",
    "fused_amp_step",
    "install_experts_matmul",
    "installed",
    "is_fake",
    "is_low_bit",
    "is_quantized",
    "keep_tensor_lr",
    "keep_torchao_out_of_transformers",
    "liger_blocks_for",
    "liger_rows",
    "memory_tracker",
    "missing",
    "new_state",
    "offload_parts",
    "on_compilations",
    "packed_search",
    "requantize_into",
    "reset_accelerate",
    "reset_ddp",
    "reset_fsdp",
    "reset_scaler",
    "scaler_found_inf",
    "set_lr",
    "triton_skips_fakes",
]


# --- the start-up check -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Internal:
    """One internal: where it lives, whether it is there, and what a run loses without it."""

    package: str
    names: str
    present: Callable[[], bool]
    needed_for: str
    fallback: str | None  # None: the run cannot go on without it
    applies: Callable[[str, int, str], bool]  # (tier, world_size, device type) -> is it used by this run


def _registry() -> Iterator[Internal]:
    def always(tier: str, world: int, device: str) -> bool:
        return True

    def sharded_alone(tier: str, world: int, device: str) -> bool:
        return tier != "fast" and (device == "cpu" or world == 1)

    def sharded_ranks(tier: str, world: int, device: str) -> bool:
        return tier != "fast" and world > 1

    yield Internal(
        "accelerate", "AcceleratorState._reset_state/GradientState._reset_state",
        lambda: has(accelerate_states()[0], "_reset_state") and has(accelerate_states()[1], "_reset_state"),
        "a new Accelerator after a tier step-down", None, always,
    )  # fmt: skip
    yield Internal(
        "accelerate", "PartialState._shared_state",
        lambda: isinstance(getattr(accelerate_states()[2], "_shared_state", None), dict),
        "a sharded tier in one process (FSDP2 where accelerate ignores the plugin)", None, sharded_alone,
    )  # fmt: skip
    yield Internal(
        "torch", "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather/ReduceScatter",
        lambda: fsdp_comm_bases() is not None,
        "agreeing on an OOM before FSDP's collectives", "a rank-local OOM restarts all ranks", sharded_ranks,
    )  # fmt: skip
    yield Internal(
        "torch", "FSDPModule._get_fsdp_state with reset_iter_state (2.13 on) or FSDP2's iteration state (2.11, 2.12)",
        lambda: fsdp_reset_way() is not None,
        "redoing a step in process after an OOM on a sharded tier", "an OOM shrink restarts the workers",
        lambda tier, world, device: tier != "fast",
    )  # fmt: skip
    yield Internal(
        "torch", "DDP Reducer._reset_state",
        lambda: has(reducer_class(), "_reset_state"),
        "redoing a step in process after an OOM inside DDP's backward", "an OOM shrink restarts the workers",
        lambda tier, world, device: tier == "fast" and world > 1,
    )  # fmt: skip


_warned: set[str] = set()


def check(tier: str, world_size: int, device_type: str) -> None:
    """Stop with one ConfigError if this install lacks an internal the run needs; warn once per lost fallback.

    Called for the tier a run starts at and again for each tier it steps down to (torchao's parts are checked
    when zero2_offload builds its optimizer, since importing torchao costs seconds on every other tier)."""
    _note_unchecked_versions()
    lacking: list[Internal] = []
    for item in _registry():
        if not item.applies(tier, world_size, device_type):
            continue
        try:
            ok = item.present()
        except ImportError:
            ok = False
        if ok:
            continue
        if item.fallback is None:
            lacking.append(item)
        elif item.names not in _warned:
            _warned.add(item.names)
            log.warning(
                "%s %s lacks %s (checked on %s): %s",
                item.package, installed(item.package), item.names, CHECKED[item.package], item.fallback,
            )  # fmt: skip
    if lacking:
        first, *rest = lacking
        err = missing(first.package, first.names, first.needed_for)
        for more in rest:
            err = ConfigError(f"{err}; also {more.package} {installed(more.package)} lacks {more.names}")
        raise err


def _note_unchecked_versions() -> None:
    """Log once per package a version no internal was checked on (newer, older, or between the checked ones): the run
    goes on and tries each internal where it is used; what this version turns out not to have then stops the run
    (a required one, exit 2, below) or falls back (each fallback named here, and logged again when it happens)."""
    for package in CHECKED:
        relation = unchecked(package)
        if relation is None or f"version {package}" in _warned:
            continue
        _warned.add(f"version {package}")
        fallbacks = [f"{item.names}: {item.fallback}" for item in _registry()
                     if item.package == package and item.fallback is not None]  # fmt: skip
        if package == "torch":
            how = {"reset_iter_state": "by torch's reset_iter_state",
                   "by hand": "by hand (2.13's reset, attribute by attribute, where this torch has each)"}.get(
                       fsdp_reset_way() or "", "nowhere: it restarts")  # fmt: skip
            fallbacks.append(f"FSDP2's OOM reset is done {how}")
        log.warning(
            "%s %s is %s the versions jobspec's internals were checked on (%s): trying them anyway. One a run needs "
            "and this version does not have stops the run at start-up (exit 2, naming it); where one falls back: %s",
            package, installed(package), relation, CHECKED[package], "; ".join(fallbacks) or "none falls back",
        )  # fmt: skip

