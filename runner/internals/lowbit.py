"""torchao's 8-bit AdamW (`training.optimizer: adamw_8bit`): its states as the runner makes, saves, hands them over.

torchao's `AdamW8bit` keeps Adam's two moments as `OptimState8bit` tensors (uint8 codes into a dynamic map and one
fp32 scale per block of 256 values, after bitsandbytes), for every tensor of at least 4096 values that divides into
blocks; smaller ones stay fp32. Its public surface is the optimizer; what the runner needs beyond it is here:

- `new_state`: the state its first step would create, made before the step (runner/train/update.py `prime`), through
  its private `_new_buffer` (the only code that knows which tensors it quantizes, and wraps a shard's in a DTensor).
- `dequantized` / `requantize_into`: the moments as fp32 for checkpoints and the tier hand-over (DCP reshards plain
  tensors by rows; 8-bit blocks do not survive another layout), and back. `requantize_into` finds the scale the
  values were made with (the block's extreme is the map's 1.0, or its most negative entry), so a state saved and
  read back on the same layout has the same codes and scales bit for bit; on another layout (another tier, another
  world size) the values are quantized afresh in the new blocks.
- `set_lr`: torchao keeps each group's lr as a 0-d tensor (its compiled step would recompile for every new float)
  and refuses a float there; torch's optimizers take either.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from jobspec.errors import ConfigError
from runner.internals.versions import missing

MIN_QUANTIZED = 4096  # torchao (after bitsandbytes) quantizes a state of at least this many values
BLOCK = 256  # values per fp32 scale (AdamW8bit's default block_size)


def adamw_8bit(groups: list[dict[str, Any]], lr: float, betas: tuple[float, float]) -> torch.optim.Optimizer:
    """torchao's AdamW8bit over `groups`; ConfigError (exit 2) naming the fix when torchao is not installed."""
    check_low_bit()
    from torchao.optim import AdamW8bit

    return AdamW8bit(groups, lr=lr, betas=betas, block_size=BLOCK)


def check_low_bit() -> None:
    """ConfigError (exit 2) before any work unless torchao's AdamW8bit and what the runner reads of it are here."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as exc:
        raise ConfigError(
            f"training.optimizer adamw_8bit or auto needs torchao, which this install cannot import ({exc}): "
            "pip install 'jobspec-k8s[offload]' (the GPU images carry it), or use training.optimizer: adamw"
        ) from None
    if not hasattr(AdamW8bit, "_new_buffer"):
        raise missing("torchao", "_AdamBase._new_buffer", "training.optimizer adamw_8bit")


def is_low_bit(optimizer: Any) -> bool:
    """Whether `optimizer` is torchao's AdamW8bit (without importing torchao where nothing did)."""
    module = sys.modules.get("torchao.optim")
    cls = getattr(module, "AdamW8bit", None)
    return cls is not None and isinstance(optimizer, cls)


def new_state(optimizer: Any, p: torch.Tensor) -> dict[str, Any]:
    """The state AdamW8bit's first step creates for `p` (torchao/optim/adam.py `_AdamBase.step`): step 0 (a 0-d fp32
    on the CPU, as it makes it) and the two moments, 8-bit where it would quantize them."""
    if not hasattr(optimizer, "_new_buffer"):
        raise missing("torchao", "_AdamBase._new_buffer", "training.optimizer adamw_8bit")
    return {"step": torch.tensor(0.0), "exp_avg": optimizer._new_buffer(p, True),
            "exp_avg_sq": optimizer._new_buffer(p, False)}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def is_quantized(t: Any) -> bool:
    """Whether `t` (or a DTensor's local shard) is one of torchao's 8-bit states."""
    if not torch.is_tensor(t):
        return False
    local = _local(t)
    return hasattr(local, "codes") and hasattr(local, "qmap") and hasattr(local, "dequantize")


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """An 8-bit state as fp32 values on the host, shaped and sharded like it (a DTensor stays one, its local shard on
    the host): one tensor's fp32 copy on the device at a time."""
    local = _local(t)
    values = local.dequantize(torch.float32)
    if isinstance(t, DTensor):
        out = DTensor.from_local(values, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                 stride=t.stride())  # fmt: skip
        return out.to("cpu")
    return values.to("cpu")


def _exact_scales(blocks: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """Each block's scale: the one that gives back `blocks` exactly when they are a dequantized state of this layout,
    else the one torchao would choose. The block's largest value came from the map's 1.0 or its most negative entry
    (the original extreme, |x| = scale), or from the entry next to 1.0 when that extreme was negative; each quotient
    and its fp32 neighbours are tried, on the blocks not matched yet."""
    from torchao.optim.quant_utils import dequant_with_qmap, quantize_8bit_with_qmap

    absmax, where = blocks.abs().max(-1)
    extreme = blocks.gather(1, where[:, None]).squeeze(1)
    signed = bool(qmap[0] < 0)
    first = torch.where((extreme < 0) & signed, -qmap[0], qmap[-1])
    entries = [
        first,
        *([torch.full_like(first, float(-qmap[0])), torch.full_like(first, float(qmap[-2]))] if signed else []),
    ]
    chosen = absmax.clamp_min(1e-12)  # torchao's own choice (scale_tensor), for values of another layout
    todo = torch.arange(len(blocks), device=blocks.device)
    for entry in entries:
        base = (absmax[todo] / entry[todo]).clamp_min(1e-12)  # scale_tensor's clip for a block of zeros
        for step in (None, 2.0, 0.0):  # the quotient, one ulp up, one ulp down
            if not len(todo):
                return chosen
            scale = base if step is None else torch.nextafter(base, base * step)
            part = blocks[todo]
            codes = quantize_8bit_with_qmap(part / scale[:, None], qmap)
            same = (dequant_with_qmap(codes, qmap, scale).view_as(part) == part).all(-1)
            chosen[todo[same]] = scale[same]
            todo, base = todo[~same], base[~same]
    return chosen


@torch.no_grad()
def requantize_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write fp32 `src` (the host copy `dequantized` made, or one cut for this rank) into the 8-bit state `dst` of the
    same local shape: bit for bit the state it came from on the same layout, quantized afresh on another."""
    from torchao.optim.quant_utils import quantize_8bit_with_qmap

    target, values = _local(dst), _local(src)
    blocks = values.to(target.codes.device, torch.float32).reshape(-1, target.block_size)
    scale = _exact_scales(blocks, target.qmap)
    codes = quantize_8bit_with_qmap(blocks / scale[:, None], target.qmap)
    target.codes.copy_(codes.view(target.codes.shape))
    target.scale.copy_(scale)


def keep_tensor_lr(optimizer: Any) -> None:
    """After a `load_state_dict` (a checkpoint's or a hand-over's groups carry the lr as a float): torchao's groups
    get theirs back as 0-d tensors, so that no step between (DCP's state initialisation) meets a float."""
    if is_low_bit(optimizer):
        for group in optimizer.param_groups:
            if not isinstance(group["lr"], torch.Tensor):
                group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)


def set_lr(optimizer: Any, lr: float) -> None:
    """Every group's learning rate: in place into torchao's 0-d tensor (a float read back from a checkpoint of
    another optimizer becomes one), a float for any other optimizer."""
    low_bit = is_low_bit(optimizer)
    for group in optimizer.param_groups:
        if not low_bit:
            group["lr"] = float(lr)
        elif isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = torch.tensor(lr, dtype=torch.float32)
