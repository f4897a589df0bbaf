"""How long a training step and a whole job take, before any GPU work: FLOPs, peak, efficiency.

Pure numbers, like the memory model (`jobspec plan` and tests use it; it imports neither torch
nor pydantic). The estimate, per optimizer step:

    FLOPs per token   F = 6·N + 6·L·h·s          (forward 2·N + 2·L·h·s, backward twice that)
    step time         tokens · (F + R) / (ranks · peak · efficiency[tier])
    tokens per step   global_batch · max_seq_len  (full-length rows: an upper bound without packing)

N: the weights that take part in a matmul (the parameter count less the input embedding when the
head is untied, and less GPT-2's position table; both are lookups); L layers (with softmax attention: a
linear-attention layer's projections are in N, its chunked delta rule is not counted), h hidden size, s the
sequence length. 6·L·h·s is attention's QKᵀ and AV (2·s·h FLOPs each per token and layer, halved by
the causal mask, times 3 for forward and backward), as Kaplan et al. 2020 count it (the PaLM paper's
MFU counts 12·L·h·s: the whole s x s matrix).
R: activation checkpointing runs the forward again, 2·N + 2·L·h·s (a third more work). With LoRA the
frozen base needs no weight gradients: 4·N for the base plus 6 per adapter parameter.
A forward pass alone (DPO's reference pass: `forward_flops`, `pass_seconds`) is that 2·N + 2·L·h·s, a third of a
step's work per token, at the same tier's efficiency.
peak: the GPU's dense 16-bit matrix peak from the catalogue (jobspec/catalog/gpus.py, vendor datasheets).
efficiency: the fraction of that peak a tier sustains (EFFICIENCY below): an assumption, printed with
every estimate. MFU = 6·N + 6·L·h·s FLOPs per token over peak, so with checkpointing it is
efficiency / (1 + R/F). Communication is assumed hidden behind compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobspec.catalog.presets import ModelShape
from jobspec.plan.memory import LoraShape, trainable_params

# Fraction of the dense 16-bit peak each tier's step runs at (recomputation counted as work).
# Assumed, not measured by jobspec: plain DDP at 40 %; sharding a little lower for its gathers and
# reduce-scatters (zero2, zero3); offload far lower, as steps wait on PCIe copies and CPU Adam.
EFFICIENCY: dict[str, float] = {"fast": 0.40, "zero2": 0.38, "zero2_offload": 0.25, "zero3": 0.35, "minimal": 0.15}


def matmul_params(shape: ModelShape) -> int:
    """N: parameters that take part in a matmul per token (the embedding lookups do not; of a mixture of experts,
    the experts a token is routed to: `ModelShape.active_params`)."""
    lookups = shape.max_positions * shape.hidden if shape.family == "gpt2" else 0  # GPT-2's position table
    if not shape.tie_embeddings:  # the input table is a lookup; the untied head is a matmul
        lookups += shape.vocab * shape.hidden
    return shape.active_params - lookups


@dataclass(frozen=True)
class Flops:
    """FLOPs per token of one training step."""

    model: float  # forward + backward: what MFU counts
    recompute: float  # the forward again under activation checkpointing (0 without)

    @property
    def total(self) -> float:
        return self.model + self.recompute


def flops_per_token(shape: ModelShape, seq_len: int, *, lora: LoraShape | None, checkpointing: bool) -> Flops:
    n, attention = matmul_params(shape), shape.attention_layers * shape.hidden * seq_len  # linear attention: in N
    if lora is None:
        forward, model = 2 * n + 2 * attention, 6 * n + 6 * attention
    else:  # frozen base: activation gradients only (2N), adapters: weight gradients too
        adapters = trainable_params(shape, lora)
        forward = 2 * (n + adapters) + 2 * attention
        model = 4 * n + 6 * adapters + 6 * attention
    return Flops(float(model), float(forward) if checkpointing else 0.0)


def forward_flops(shape: ModelShape, seq_len: int, *, lora: LoraShape | None) -> float:
    """FLOPs per token of a forward pass without gradients: 2·N + 2·L·h·s (with LoRA, the adapters' too)."""
    return flops_per_token(shape, seq_len, lora=lora, checkpointing=True).recompute


def pass_seconds(flops: float, *, tokens: int, tier: str, world_size: int, peak_tflops: float) -> float:
    """Seconds for `tokens` at `flops` per token, shared by `world_size` GPUs at the tier's efficiency."""
    return tokens * flops / (world_size * peak_tflops * 1e12 * EFFICIENCY[tier])


@dataclass(frozen=True)
class StepTime:
    """One tier's speed on one GPU type."""

    tier: str
    efficiency: float
    step_seconds: float
    tokens_per_second: float  # all ranks, full-length rows
    mfu: float
    total_seconds: float | None  # the whole job, when its length is known


def step_time(
    flops: Flops,
    *,
    tier: str,
    tokens_per_step: int,
    world_size: int,
    peak_tflops: float,
    steps: int | None,
    efficiency: float | None = None,
) -> StepTime:
    eff = EFFICIENCY[tier] if efficiency is None else efficiency
    peak = world_size * peak_tflops * 1e12
    seconds = tokens_per_step * flops.total / (peak * eff)
    rate = tokens_per_step / seconds
    total = seconds * steps if steps is not None else None
    return StepTime(tier, eff, seconds, rate, rate * flops.model / peak, total)


def format_duration(seconds: float | None) -> str:
    """'48 s', '12 min', '3.4 h', '2.1 d'; '-' when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 90:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.2g} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def measured_time(
    tier: str, step_seconds: float, tokens_per_step: int, steps: int | None, model_mfu: float | None
) -> StepTime:
    """A tier's speed as a run measured it (jobspec.plan.calibration); efficiency and MFU stay the model's."""
    total = step_seconds * steps if steps is not None else None
    return StepTime(tier, EFFICIENCY[tier], step_seconds, tokens_per_step / step_seconds, model_mfu or 0.0, total)
