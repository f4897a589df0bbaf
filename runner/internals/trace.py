"""torch's dispatch mode and op schemas (the OOM-anywhere injection), FakeTensors and memory trackers (the trace)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def dispatch_mode() -> type:
    """torch's `TorchDispatchMode` base class (every ATen op of a region passes through a subclass's handler)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def allocates(op: Any) -> bool:
    """Whether ATen `op` returns a fresh tensor (no alias annotation on a tensor result): what an allocator is asked
    for. Views, in-place and `out=` ops alias an argument and allocate nothing; so do c10d's collectives, which
    write into the tensors they are given though their schemas carry no alias annotation (the functional
    collectives of `_c10d_functional` do allocate their results). For runner/oom/anywhere.py."""
    if getattr(op, "namespace", "") == "c10d":
        return False
    returns = getattr(getattr(op, "_schema", None), "returns", ())
    return any(r.alias_info is None and "Tensor" in str(r.type) for r in returns)


def fake_mode() -> Any:
    """torch's FakeTensorMode: tensors with shapes, dtypes and devices but no data (meta parameters go in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` (or a DTensor's local shard) is a FakeTensor."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(tensor, "_local_tensor", tensor), FakeTensor)


class _NoHandle:
    def remove(self) -> None:
        pass


def _peak_only(tracker: type) -> type:
    """The tracker without its per-module peaks: torch updates every module's after every op, 60 % of a 7B trace."""

    class PeakOnly(tracker):  # type: ignore[misc, valid-type]
        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def reset_peak(self) -> None:
            """Forget the peak so far (the first step's: FSDP's lazy init, no Adam state yet)."""
            self._peak_mem, self._peak_mem_snap = {}, {}

    return PeakOnly


def memory_tracker(model: nn.Module, optimizer: Any, fsdp: bool, inputs: tuple[torch.Tensor, ...]) -> Any:
    """torch's MemTracker (FSDPMemTracker for FSDP2 models) over `model`, `optimizer` and `inputs`, peak-only, with
    `reset_peak()`; a context manager whose `get_tracker_snapshot("peak")` gives device -> category -> bytes."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    if fsdp:
        tracker = _peak_only(FSDPMemTracker)(model, optimizer)
        tracker.track_inputs(inputs)
        return tracker
    tracker = _peak_only(MemTracker)()
    tracker.track_external(model, optimizer, *inputs)
    # MemTracker hooks every parameter's gradient at its module's first forward, and a frozen parameter
    # (LoRA's base) refuses a hook: mark those as hooked already (torch 2.13; its FSDPMemTracker does not hook)
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHandle(), _NoHandle())
    return tracker
