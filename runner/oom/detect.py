"""Out-of-memory detection and in-process recovery helpers.

The check (`is_oom`) is kept apart from the action (`guarded`, `next_micro_batch`),
as in accelerate's `utils/memory.py`, but without its three bugs:

- memory is released *after* the `except` block: inside it, the traceback's frames still pin every
  tensor the failed step allocated, so `empty_cache()` there frees nothing;
- every rank agrees on the outcome (`Stepper.agree` in runner/train/step.py: one all-reduce MAX of
  [stop, OOM, rank] per micro-step), so a rank that ran out does not leave the others waiting in a
  collective it will never join;
- the micro-batch moves to the next smaller divisor of the per-rank batch and gradient accumulation
  grows to match: the effective batch never changes (accelerate multiplies the batch by 0.9).
"""

from __future__ import annotations

import gc
import logging
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from jobspec.catalog.tiers import divisors

log = logging.getLogger("jobspec.runner")
GiB = 1024**3
T = TypeVar("T")

# Messages of allocation failures that reach Python as a plain RuntimeError (or torch.AcceleratorError)
# instead of torch.OutOfMemoryError: kernel-launch OOMs ("CUDA error: out of memory"), ROCm's
# "HIP out of memory", library workspaces that cuBLAS / cuDNN / MIOpen fail to allocate.
OOM_MARKERS: tuple[str, ...] = (
    " out of memory",  # "CUDA out of memory.", "CUDA error: out of memory", "HIP out of memory."
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "hipErrorOutOfMemory",
    "HIPBLAS_STATUS_ALLOC_FAILED",
)
_CHAIN_LIMIT = 8  # __cause__ / __context__ links followed (torch.compile and DDP wrap the original error)


def is_oom(exc: BaseException | None) -> bool:
    """True when `exc` (or an error it was raised from) is a device out-of-memory error.

    Only `RuntimeError`s count (torch.OutOfMemoryError and torch.AcceleratorError are subclasses): a
    `ValueError` whose text happens to say "out of memory" is not an allocation failure. Host memory
    errors (`MemoryError`, the kernel's OOM kill) are not: shrinking the micro-batch does not help an
    offload tier that ran the host out of RAM, and a killed process raises nothing.
    """
    seen = 0
    while exc is not None and seen < _CHAIN_LIMIT:
        if isinstance(exc, torch.OutOfMemoryError):
            return True
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def describe(exc: BaseException) -> str:
    """One line for logs and the tier state: the exception type and the first line of its message."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def release_memory(baseline: int | None = None) -> None:
    """Free what a failed step left and return the caching allocator's free blocks to the device.

    Call it where no exception is being handled (see `guarded`). What a failed step leaves is young
    and mostly freed by reference counting once its frames are cleared, so a young-generation
    collection comes first; the full one (about 150 ms with torch and transformers loaded, measured
    on this CPU) runs only when the device still holds more than `baseline` (bytes allocated when the
    step started; None: always). On CPU there is no device cache and the full collection is skipped.
    """
    gc.collect(1)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if baseline is None or torch.cuda.memory_allocated() > baseline:
            gc.collect()
        torch.cuda.empty_cache()  # HIP builds expose the same API


def allocated_bytes() -> int | None:
    """The device's allocated bytes now (the baseline `release_memory` compares with); None on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return None


@dataclass(frozen=True)
class OOMInfo:
    """The numbers a caching allocator's OOM message carries (CUDA's and HIP's wording), in bytes:
    "Tried to allocate R. GPU 0 has a total capacity of T of which F is free. ... Of the allocated memory
    A is allocated by PyTorch, and U is reserved by PyTorch but unallocated." """

    requested: int
    free: int
    allocated: int
    reserved_free: int = 0


_UNITS = {"B": 1, "bytes": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4}
_SIZE = r"([0-9]+(?:\.[0-9]+)?) (TiB|GiB|MiB|KiB|bytes|B)\b"
_PARTS = {
    "requested": re.compile(r"Tried to allocate " + _SIZE),
    "free": re.compile(r"of which " + _SIZE + r" is free"),
    "allocated": re.compile(_SIZE + r" is allocated by PyTorch"),
    "reserved_free": re.compile(_SIZE + r" is reserved by PyTorch but unallocated"),
}


def parse_oom(text: str) -> OOMInfo | None:
    """OOMInfo from an allocator's message; None when it lacks the numbers (a kernel-launch OOM, a library's)."""
    found: dict[str, int] = {}
    for key, pattern in _PARTS.items():
        m = pattern.search(text)
        if m:
            found[key] = int(float(m.group(1)) * _UNITS[m.group(2)])
    if not {"requested", "free", "allocated"} <= found.keys():
        return None
    return OOMInfo(**found)


@dataclass(frozen=True)
class Headroom:
    """What one OOM tells about the step that ran out, per rank: each sample needs at least `per_sample`
    bytes (what was allocated plus what was asked for, over the micro-batch), and `room` bytes are there
    for samples (all the allocator holds or could get, less what the step started with)."""

    per_sample: float
    room: float


def headroom(info: OOMInfo | None, baseline: int | None, micro_batch: int) -> Headroom | None:
    """From the OOM's numbers and the bytes allocated when the step started (None: nothing of the step was
    allocated yet, as for an injected fault that fires before any compute)."""
    if info is None or micro_batch < 1:
        return None
    base = info.allocated if baseline is None else baseline
    need = info.allocated + info.requested - base
    if need <= 0:
        return None
    return Headroom(per_sample=need / micro_batch, room=float(info.allocated + info.reserved_free + info.free - base))


@dataclass(frozen=True)
class Guarded(Generic[T]):
    """What `guarded` gives back: the step's value, or `oom=True`, the reason and the allocator's numbers."""

    value: T | None
    oom: bool
    reason: str = ""
    info: OOMInfo | None = None


def guarded(step: Callable[[], T]) -> Guarded[T]:
    """Run `step`; an OOM comes back as a flag instead of an exception, with its memory released.

    Any other exception propagates unchanged. Inside the `except` block only the message is kept and
    the traceback's frames are cleared (their locals are the failed step's tensors); the exception
    object is dropped when the block ends, which frees them by reference counting. The caller still owns
    the partial gradients of the failed step: it zeroes them, then calls `release_memory` once.
    """
    try:
        return Guarded(step(), False)
    except Exception as exc:
        if not is_oom(exc):
            raise
        reason, info = describe(exc), parse_oom(str(exc))
        traceback.clear_frames(exc.__traceback__)
    # Out of the except block: no frame, traceback or exception refers to the step's tensors now.
    return Guarded(None, True, reason, info)


def next_micro_batch(current: int, per_rank_batch: int, room: Headroom | None = None) -> int | None:
    """The micro-batch to redo the step at after an OOM at `current`; None when `current` is already 1.

    Always a divisor of `per_rank_batch` (grad_accum = per_rank_batch / micro_batch stays an integer, so
    the effective batch is exact). With the OOM's numbers (`room`): one jump, to the largest divisor that
    `room / per_sample` says fits. `per_sample` is a lower bound (the step had not finished), so the jump
    never lands below the true maximum; when it is still too big, the next OOM gives a tighter bound.
    Without numbers, or when they say not even one sample fits (a transient spike looks like that): the
    next smaller divisor, the smallest step down (24 -> 12 -> 8 -> 6 -> 4 ...).
    """
    if current < 1 or per_rank_batch < 1:
        raise ValueError(f"micro-batch {current} and per-rank batch {per_rank_batch} must be >= 1")
    smaller = [d for d in divisors(per_rank_batch) if d < current]
    if not smaller:
        return None
    if room is None or room.per_sample <= 0 or room.room < room.per_sample:
        return smaller[-1]
    fits = math.floor(room.room / room.per_sample)
    return max((d for d in smaller if d <= fits), default=smaller[0])


def oom_guard(
    step: Callable[[int], Any], *, budget_bytes: int | None = None, reset: Callable[[], bool] = lambda: True
) -> Callable[[int], bool]:
    """Turn a probe step into `try_step(mbs) -> bool` for the planner's probe steps (`verify_micro_batch`).

    `step(mbs)` runs forward, backward and optimizer.step() at the longest sequence length and zeroes
    its gradients (set_to_none) before returning; it may return False for an OOM it caught and agreed on with
    the other ranks (`Stepper.probe_step`). An OOM (`is_oom`) gives False, with memory
    released after the except block (`guarded`). With `budget_bytes`, a step whose peak
    reserved memory exceeds it also counts as no fit, so the search respects
    `memory.target_utilization` instead of filling the GPU to the last byte. `reset()` puts the model wrapper
    back in order after an OOM inside its forward or backward (DDP's reducer, FSDP2's iteration state:
    `runner.oom.shrink.reset_wrapper`), so the next probe starts clean.

    The peak compared with the budget is what the process holds (its live tensors: the model's states) plus what
    the step adds: the caching allocator's free blocks are returned to the device before every probe. Without
    that, blocks an earlier phase cached and no longer uses (a build's transients, an earlier tier's step, an
    earlier test in the same process) counted in `max_memory_reserved` and failed a micro-batch that fits: the
    H200's gpt2-small probe at micro-batch 32 "OOMed" on a 139 GiB GPU with 105 GiB of an earlier test's cache
    reserved (bench/gpu/records/2026-11-28-h200). The budget counts the same bytes: `probe_device` adds what the
    process's allocator holds to the device's free memory (runner/sizing/probe.py).
    """

    def try_step(mbs: int) -> bool:
        on_gpu = torch.cuda.is_available()
        if on_gpu:
            torch.cuda.empty_cache()  # cached blocks of an earlier phase are not this step's
            torch.cuda.reset_peak_memory_stats()  # the peak starts at what the process holds now
        baseline = allocated_bytes()
        outcome = guarded(lambda: step(mbs))
        if outcome.oom or outcome.value is False:  # False: the step agreed on an OOM itself
            if not reset():
                log.warning("probe step at micro-batch %d: the model wrapper could not be reset after its OOM", mbs)
            release_memory(baseline)
            return False
        if not on_gpu or budget_bytes is None:
            return True
        peak = torch.cuda.max_memory_reserved()  # bytes: what the process held at the start plus the step's growth
        torch.cuda.empty_cache()
        if peak > budget_bytes:
            log.info(
                "micro-batch %d ran but reserved %.2f GiB > budget %.2f GiB: no fit",
                mbs,
                peak / GiB,
                budget_bytes / GiB,
            )
        return peak <= budget_bytes

    return try_step
