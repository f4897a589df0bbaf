"""A quantized frozen base (`model.quantize`, QLoRA): which parameters are 4-bit and how many bytes they hold.

Pure Python, shared by the memory model (jobspec/plan/memory.py), `jobspec plan` and the runner
(runner/model/quantize.py quantizes with torchao's NF4Tensor; its docstring says why torchao and what was measured).
NF4 holds, per parameter of a block's linear layer: a 4-bit code (0.5 bytes), one 8-bit scale per block of
NF4_BLOCK values, and one 16-bit factor per NF4_SCALER_BLOCK scales (torchao's layout): 0.5157 bytes against 2.
The embedding, the output layer and the norms stay 16-bit.

`model.quantize: auto` lets the plan use the 4-bit base at a tier where the 16-bit one does not fit
(`memory.plan_tier`): at each tier the 16-bit base first; the choice is printed by `jobspec plan` and logged
by the runner, never made silently.
"""

from __future__ import annotations

from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError

QUANTIZE_METHODS = ("nf4",)  # what a base can be quantized to; `auto` picks among them per tier
NF4_BLOCK = 64  # values per absmax block
NF4_SCALER_BLOCK = 256  # block scales per 16-bit double-quantization factor (torchao's default)
NF4_BYTES = 0.5 + 1 / NF4_BLOCK + 2 / (NF4_BLOCK * NF4_SCALER_BLOCK)  # a parameter, with its share of the scales
BITS = {"nf4": NF4_BYTES}


def base_quantization(quantize: str | None, lora: object | None) -> str | None:
    """What the memory model holds the base in, given `model.quantize`: None (16 bits) for none and for `auto` (which
    `memory.plan_tier` resolves per tier), else the method; ConfigError without LoRA (a 4-bit base cannot train)."""
    if quantize in (None, "none", "auto"):
        return None
    if quantize not in QUANTIZE_METHODS:
        raise ConfigError(f"model.quantize {quantize!r}: expected none, auto or {', '.join(QUANTIZE_METHODS)}")
    if lora is None:
        raise ConfigError(f"model.quantize {quantize}: a quantized base trains LoRA adapters only; add model.lora "
                          "or remove model.quantize")  # fmt: skip
    return quantize


def check(shape: ModelShape, quantize: str | None) -> None:
    """ConfigError when `shape`'s blocks cannot hold a quantized base: GPT-2's Conv1D projections are no linear
    layers (torchao's NF4 linear needs nn.Linear); mixture-of-experts and latent-attention blocks are not counted
    yet (their experts are no linear layers either)."""
    if not quantize:
        return
    if shape.family == "gpt2":
        raise ConfigError(
            f"model.quantize {quantize}: GPT-2 blocks keep their projections in Conv1D layers, which NF4 cannot "
            "quantize; use a Llama-style model (e.g. model.preset llama-tiny) or remove model.quantize"
        )
    if getattr(shape, "moe_layers", 0) or getattr(shape, "mla", None):
        raise ConfigError(f"model.quantize {quantize}: not supported for mixture-of-experts or latent-attention "
                          "models yet; remove model.quantize")  # fmt: skip


def linear_params(shape: ModelShape) -> int:
    """Parameters of one block's linear layers (what is quantized): the attention's and the MLP's projections."""
    h, i = shape.hidden, shape.intermediate
    return 2 * h * shape.q_width + 2 * h * shape.kv_width + 3 * h * i


def quantized_params(shape: ModelShape, quantize: str | None) -> int:
    """Base parameters held in 4 bits: every block's linear layers, or none."""
    check(shape, quantize)
    return shape.layers * linear_params(shape) if quantize else 0


def bytes_per_param(quantize: str | None) -> float:
    """Bytes a quantized base parameter takes (2: not quantized)."""
    return BITS[quantize] if quantize else 2.0


def quantized_saving(shape: ModelShape, quantize: str | None) -> int:
    """Bytes the 4-bit blocks save against a 16-bit base."""
    return int((2 - bytes_per_param(quantize)) * quantized_params(shape, quantize))


def gathered_saving(shape: ModelShape, quantize: str | None, world_size: int) -> int:
    """Bytes the 4-bit blocks save in what FSDP2 gathers, against 16 bits: their 4-bit size where it gathers them (two
    ranks and more), all of it on one rank, which leaves the 4-bit layers out of FSDP2 (runner/model/quantize.py)."""
    return quantized_saving(shape, quantize) if world_size > 1 else 2 * quantized_params(shape, quantize)
