"""torchao's CPUOffloadOptimizer, as `zero2_offload`'s HostAdamW reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runner.internals.versions import missing

OFFLOAD_PARTS = ("optim_dict", "param_d2h_map", "queue", "stream", "device")


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
        raise missing("torchao", "CPUOffloadOptimizer." + "/".join(absent), "memory.tier zero2_offload")
    return OffloadParts(*(getattr(offload, name) for name in OFFLOAD_PARTS))
