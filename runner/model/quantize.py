"""A 4-bit frozen base for LoRA (`model.quantize: nf4`, QLoRA): torchao's NF4Tensor in the blocks' linear layers.

What it holds: `quantize_base` swaps the weight of every `nn.Linear` inside the transformer blocks (the layers
FSDP2 wraps; not the embedding, not the output layer, not the norms) for a frozen torchao `NF4Tensor` (4-bit
NormalFloat codes in blocks of 64 values, each block's absmax scale double-quantized to 8 bits, one 16-bit factor per
scaler block): 0.516 bytes a parameter against 2 (jobspec/plan/quantize.py counts them). `nn.Linear.forward`'s
`F.linear` reaches torchao's `LinearNF4` through the tensor's `__torch_function__`: forward dequantizes the weight to
the input's dtype for the one matmul, saves only the 4-bit weight, and backward dequantizes again for the input's
gradient (a frozen weight needs none of its own). peft's LoRA wraps such a layer as any `nn.Linear` (its
`base_layer(x)` is that forward), so adapters, checkpoints (adapters only) and exports are peft's as before.
`dequantize_base` puts 16-bit weights back (the export merges into what training saw: see runner/output/export.py).

Why torchao and not bitsandbytes, measured (`python -m bench.quantize`, 2026-11-27, this shared 2-core CPU, torch 2.13,
torchao 0.18.0, bitsandbytes 0.50.2; a 4096 x 4096 bf16 linear, 2048 tokens):

    library                    bytes/param  weight error  fwd+bwd (bf16 Linear)  FSDP2, 2 gloo ranks        FakeTensor
    torchao NF4Tensor          0.5157       0.0921        0.66 s (0.68 s)        trains, each holds half    runs
    bitsandbytes Linear4bit    0.5159       0.0921        0.54 s (0.73 s)        fails: quant_state needed  fails

Same format and same error (both are QLoRA's NF4 with double-quantized scales); the CPU times are within the noise of
a machine shared with other jobs. What decided it: torchao's NF4Tensor implements FSDP2's `fsdp_pre_all_gather` /
`fsdp_post_all_gather`, so `fully_shard` shards the 4-bit codes and all-gathers them as they are (torchtune's QLoRA
recipes run so) and zero2, zero3 and minimal hold 0.516/N bytes a base parameter per rank; bitsandbytes' Params4bit
does not survive `fully_shard` (accelerate 1.15 then leaves such parameters out of sharding: every rank keeps the whole
base). And the memory trace (runner/train/trace.py) runs the step on FakeTensors: the NF4Tensor is a traceable wrapper
subclass of plain tensors and runs there; building a Linear4bit under FakeTensorMode failed (Params4bit wraps an
existing tensor's storage). torchao is also the `offload` extra's
already (zero2_offload's optimizer): no new dependency.

One rank: torch 2.13's FSDP2 shortcut for a one-rank group copies a parameter's first all-gather input only, which
drops the NF4 tensor's other parts (two ranks and more gather all of them). On one rank the 4-bit layers are left out
of FSDP2 (`unsharded_on_one_rank`: they stay whole, as a one-rank shard would be, and are never gathered); under
`minimal` they then stay on the GPU (the plan counts them there).

Scaler blocks: torchao double-quantizes the block scales in groups of `scaler_block_size` (256 by default) and FSDP2
splits each of the tensor's parts over the ranks, which needs a whole number of scaler groups a rank; a layer too
small for 256 (a 2-layer test model, a narrow k/v projection) takes the largest power of two that splits, which
changes a layer's bytes by under 0.1 %. A layer whose size is not a multiple of 64 values a rank cannot be
quantized: ConfigError naming it.

int8 is not offered: torchao 0.18's int8 weight-only tensor (quantization/quantize_/workflows/int8) has no FSDP2
all-gather hooks (only its prototype int8 training tensors do), so it would be gathered as 16 bits or not sharded, and
it would save 1 byte a parameter where NF4 saves 1.48.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from jobspec.errors import ConfigError
from jobspec.plan.quantize import NF4_BLOCK, NF4_SCALER_BLOCK, QUANTIZE_METHODS
from runner.model.build import transformer_blocks

log = logging.getLogger("jobspec.runner")


def base_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of the linear layers inside the transformer blocks, LoRA's own excepted; a GPT-2 block's
    Conv1D projections too (ConfigError when quantizing them: NF4 needs nn.Linear)."""
    try:
        blocks = transformer_blocks(model)  # sharded by FSDP2 or not, inside a wrapper or not
    except ConfigError:  # none: the caller says what that means for it (quantize_base: nothing to quantize)
        return
    seen: set[int] = set()
    for block in blocks:
        for name, mod in block.named_modules():
            if ".lora_" in f".{name}" or "lora_" in name or id(mod) in seen:
                continue
            if isinstance(mod, nn.Linear) or type(mod).__name__ == "Conv1D":
                seen.add(id(mod))
                yield name, mod


def scaler_block(numel: int, shards: int) -> int:
    """torchao's scaler_block_size for a weight of `numel` values over `shards` FSDP2 ranks: the largest power of two
    up to NF4_SCALER_BLOCK that leaves each rank whole scaler groups (0: none does)."""
    if numel % NF4_BLOCK:
        return 0
    blocks, size = numel // NF4_BLOCK, NF4_SCALER_BLOCK
    while size >= 1:
        if blocks % (size * shards) == 0:
            return size
        size //= 2
    return 0


def quantize_base(model: nn.Module, method: str, *, shards: int = 1, dtype: torch.dtype | None = None) -> int:
    """Replace the blocks' linear weights by frozen NF4 tensors in place; returns the parameters quantized.

    `shards`: the FSDP2 ranks the model will be sharded over (the scaler groups must split evenly); `dtype`: the
    width the weights are quantized from and dequantized to (default: each weight's own)."""
    from torchao.quantization import to_nf4

    if method not in QUANTIZE_METHODS:
        raise ConfigError(f"model.quantize {method!r}: expected one of {', '.join(QUANTIZE_METHODS)}")
    count = 0
    for name, mod in base_linears(model):
        if not isinstance(mod, nn.Linear):
            raise ConfigError(
                f"model.quantize {method}: {type(model).__name__}'s {name} is a {type(mod).__name__}, not a linear "
                "layer (GPT-2's Conv1D): NF4 needs nn.Linear projections (Llama-style models); remove model.quantize"
            )
        weight = mod.weight.detach()
        size = scaler_block(weight.numel(), shards)
        if weight.dim() != 2 or not size or weight.shape[0] % shards:
            raise ConfigError(
                f"model.quantize {method}: {name} {tuple(weight.shape)} cannot be split into blocks of {NF4_BLOCK} "
                f"values over {shards} ranks; remove model.quantize or change the rank count"
            )
        weight = weight.to(dtype) if dtype is not None else weight
        mod.weight = nn.Parameter(to_nf4(weight.contiguous(), NF4_BLOCK, size), requires_grad=False)
        count += weight.numel()
    if not count:
        raise ConfigError(f"model.quantize {method}: found no linear layers in the transformer blocks of "
                          f"{type(model).__name__}; remove model.quantize")  # fmt: skip
    log.info("model.quantize %s: %.2fM base parameters in 4 bits (torchao NF4, blocks of %d)",
             method, count / 1e6, NF4_BLOCK)  # fmt: skip
    return count


def unsharded_on_one_rank(model: nn.Module) -> list[nn.Module]:
    """The linear layers holding a 4-bit weight, which FSDP2 must leave alone (`ignored_params`) on one rank: its
    one-rank shortcut copies a parameter's first all-gather input only, which drops the NF4 tensor's other parts
    (torch 2.13 `FSDPParamGroup.wait_for_unshard`; two ranks and more gather all three). One rank shards nothing, so
    the layers simply stay whole, in 4 bits, and nothing is gathered for them."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() != 1:
        return []
    return [m for m in model.modules() if isinstance(m, nn.Linear) and is_quantized(m.weight)]


def is_quantized(weight: torch.Tensor) -> bool:
    return hasattr(weight, "get_original_weight") and hasattr(weight, "quantized_data")


def dequantize_base(model: nn.Module) -> int:
    """The NF4 weights back to plain tensors of their width (what the 4-bit codes stand for); returns how many."""
    done = 0
    for _, mod in base_linears(model):
        weight = getattr(mod, "weight", None)
        if weight is not None and is_quantized(weight):
            mod.weight = nn.Parameter(weight.get_original_weight().to(weight.dtype), requires_grad=False)
            done += 1
    return done


def round_trip(model: nn.Module, method: str, *, shards: int = 1, dtype: torch.dtype | None = None) -> int:
    """The base as training saw it: quantized as `quantize_base` does, then dequantized (16-bit again)."""
    count = quantize_base(model, method, shards=shards, dtype=dtype)
    dequantize_base(model)
    return count


def parts_to_empty(model: nn.Module, device: torch.device) -> None:
    """After `Module.to_empty`, the parts of each NF4 weight that torchao's `empty_like` leaves where they were (its
    scale mean and code table; it moves the sharded parts only): a meta-device model materialised for the trace."""
    for param in model.parameters():
        for weight in _nested(param):
            if is_quantized(weight):
                weight.scaler_mean = torch.empty_like(weight.scaler_mean, device=device)
                weight.nf4 = torch.empty_like(weight.nf4, device=device)


def _nested(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """`tensor` and the tensors it wraps, by the wrapper-subclass protocol (`__tensor_flatten__`): FSDP2's DTensor
    holds its shard as one (`to_local()` would hand out a view, not the shard itself)."""
    yield tensor
    if hasattr(tensor, "__tensor_flatten__") and not is_quantized(tensor):
        for name in tensor.__tensor_flatten__()[0]:
            yield from _nested(getattr(tensor, name))
