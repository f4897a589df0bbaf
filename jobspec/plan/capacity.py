"""Does the model fit any memory tier at all? Checked from its parameter count before anything is allocated.

The planner's "nothing fits" (exit 4) is about a batch: activations at micro-batch 1 over the budget, which a
shorter sequence, LoRA or more GPUs can fix. This is the coarser question a model config of someone else's
raises first (`num_hidden_layers: 100000` within every bound): do the model's states alone (weights,
gradients, optimizer state and the fixed overhead, no sample) fit the GPU at some tier, and what that tier
offloads fit the host? When no tier holds them the job cannot run on this hardware whatever the batch:
`jobspec plan` and the runner both refuse it, exit 2, with the numbers, before building a thing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jobspec.catalog import tiers
from jobspec.catalog.presets import ModelShape
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.spec.units import human_bytes


def check(shape: ModelShape, *, device_bytes: int, host_bytes: int | None, where: str,
          tier_names: Iterable[str] = tiers.TIERS, **estimate_kw: Any) -> None:  # fmt: skip
    """ConfigError when no tier of `tier_names` keeps the states of `shape` within `device_bytes` on the device
    and its offload within `host_bytes` of host memory per rank (None: not known, not checked).
    `estimate_kw`: memory.estimate's keywords apart from tier and micro-batch (world size, sequence, LoRA...)."""
    least: tuple[int, int, str] | None = None  # (device bytes, host bytes, tier) of the smallest device need
    if estimate_kw.get("quantize") == "auto" and estimate_kw.get("lora") is not None:
        estimate_kw = {**estimate_kw, "quantize": "nf4"}  # the least the base can take: what `auto` may use
    if estimate_kw.get("optimizer") == "auto":
        estimate_kw = {**estimate_kw, "optimizer": "adamw_8bit"}  # the least the states can take, as above
    for tier in tier_names:
        est = memory.estimate(shape, tier=tier, micro_batch=0, **estimate_kw)
        if est.gpu_bytes <= device_bytes and (host_bytes is None or est.host <= host_bytes):
            return
        if least is None or est.gpu_bytes < least[0]:
            least = (est.gpu_bytes, est.host, tier)
    if least is None:
        return
    device, host, tier = least
    offload = f" and {human_bytes(host)} of host memory per rank" if host else ""
    room = f"{human_bytes(device_bytes)} on the device" + (
        f" and {human_bytes(host_bytes)} of host memory" if host_bytes is not None else ""
    )
    raise ConfigError(
        f"{where}: {_count(shape.params)} parameters fit no memory tier here: the least any tier needs before "
        f"a single sample is {human_bytes(device)} per device{offload} (tier {tier}), and there is {room}. "
        "Check the model's config (layers, hidden size, vocabulary), or use more or larger GPUs, or LoRA"
    )


def _count(n: int) -> str:
    """A parameter count as people say it: 124M, 7.2B, 62.7T."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,}"
