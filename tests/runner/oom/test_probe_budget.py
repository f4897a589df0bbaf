"""The probe steps' budget check against what the process holds, on a fake caching allocator (CPU).

On the H200 (bench/gpu/records/2026-11-28-h200) gpt2-small's probe at micro-batch 32 "ran out of memory" on a
139 GiB GPU: an earlier test in the same process had left 105 GiB in the caching allocator's cache, which
`max_memory_reserved` counted while the plan's budget (from the device's free memory) left it out. The fake
below stands for `torch.cuda`'s memory API at the boundary: live tensors, cached blocks, the peak.
"""

from __future__ import annotations

import pytest
import torch

from runner.oom import detect
from runner.oom.detect import oom_guard
from runner.sizing import probe
from runner.sizing.plan import Plan, verify_micro_batch

GiB = 1024**3


class FakeAllocator:
    """A caching allocator: freed blocks stay reserved until `empty_cache`; the peak is of reserved bytes."""

    def __init__(self, live: int = 0, cached: int = 0):
        self.live, self.reserved = live, live + cached
        self.peak = self.reserved
        self.limit: int | None = None  # the device's capacity for this process: an allocation past it is an OOM

    def alloc(self, n: int) -> None:
        if self.live + n > self.reserved:
            if self.limit is not None and self.live + n > self.limit:
                raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} bytes")
            self.reserved = self.live + n
        self.live += n
        self.peak = max(self.peak, self.reserved)

    def free(self, n: int) -> None:
        self.live -= n  # the block goes to the cache, still reserved

    def empty_cache(self) -> None:
        self.reserved = self.live

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak = self.reserved

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.live)
        monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: self.peak)


def stepper(gpu: FakeAllocator, per_sample: int):
    """A probe step: activations of `per_sample` bytes a sample, allocated and freed (they go to the cache)."""

    def step(mbs: int) -> bool:
        gpu.alloc(mbs * per_sample)
        gpu.free(mbs * per_sample)
        return True

    return step


def test_an_earlier_phase_cache_does_not_fail_a_probe_that_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 GiB of model states live, 100 GiB an earlier phase cached; the plan's budget is 30 GiB
    gpu = FakeAllocator(live=2 * GiB, cached=100 * GiB)
    gpu.install(monkeypatch)
    try_step = oom_guard(stepper(gpu, GiB // 2), budget_bytes=30 * GiB)
    assert try_step(32)  # 2 + 16 GiB: fits (before the fix the cached 100 GiB counted: no fit)
    assert gpu.reserved == gpu.live == 2 * GiB  # the step's blocks went back to the device after it
    assert not try_step(64)  # 2 + 32 GiB > 30: the budget still holds
    assert try_step(48)  # 2 + 24 GiB: what failed before leaves nothing behind that counts


def test_verify_keeps_the_spec_micro_batch_after_an_earlier_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 failure end to end: the spec's micro-batch 32 fits and must be kept, not halved."""
    gpu = FakeAllocator(live=2 * GiB, cached=105 * GiB)
    gpu.install(monkeypatch)
    plan = Plan(tier="fast", micro_batch=32, grad_accum=1, global_batch=32, world_size=1, checkpointing=False,
                precision="bf16", num_workers=0, pin_memory=False, seq_len=256, estimated_bytes=10 * GiB,
                budget_bytes=30 * GiB, micro_batch_fixed=True)  # fmt: skip
    verified = verify_micro_batch(plan, oom_guard(stepper(gpu, GiB // 4), budget_bytes=plan.budget_bytes))
    assert verified.micro_batch == 32 and verified.probes == 1, verified.reasons


def test_a_real_oom_is_no_fit_and_leaves_the_cache_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = FakeAllocator(live=2 * GiB)
    gpu.limit = 20 * GiB
    gpu.install(monkeypatch)
    monkeypatch.setattr(detect.gc, "collect", lambda generation=2: 0)  # nothing real to collect here
    grown: list[int] = []

    def step(mbs: int) -> bool:
        gpu.alloc(GiB)  # the first layer's activations, kept by the failing step's frames until released
        grown.append(GiB)
        gpu.alloc(mbs * GiB)
        return True

    def release(baseline: int | None = None) -> None:
        gpu.free(sum(grown))
        grown.clear()
        gpu.empty_cache()

    monkeypatch.setattr(detect, "release_memory", release)
    try_step = oom_guard(step, budget_bytes=30 * GiB)
    assert not try_step(24)  # past the device's 20 GiB: an OOM, no fit
    assert gpu.reserved == gpu.live == 2 * GiB


def test_the_budget_counts_what_this_process_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's free memory leaves out this process's own reserved blocks; the probe peaks count them, so the
    budget must too: free = device free + own reserved."""
    view = probe._TorchView("cuda", "H200", 140 * GiB, (9, 0), True, 1, "GPU-x", None)
    monkeypatch.setattr(probe, "_torch_view", lambda i: view)
    monkeypatch.setattr(probe, "_nvml_memory", lambda i, key: ("NVIDIA H200", 140 * GiB, 34 * GiB))
    gpu = FakeAllocator(live=5 * GiB, cached=100 * GiB)
    gpu.install(monkeypatch)
    device = probe.probe_device(0)
    assert device.free_bytes == 139 * GiB
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no context yet: nothing of its own
    assert probe.probe_device(0).free_bytes == 34 * GiB
