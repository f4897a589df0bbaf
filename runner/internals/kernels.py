"""Liger Kernel's cross-entropy kernel and block kernels, and transformers' mixture-of-experts matmul."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from jobspec.errors import ConfigError
from runner.internals.trace import is_fake
from runner.internals.versions import missing

T = TypeVar("T")

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


def _liger_here(field: str, fallback: str, what: str, load: Callable[[], T], device_type: str) -> T:
    """`load()` (an import of Liger's), or ConfigError (exit 2) naming `training.<field>` and its `fallback` value:
    without the package, or on a device where Triton kernels do not run (a GPU's, or Triton's interpreter on CPU
    tensors, TRITON_INTERPRET=1: tests)."""
    import os

    try:
        loaded = load()
    except ImportError as err:
        raise ConfigError(f"training.{field} liger cannot import {what} ({err}): pip install 'jobspec-k8s[liger]' in "
                          f"the image, or set training.{field}: {fallback}") from None  # fmt: skip
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(f"training.{field} liger runs Triton kernels on a GPU, and this rank trains on "
                          f"{device_type}: set training.{field}: {fallback}")  # fmt: skip
    return loaded


def check_liger(device_type: str) -> None:
    """ConfigError (exit 2) unless Liger's kernel can run here: the package, Triton, a GPU (or Triton's interpreter,
    TRITON_INTERPRET=1, which runs the kernel on CPU tensors: tests), a kernel whose arguments `liger_rows` knows."""
    asked = "training.loss_kernel liger"
    kernel, _ = _liger_here("loss_kernel", "chunked", "Liger's kernel", _liger_kernel, device_type)
    names = set(getattr(kernel, "arg_names", ()))
    unknown = names - _LIGER_ARGS
    if not names or unknown or not {"X_ptr", "Y_ptr", "loss_ptr", "n_cols", "ignore_index", "reduction"} <= names:
        raise missing("liger-kernel", f"the cross-entropy kernel's arguments as known ({sorted(unknown)} new)",
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


def install_experts_matmul() -> None:
    """transformers' MoE experts matmul replaced by `experts_matmul` (idempotent); ConfigError where this
    transformers has no such function (a mixture-of-experts model cannot then be trained or traced here)."""
    try:
        from transformers.integrations import moe
    except ImportError:
        raise missing("transformers", "integrations.moe", "training a mixture-of-experts model") from None
    original = getattr(moe, "_grouped_mm", None)
    if original is None or not hasattr(torch.ops, "transformers") or not callable(original):
        raise missing("transformers", "integrations.moe._grouped_mm", "training a mixture-of-experts model")
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


# --- Liger Kernel's block kernels (`training.block_kernels: liger`) -------------------------------------------------

_LIGER_BLOCK_KINDS = ("rms_norm", "swiglu", "geglu", "rope")  # what a family's apply function may switch on
_LIGER_LOSS_KINDS = ("cross_entropy", "fused_linear_cross_entropy")  # the runner keeps its own loss head


_SKIPPING: list[int] = [0]  # open `triton_skips_fakes` contexts: a trace of a model with Liger's blocks


def _triton_runs_here(tensor: torch.Tensor) -> bool:
    """Whether a Triton kernel runs on `tensor`: a GPU's, Triton's interpreter on CPU tensors (tests), or a FakeTensor
    in the trace of a model with Liger's blocks (whose launches `triton_skips_fakes` turns into nothing)."""
    import os

    if is_fake(tensor):
        return _SKIPPING[0] > 0
    return tensor.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _gpu_or_plain(liger: Callable[..., Any], plain: Callable[..., Any]) -> Callable[..., Any]:
    """A modeling module's function (RoPE) that runs Liger's where Triton runs and transformers' own elsewhere: the
    module's name is process-wide, and a model of the same family on the CPU (an export) must still run."""

    def either(q: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (liger if _triton_runs_here(q) else plain)(q, *args, **kwargs)

    either.__wrapped_by_jobspec__ = (liger, plain)  # type: ignore[attr-defined]
    return either


def liger_blocks_for(model_type: str, device_type: str | None = None) -> Callable[..., Any]:
    """Liger's apply function for `model_type`; ConfigError (exit 2) naming the fix without liger-kernel, for a
    family it has no kernels for, and (`device_type` given) where Triton kernels do not run. The supervisor's
    preflight asks before any worker starts (no device yet), the build again on its device."""
    import importlib

    asked = "training.block_kernels liger"

    def load() -> Any:
        return importlib.import_module("liger_kernel.transformers.monkey_patch")

    monkey_patch = _liger_here("block_kernels", "plain", "Liger Kernel", load, device_type or "cuda")
    table = getattr(monkey_patch, "MODEL_TYPE_TO_APPLY_LIGER_FN", None)
    if not isinstance(table, dict):
        raise missing("liger-kernel", "transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN", asked)
    apply = table.get(model_type)
    if apply is None:
        raise ConfigError(f"{asked}: Liger Kernel {_version('liger_kernel')} has no kernels for model_type "
                          f"{model_type!r}: set training.block_kernels: plain")  # fmt: skip
    return apply


def apply_liger_blocks(model: Any, model_type: str, device_type: str, *, experts: bool = False) -> list[str]:
    """Liger Kernel's RMSNorm, gated MLP (SwiGLU / GeGLU) and RoPE in `model`'s blocks, by Liger's own function for
    the family (`MODEL_TYPE_TO_APPLY_LIGER_FN`, given this instance), its loss patches off. That function also
    swaps the family's classes and functions in transformers' modeling module for every later model of the process:
    those are put back, and RoPE (which transformers' attention calls by the module's name) is swapped for a function
    that runs Liger's where Triton runs. Returns what it switched on ("RMSNorm x5", ...). ConfigError (exit 2)
    without liger-kernel, off a GPU, or for a family Liger has no kernels for. Before LoRA: the patched MLP calls its
    projections as modules, which peft then wraps. `experts` (a mixture of experts): the MLPs stay transformers' (Liger
    swaps the experts for its fused MoE kernel, which autotunes on a GPU only and would replace the runner's experts
    matmul and LoRA on the experts' weights); norms and RoPE are Liger's."""
    import inspect
    import logging
    import sys

    apply = liger_blocks_for(model_type, device_type)
    accepts = inspect.signature(apply).parameters
    kwargs = {k: not (experts and k in ("swiglu", "geglu")) for k in _LIGER_BLOCK_KINDS if k in accepts}
    kwargs |= {k: False for k in _LIGER_LOSS_KINDS if k in accepts}
    logging.getLogger("liger_kernel.backends.registry").setLevel(logging.ERROR)  # its optional backends (CuTe DSL,
    # Ascend) that this image does not carry, one warning each
    modules = {name: mod for name, mod in sys.modules.items() if name.startswith("transformers.models.")}
    before = {name: dict(vars(mod)) for name, mod in modules.items()}
    forwards = {id(m): m.forward for m in model.modules()}
    apply(model=model, **kwargs)
    rope = False
    for name, mod in modules.items():
        for attr, now in list(vars(mod).items()):
            old = before[name].get(attr, now)
            if now is old:
                continue
            if inspect.isfunction(now) and inspect.isfunction(old) and "rotary" in attr:
                plain = getattr(old, "__wrapped_by_jobspec__", (None, old))[1]  # a model built again (a step-down)
                setattr(mod, attr, _gpu_or_plain(now, plain))
                rope = True
            else:
                setattr(mod, attr, old)  # a class swapped for every later model: back
    swapped: dict[str, int] = {}
    for m in model.modules():
        if m.forward != forwards.get(id(m), m.forward):
            kind = type(m).__name__
            swapped[kind] = swapped.get(kind, 0) + 1
    applied = [f"{kind} x{n}" for kind, n in sorted(swapped.items())] + (["RoPE"] if rope else [])
    if not applied:
        raise missing("liger-kernel", f"the {model_type} blocks' kernels (nothing was patched)",
                      "training.block_kernels liger")
    return applied


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return "(version unknown)"


@contextlib.contextmanager
def triton_skips_fakes() -> Iterator[None]:
    """Triton launches with a FakeTensor argument do nothing (the memory trace runs Liger's autograd functions for
    what they allocate and save; their kernels write in place, and there is nothing to write on a fake). Inside it,
    the RoPE that `apply_liger_blocks` swapped in runs Liger's on fakes too; outside (a model traced without Liger's
    blocks), transformers' own."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    saved = [(cls, cls.__dict__["run"]) for cls in classes if "run" in cls.__dict__]

    def skipping(run: Callable[..., Any]) -> Callable[..., Any]:
        def run_unless_fake(self: Any, *args: Any, **kwargs: Any) -> Any:
            if any(isinstance(a, torch.Tensor) and is_fake(a) for a in (*args, *kwargs.values())):
                return None
            return run(self, *args, **kwargs)

        return run_unless_fake

    for cls, run in saved:
        cls.run = skipping(run)
    _SKIPPING[0] += 1
    try:
        yield
    finally:
        _SKIPPING[0] -= 1
        for cls, run in saved:
            cls.run = run
