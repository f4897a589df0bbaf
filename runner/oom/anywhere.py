"""OOM at any op: a dispatch mode that raises a real `torch.OutOfMemoryError` at the N-th allocating op of a region.

A caching allocator fails wherever memory runs out, not where a test would like it to: inside an FSDP2
all-gather's buffer, in the loss, in backward, in DDP's gradient exchange, at Adam's first step, in gradient
clipping, in evaluation, while a checkpoint is staged, in a planner's probe step. `OpFault` is installed around
one such region (`JOBSPEC_FAULT_OOM="step=K,op=N[,during=REGION]"`, runner/oom/faults.py) as a
`TorchDispatchMode`: every ATen op of the region passes through it, on this thread and in autograd's backward
(the engine carries dispatch modes into its threads), below FSDP2's hooks and DTensor. It counts the ops that
allocate (`internals.allocates`: an op with a fresh, non-aliasing tensor result; views, in-place and `out=`
ops allocate nothing) on the training device's type, and raises before the N-th one runs, as an allocator
would. On a GPU only device allocations count (the host-side control values never fail there); on the CPU, the
device, every allocating op counts but the control plane's (`runner.dist.host_side`: the values ranks agree on, the
checkpoint's manifest entries; torch.distributed's object collectives, with which DCP plans over the gloo group),
which lives in host memory on a GPU too.

The sweep over every N of a region (bench/oom_anywhere.py) and the tests that sample it drive the recovery
code through the same door as a real failure. A region that ends before its N-th op reports how many it had
(`ops`), which is how the sweep learns a region's length.

Cost when unset: nothing (no mode is installed). When set: one Python call per op of the chosen region only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from runner import internals
from runner.dist import on_host_side


def _first_tensor(values: Any) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)):
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


# torch.distributed's object collectives (DCP plans and reduces with them over the control group): they pickle into
# byte tensors on the group's device, the host for gloo, so a GPU's allocator never sees them
_OBJECT_COLLECTIVES = frozenset(
    ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list", "send_object_list",
     "recv_object_list")
)  # fmt: skip


def _in_object_collective() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _OBJECT_COLLECTIVES and frame.f_globals.get("__name__", "").startswith(
            "torch.distributed"
        ):
            return True
        frame = frame.f_back
    return False


def _device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Where an op allocates: its `device=` argument, else its first tensor argument's device, else the CPU."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device).type
    tensor = _first_tensor((*args, *kwargs.values()))
    return "cpu" if tensor is None else tensor.device.type


class OpFault(internals.dispatch_mode()):  # type: ignore[misc]
    """Raise `torch.OutOfMemoryError` before the `target`-th allocating op on `device_type` (once); count them.

    `describe(n, op)` words the error (the region, step, rank); `on_fire()` runs right before it is raised (the
    injector records the fired step there)."""

    def __init__(self, target: int, device_type: str, describe: Callable[[int, str], str],
                 on_fire: Callable[[], None] = lambda: None):  # fmt: skip
        super().__init__()
        self.target, self.device_type = target, device_type
        self.describe, self.on_fire = describe, on_fire
        self.ops = 0  # allocating ops seen so far
        self.fired = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if (not self.fired and internals.allocates(func) and _device_type(args, kwargs) == self.device_type
                and not on_host_side() and not (self.device_type == "cpu" and _in_object_collective())):  # fmt: skip
            self.ops += 1
            if self.ops == self.target:
                self.fired = True
                self.on_fire()
                raise torch.OutOfMemoryError(self.describe(self.ops, str(func)))
        return func(*args, **kwargs)
