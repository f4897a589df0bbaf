"""Every private name of torch, accelerate and torchao the runner relies on, and nothing else.

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
- torch FSDP2 `_get_fsdp_state()._is_root`, `_state_ctx.all_states`, `FSDPParam._unsharded_param`,
  `unsharded_accumulated_grad`: after the public `reset_iter_state`, drop the gradients a partial backward
  left, which the redo's backward would add to. Without them the shrink restarts the workers.
- torch FSDP2 iteration state, for torches without `reset_iter_state` (2.6-2.12): `_fsdp_common.TrainingState`, a
  state's `_comm_ctx` (all-gather and reduce-scatter states, post-forward order), `_state_ctx.iter_forward_root`,
  `_modules_to_run_forward`, `_training_state`, and a parameter group's pending all-gather and reduce events,
  `_post_forward_indices`, `_to_sharded()`: `_reset_iter_state`, 2.13's reset done by hand, each attribute where this
  torch has it. Without them an OOM inside FSDP2 restarts the workers.
- torchao `CPUOffloadOptimizer.optim_dict`, `param_d2h_map`, `queue`, `stream`, `device`: `zero2_offload`'s
  `HostAdamW` (runner/train/offload.py) gives torch's optimizer layout and steps on clipped gradients;
  torchao exposes only `step`, `zero_grad` and `state_dict` in its own layout. Required for `zero2_offload`.

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

- transformers `PretrainedConfig._attn_implementation`: which attention kernel a built model runs (packed rows
  are flattened to one row for flash kernels: runner/model/packing.py). transformers sets it from
  `attn_implementation=` and keeps no public getter. Without it: "" (packed rows keep their shape).

- transformers `integrations.moe._grouped_mm` (module global): the experts' grouped matmul of mixture-of-experts
  models (Mixtral, Qwen MoE, OLMoE, DeepSeek-V2, gpt-oss), replaced by `experts_matmul` (installed by
  `install_experts_matmul`). transformers calls torch's grouped_mm whenever torch has it, and torch's CUDA kernel
  (and its meta function, which FakeTensors run) takes bf16 only: a `fast` tier's fp32 master weights, fp16 or fp32
  training would stop at the first MoE layer on a GPU, and the trace could not run them. `experts_matmul` runs the
  matmul at autocast's width (as autocast runs every linear layer: bf16 through grouped_mm, fp16 through
  transformers' own per-expert fallback op, which has a fake kernel) and, without autocast, at the weights' width.
  transformers' `experts_implementation` names only whole forwards. Without it: such runs fail (required for MoE).

Checked on: torch 2.11 (the GPU machine) and 2.13, accelerate 1.15, torchao 0.13 and 0.18, transformers 4.56
and 5.x (`_attn_implementation` only), liger-kernel 0.8.5 (under triton 3.9's interpreter, on CPU only so far),
transformers 5.24 (`integrations.moe`).
peft: no private name is used. Gradient buckets use `torch.cat`/`split` (public), not
`torch._utils._flatten_dense_tensors`.

The layer rule (`lint-imports`, pyproject.toml) lets only this module name these internals.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

from jobspec.errors import ConfigError

log = logging.getLogger("jobspec.runner")

CHECKED = {"torch": "2.11, 2.13", "accelerate": "1.15", "torchao": "0.13, 0.18", "liger-kernel": "0.8.5",
           "transformers": "5.24"}


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _missing(package: str, names: str, needed_for: str) -> ConfigError:
    return ConfigError(
        f"{package} {_version(package)} lacks {names}, which jobspec needs for {needed_for} "
        f"(checked on {package} {CHECKED[package]}): install one of those versions "
        f"(pip install '{package}=={CHECKED[package].split(', ')[-1]}.*'), or a jobspec-k8s release that supports "
        f"{package} {_version(package)}"
    )


# --- accelerate -----------------------------------------------------------------------------------------------


def _accelerate_states() -> tuple[Any, Any, Any]:
    from accelerate.state import AcceleratorState, GradientState, PartialState

    return AcceleratorState, GradientState, PartialState


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so that the next `Accelerator` starts clean (another tier's
    FSDP plugin, another mixed precision). PartialState too: an FSDP run leaves its `distributed_type` at
    FSDP, and the next Accelerator would take FSDP without its plugin."""
    accelerator_state, gradient_state, _ = _accelerate_states()
    if not (_has(accelerator_state, "_reset_state") and _has(gradient_state, "_reset_state")):
        return  # `check` has stopped the run already; a cleanup after it has nothing to reset
    accelerator_state._reset_state(reset_partial_state=True)
    gradient_state._reset_state()


def force_fsdp(accelerator: Any, plugin: Any) -> None:
    """Make `accelerator` treat the model as FSDP2 where accelerate ignored `plugin` (CPU, one GPU without
    LOCAL_RANK): in its state and in PartialState's shared copy, which every later `AcceleratorState()`
    (the optimizer wrapper makes one) copies back over it."""
    from accelerate.utils import DistributedType

    _, _, partial_state = _accelerate_states()
    accelerator.state.distributed_type = partial_state._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def forget_optimizer(accelerator: Any, optimizer: Any) -> None:
    """Drop an optimizer `accelerator.prepare` registered (it would be unscaled and stepped with the others)."""
    accelerator._optimizers.remove(optimizer)


# --- transformers ----------------------------------------------------------------------------------------------


def attention_kernel(model: nn.Module) -> str:
    """The attention implementation `model` runs ("sdpa", "eager", "flash_attention_2", ...), through DDP's and
    peft's wrappers (FSDP2 keeps the module); "" when it has no transformers config."""
    config = getattr(getattr(model, "module", model), "config", None)
    return str(getattr(config, "_attn_implementation", None) or "")


# --- torch: DDP and FSDP2 ---------------------------------------------------------------------------------------


def reset_ddp(model: nn.Module) -> bool:
    """Make DDP forget a gradient reduction an OOM cut short (else the redo's forward raises "Expected to have
    finished reduction in the prior iteration"). False when this torch cannot: the caller restarts instead."""
    reducer = getattr(model, "reducer", None)
    if reducer is None or not hasattr(reducer, "_reset_state"):
        return False
    reducer._reset_state()
    return True


def fsdp_comm_bases() -> tuple[type, type] | None:
    """FSDP2's AllGather and ReduceScatter base classes (what `set_custom_all_gather` takes); None if absent."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError:
        return None
    return AllGather, ReduceScatter


def fsdp_param_groups(unit: nn.Module) -> list[Any] | None:
    """The FSDP parameter groups of one `fully_shard`ed module; None when this torch keeps them elsewhere."""
    try:
        return list(unit._get_fsdp_state()._fsdp_param_groups)
    except AttributeError:
        return None


def fsdp_group_comms(group: Any) -> tuple[Any, Any]:
    """(all-gather, reduce-scatter) comm objects a parameter group uses now: the ones a custom comm wraps."""
    return group._all_gather_comm, group._reduce_scatter_comm


def reset_fsdp(model: nn.Module) -> bool:
    """After an exception inside FSDP2's forward or backward: `FSDPModule.reset_iter_state` (public since torch 2.13;
    `_reset_iter_state` below on older ones), then drop the gradients a partial backward left on the unsharded
    parameters, which it keeps and the redo's backward would add to. True for models that are not FSDP2; False when
    this torch cannot (the caller restarts)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return True
    try:
        state = model._get_fsdp_state()
        if state._is_root is None:  # the step failed before FSDP's lazy init: nothing to reset
            return True
        if hasattr(model, "reset_iter_state"):
            model.reset_iter_state()
        else:
            _reset_iter_state(state)
        for st in state._state_ctx.all_states:
            for param in (p for group in st._fsdp_param_groups for p in group.fsdp_params):
                if getattr(param, "_unsharded_param", None) is not None:
                    param._unsharded_param.grad = None
                param.unsharded_accumulated_grad = None
    except AttributeError as err:
        log.warning("cannot reset FSDP after the OOM (%s): the shrink happens by a restart", err)
        return False
    return True


def _reset_iter_state(root: Any) -> None:
    """torch 2.13's `FSDPState._reset_iter_state` for torch 2.6-2.12 (the GPU machine's 2.11 among them), where FSDP2
    has no reset: every attribute it touches is reset where this torch has it. Without it an OOM inside FSDP2 left
    its states mid-iteration and the shrink restarted the workers (the H100 record's step-down ending in exit 75)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    handle = getattr(root, "_device_handle", None)
    stream = handle.current_stream() if handle is not None and hasattr(handle, "current_stream") else None

    def wait(event: Any) -> None:
        if event is not None and stream is not None:
            stream.wait_event(event)

    comm = root._comm_ctx
    if (ag := getattr(comm, "all_gather_state", None)) is not None:
        wait(getattr(ag, "event", None))
        comm.all_gather_state = None
    for rs in getattr(comm, "reduce_scatter_states", ()) or ():
        wait(getattr(rs, "event", None))
    if hasattr(comm, "reduce_scatter_states"):
        comm.reduce_scatter_states.clear()
    if (rs := getattr(comm, "reduce_scatter_state", None)) is not None:  # the single pending one of older torches
        wait(getattr(rs, "event", None))
        comm.reduce_scatter_state = None
    for event in (getattr(comm, "_last_post_reduce_events", None) or {}).values():
        wait(event)
    if hasattr(comm, "_last_post_reduce_events"):
        comm._last_post_reduce_events.clear()
    if hasattr(comm, "post_forward_order"):
        comm.post_forward_order.clear()
    for st in root._state_ctx.all_states:
        if hasattr(st, "_modules_to_run_forward"):
            st._modules_to_run_forward.clear()
        st._training_state = TrainingState.IDLE
        for group in st._fsdp_param_groups:
            if (result := getattr(group, "_all_gather_result", None)) is not None:
                wait(getattr(result, "all_gather_event", None))
                work = getattr(result, "all_gather_work", None)
                if hasattr(work, "wait"):
                    work.wait()
                group._all_gather_result = None
            for name in ("_post_reduce_event", "_reshard_after_forward_event"):
                if getattr(group, name, None) is not None:
                    wait(getattr(group, name))
                    setattr(group, name, None)
            if getattr(group, "_all_reduce_state", None) is not None:
                wait(getattr(group._all_reduce_state, "event", None))
                group._all_reduce_state = None
            if hasattr(group, "_partial_reduce_output"):
                group._partial_reduce_output = None
            if hasattr(group, "_post_forward_indices"):
                group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    root._state_ctx.iter_forward_root = None
    root._state_ctx.post_backward_final_callback_queued = False


def foreach_mul_(tensors: list[torch.Tensor], scalar: torch.Tensor) -> None:
    """`torch._foreach_mul_`: every tensor times a 0-d tensor, in place, in one kernel a device and dtype (what
    `clip_grads_with_norm_` does, which would allocate the coefficient itself). For runner/train/update.py."""
    torch._foreach_mul_(tensors, scalar)


def scaler_found_inf(scaler: Any, optimizer: Any) -> torch.Tensor:
    """Whether the gradients `scaler.unscale_(optimizer)` unscaled this iteration hold an inf or NaN: the sum of its
    per-device flags (a tensor, no host sync). GradScaler keeps them in `_per_optimizer_states` and reads them only
    inside `step()`, which steps the optimizer whole; runner/train/update.py steps it group by group (fp16 only)."""
    flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    if not flags:
        raise RuntimeError("the scaler holds no inf check for this optimizer: unscale_ it first")
    device = next(iter(flags.values())).device
    return sum((t.to(device) for t in flags.values()), torch.zeros((), device=device))


def fused_amp_step(optimizer: Any) -> bool:
    """Whether `optimizer.step()` takes GradScaler's `found_inf` (and `grad_scale`) as attributes and skips inside
    its kernel, as torch's fused Adam/AdamW do (`_step_supports_amp_scaling`, what GradScaler.step checks)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def reset_scaler(scaler: Any) -> None:
    """Make a `torch.amp.GradScaler` forget this iteration's per-optimizer state (unscaled, found inf) after the
    step that unscaled was given up: GradScaler resets it only in `update()`, which a dropped step never reaches,
    and refuses a second `unscale_` until then. For runner/train/update.py (fp16 only)."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def dispatch_mode() -> type:
    """torch's `TorchDispatchMode` base class (every ATen op of a region passes through a subclass's handler)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def allocates(op: Any) -> bool:
    """Whether ATen `op` returns a fresh tensor (no alias annotation on a tensor result): what an allocator is asked
    for. Views, in-place and `out=` ops alias an argument and allocate nothing; so do c10d's collectives, which
    write into the tensors they are given though their schemas carry no alias annotation (the functional
    collectives of `_c10d_functional` do allocate their results). For runner/oom/anywhere.py."""
    if getattr(op, "namespace", "") == "c10d":
        return False
    returns = getattr(getattr(op, "_schema", None), "returns", ())
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in returns)


# --- Liger Kernel -----------------------------------------------------------------------------------------------

# The kernel's arguments for one chunk, by name; a kernel that asks for one not here is refused by `check_liger`.
# Counts and sums feed only reduction "mean": "none" leaves every row's loss and gradient unscaled.
_LIGER_ARGS = frozenset((
    "X_ptr", "X_stride", "Y_ptr", "Y_stride", "weight_ptr", "loss_ptr", "z_loss_ptr", "loss_stride",
    "token_accuracy_ptr", "token_accuracy_stride", "predicted_tokens_ptr", "predicted_tokens_stride", "n_cols",
    "n_non_ignore", "sum_non_ignore_weight", "weight_sum", "ignore_index", "lse_square_scale", "label_smoothing",
    "reduction", "softcap", "RETURN_Z_LOSS", "RETURN_TOKEN_ACCURACY", "RETURN_PREDICTED_TOKENS", "BLOCK_SIZE",
    "HAS_WEIGHT", "HAS_SOFTCAPPING", "HAS_GRADIENTS",
))  # fmt: skip


def _liger_kernel() -> tuple[Any, int]:
    """(Liger's cross-entropy kernel, its largest block); ImportError without liger-kernel or Triton."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    return liger_cross_entropy_kernel, int(flce.MAX_FUSED_SIZE)


def check_liger(device_type: str) -> None:
    """ConfigError (exit 2) unless Liger's kernel can run here: the package, Triton, a GPU (or Triton's interpreter,
    TRITON_INTERPRET=1, which runs the kernel on CPU tensors: tests), a kernel whose arguments `liger_rows` knows."""
    import os

    asked = "training.loss_kernel liger"
    try:
        kernel, _ = _liger_kernel()
    except ImportError as err:
        raise ConfigError(f"{asked} cannot import Liger's kernel ({err}): pip install 'jobspec-k8s[liger]' in the "
                          "image, or set training.loss_kernel: chunked") from None  # fmt: skip
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"{asked} runs Triton kernels on a GPU, and this rank trains on {device_type}: "
                          "set training.loss_kernel: chunked")  # fmt: skip
    names = set(getattr(kernel, "arg_names", ()))
    unknown = names - _LIGER_ARGS
    if not names or unknown or not {"X_ptr", "Y_ptr", "loss_ptr", "n_cols", "ignore_index", "reduction"} <= names:
        raise _missing("liger-kernel", f"the cross-entropy kernel's arguments as known ({sorted(unknown)} new)",
                       asked)  # fmt: skip


def liger_rows(logits: torch.Tensor, target: torch.Tensor, loss: torch.Tensor, ignore_index: int, grads: bool) -> None:
    """Each row's cross-entropy of `logits` (n, V), contiguous, against `target` (n,) int64 into `loss` (n,) (rows at
    `ignore_index` left as they are), by Liger Kernel's Triton kernel, one program a row; with `grads` the kernel
    overwrites `logits` with the gradient of the rows' sum (softmax - onehot, computed in fp32; 0 at ignored rows).
    On FakeTensors (the memory trace) nothing runs: the kernel allocates nothing, it writes in place."""
    if is_fake(logits):
        return
    import triton

    kernel, largest = _liger_kernel()
    n, vocab = logits.shape
    hip = torch.version.hip is not None
    args = dict(
        X_ptr=logits, X_stride=logits.stride(-2), Y_ptr=target, Y_stride=target.stride(-1), weight_ptr=None,
        loss_ptr=loss, z_loss_ptr=None, loss_stride=loss.stride(-1), token_accuracy_ptr=None,
        token_accuracy_stride=0, predicted_tokens_ptr=None, predicted_tokens_stride=0, n_cols=vocab,
        n_non_ignore=1, sum_non_ignore_weight=1, weight_sum=0.0, ignore_index=ignore_index, lse_square_scale=0.0,
        label_smoothing=0.0, reduction="none", softcap=None, RETURN_Z_LOSS=False, RETURN_TOKEN_ACCURACY=False,
        RETURN_PREDICTED_TOKENS=False, BLOCK_SIZE=min(largest, triton.next_power_of_2(vocab)), HAS_WEIGHT=False,
        HAS_SOFTCAPPING=False, HAS_GRADIENTS=grads,
    )  # fmt: skip
    kernel[(n,)](**{k: v for k, v in args.items() if k in kernel.arg_names}, num_warps=16 if hip else 32)


# --- torchao ----------------------------------------------------------------------------------------------------

OFFLOAD_PARTS = ("optim_dict", "param_d2h_map", "queue", "stream", "device")


def fake_mode() -> Any:
    """torch's FakeTensorMode: tensors with shapes, dtypes and devices but no data (meta parameters go in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or a DTensor's local shard) is a FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(tensor, "_local_tensor", tensor), FakeTensor)


class _NoHandle:
    def remove(self) -> None:
        pass


def _peak_only(tracker: type) -> type:
    """The tracker without its per-module peaks: torch updates every module's after every op, 60 % of a 7B trace."""

    class PeakOnly(tracker):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def reset_peak(self) -> None:
            """Forget the peak so far (the first step's: FSDP's lazy init, no Adam state yet)."""
            self._peak_mem, self._peak_mem_snap = {}, {}

    return PeakOnly


def memory_tracker(model: nn.Module, optimizer: Any, fsdp: bool, inputs: tuple[torch.Tensor, ...]) -> Any:
    """torch's MemTracker (FSDPMemTracker for FSDP2 models) over `model`, `optimizer` and `inputs`, peak-only, with
    `reset_peak()`; a context manager whose `get_tracker_snapshot("peak")` gives device -> category -> bytes."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        tracker = _peak_only(FSDPMemTracker)(model, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    tracker = _peak_only(MemTracker)()
    tracker.track_external(model, optimizer, *inputs)
    # MemTracker hooks every parameter's gradient at its module's first forward, and a frozen parameter
    # (LoRA's base) refuses a hook: mark those as hooked already (torch 2.13; its FSDPMemTracker does not hook)
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
    return tracker


@dataclass(frozen=True)
class OffloadParts:
    """What `HostAdamW` reads of a torchao `CPUOffloadOptimizer`: GPU parameter -> its host optimizer and host
    copy, the queue of gradient copies its `step` waits for, the side stream and the device module's name."""

    optim_dict: dict[torch.Tensor, torch.optim.Optimizer]
    param_d2h_map: dict[torch.Tensor, torch.Tensor]
    queue: dict[torch.Tensor, Any]
    stream: Any
    device: str


def offload_parts(offload: Any) -> OffloadParts:
    """The internals of a built torchao `CPUOffloadOptimizer`, or one ConfigError naming what this torchao lacks."""
    absent = [name for name in OFFLOAD_PARTS if not hasattr(offload, name)]
    if absent:
        raise _missing("torchao", "CPUOffloadOptimizer." + "/".join(absent), "memory.tier zero2_offload")
    return OffloadParts(*(getattr(offload, name) for name in OFFLOAD_PARTS))


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


def _has(obj: Any, *names: str) -> bool:
    return all(hasattr(obj, n) for n in names)


def _registry() -> Iterator[Internal]:
    def always(tier: str, world: int, device: str) -> bool:
        return True

    def sharded_alone(tier: str, world: int, device: str) -> bool:
        return tier != "fast" and (device == "cpu" or world == 1)

    def sharded_ranks(tier: str, world: int, device: str) -> bool:
        return tier != "fast" and world > 1

    yield Internal(
        "accelerate", "AcceleratorState._reset_state/GradientState._reset_state",
        lambda: _has(_accelerate_states()[0], "_reset_state") and _has(_accelerate_states()[1], "_reset_state"),
        "a new Accelerator after a tier step-down", None, always,
    )  # fmt: skip
    yield Internal(
        "accelerate", "PartialState._shared_state",
        lambda: isinstance(getattr(_accelerate_states()[2], "_shared_state", None), dict),
        "a sharded tier in one process (FSDP2 where accelerate ignores the plugin)", None, sharded_alone,
    )  # fmt: skip
    yield Internal(
        "torch", "torch.distributed.fsdp._fully_shard._fsdp_api.AllGather/ReduceScatter",
        lambda: fsdp_comm_bases() is not None,
        "agreeing on an OOM before FSDP's collectives", "a rank-local OOM restarts all ranks", sharded_ranks,
    )  # fmt: skip
    yield Internal(
        "torch", "FSDPModule._get_fsdp_state/reset_iter_state",
        lambda: _has(_fsdp_module(), "_get_fsdp_state", "reset_iter_state"),
        "redoing a step in process after an OOM on a sharded tier", "an OOM shrink restarts the workers",
        lambda tier, world, device: tier != "fast",
    )  # fmt: skip
    yield Internal(
        "torch", "DDP Reducer._reset_state",
        lambda: _has(_reducer_class(), "_reset_state"),
        "redoing a step in process after an OOM inside DDP's backward", "an OOM shrink restarts the workers",
        lambda tier, world, device: tier == "fast" and world > 1,
    )  # fmt: skip


def _fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def _reducer_class() -> Any:
    return getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None)


_warned: set[str] = set()


def check(tier: str, world_size: int, device_type: str) -> None:
    """Stop with one ConfigError if this install lacks an internal the run needs; warn once per lost fallback.

    Called for the tier a run starts at and again for each tier it steps down to (torchao's parts are checked
    when zero2_offload builds its optimizer, since importing torchao costs seconds on every other tier)."""
    missing: list[Internal] = []
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
            missing.append(item)
        elif item.names not in _warned:
            _warned.add(item.names)
            log.warning(
                "%s %s lacks %s (checked on %s): %s",
                item.package, _version(item.package), item.names, CHECKED[item.package], item.fallback,
            )  # fmt: skip
    if missing:
        first, *rest = missing
        err = _missing(first.package, first.names, first.needed_for)
        for more in rest:
            err = ConfigError(f"{err}; also {more.package} {_version(more.package)} lacks {more.names}")
        raise err


# --- transformers: the experts' grouped matmul ---------------------------------------------------------------------


def install_experts_matmul() -> None:
    """transformers' MoE experts matmul replaced by `experts_matmul` (idempotent); ConfigError where this
    transformers has no such function (a mixture-of-experts model cannot then be trained or traced here)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        raise _missing("transformers", "integrations.moe", "training a mixture-of-experts model") from None
    original = getattr(moe, "_grouped_mm", None)
    if original is None or not hasattr(torch.ops, "transformers") or not callable(original):
        raise _missing("transformers", "integrations.moe._grouped_mm", "training a mixture-of-experts model")
    if getattr(original, "__wrapped_by_jobspec__", False):
        return

    def experts_matmul(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        dtype = weight.dtype
        if torch.is_autocast_enabled(device) and dtype == torch.float32:
            dtype = torch.get_autocast_dtype(device)  # what autocast would run a linear layer at
        if dtype == torch.bfloat16:
            return original(input.to(dtype), weight.to(dtype), offs)
        return torch.ops.transformers.grouped_mm_fallback(input.to(dtype), weight.to(dtype), offs=offs)

    experts_matmul.__wrapped_by_jobspec__ = True  # type: ignore[attr-defined]
    moe._grouped_mm = experts_matmul


# --- torch: DCP checkpoint metadata -----------------------------------------------------------------------------


def dcp_private_globals() -> dict[tuple[str, str], Any]:
    """The private globals a DCP `.metadata` pickle names, (module, name) -> what runner/checkpoint/unpickle.py's
    restricted unpickler gives for each (torch 2.13): FileSystemWriter's per-item record `filesystem._StorageInfo`
    (a dataclass: built without running code), the memory-format enum `metadata._MEM_FORMAT_ENCODING` (looked up
    by value only: `Enum(value, names)` would make a new enum), and `torch.serialization._get_layout`, which
    torch's pickle of a layout calls with its name (answered by a lookup among torch's layouts, never called).
    DCP offers no public reader of its metadata other than FileSystemReader's pickle.load, which runs any
    callable the file names. Required to resume or export a checkpoint."""
    from torch.distributed.checkpoint import metadata

    storage_info = dcp_storage_info()
    mem_format = getattr(metadata, "_MEM_FORMAT_ENCODING", None)
    if mem_format is None:
        raise _missing("torch", "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", _DCP_NEED)

    def mem_format_of(value: int) -> Any:
        return mem_format(value)

    mem_format_of.members = dict(mem_format.__members__)  # type: ignore[attr-defined]  # getattr(enum, NAME) form
    return {
        (storage_info.__module__, storage_info.__qualname__): storage_info,
        (mem_format.__module__, mem_format.__qualname__): mem_format_of,
        ("torch.serialization", "_get_layout"): _layout_named,
    }


def dcp_storage_info() -> type:
    """DCP FileSystemWriter's per-item record (`filesystem._StorageInfo`: file name, offset, length), which the
    metadata check reads field by field."""
    from torch.distributed.checkpoint import filesystem

    found = getattr(filesystem, "_StorageInfo", None)
    if not isinstance(found, type):
        raise _missing("torch", "torch.distributed.checkpoint.filesystem._StorageInfo", _DCP_NEED)
    return found


_DCP_NEED = "reading a checkpoint's .metadata without running code from it"


def _layout_named(name: str) -> torch.layout:
    """What torch.serialization._get_layout(name) returns, without calling it: the layout whose str() is `name`."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"no torch layout is named {str(name)[:40]!r}")
