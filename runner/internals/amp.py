"""The end of a step: in-place gradient scaling, and GradScaler's per-optimizer state (fp16)."""

from __future__ import annotations

from typing import Any

import torch


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
