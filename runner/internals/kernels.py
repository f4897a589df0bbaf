"""Liger Kernel's cross-entropy kernel and transformers' mixture-of-experts matmul."""

from __future__ import annotations

from typing import Any

import torch

from jobspec.errors import ConfigError
from runner.internals.trace import is_fake
from runner.internals.versions import missing

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
