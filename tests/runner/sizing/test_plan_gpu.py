"""The planner on a real GPU (pytest -m gpu): probe, plan, verified micro-batch vs exhaustive search,
peak memory vs the memory model. Skipped without CUDA/ROCm. Figures are printed (run with -s)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from jobspec.spec.models import JobSpec
from runner.sizing.plan import initial_plan
from runner.sizing.probe import describe, probe_device, probe_host

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU"),
]
GiB = 1024**3


def sizing() -> ModuleType:
    """bench/sizing.py, the one home of the real GPT-2 probe step and the exhaustive search."""
    path = Path(__file__).resolve().parents[3] / "bench" / "sizing.py"
    spec = importlib.util.spec_from_file_location("bench_sizing", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_probe_and_plan_on_this_gpu() -> None:
    host = probe_host()
    device = probe_device(0, host=host)
    print("\n" + describe(device, host))
    assert device.vendor in ("cuda", "rocm") and device.count >= 1
    assert 0 < device.free_bytes <= device.total_bytes
    assert device.source in (("pynvml", "torch") if device.vendor == "cuda" else ("amdsmi", "torch"))
    assert device.bf16 == torch.cuda.is_bf16_supported(including_emulation=False)
    spec = JobSpec.model_validate({
        "name": "gpu", "model": {"preset": "gpt2-small"}, "data": {"max_seq_len": 1024},
        "training": {"global_batch": 64},
    })  # fmt: skip
    plan = initial_plan(spec, device, host, 1)
    print("\n".join(plan.reasons))
    assert plan.micro_batch * plan.grad_accum == 64
    if device.free_bytes >= 16 * GiB:  # gpt2-small (~2 GiB of states) trains without sharding
        assert plan.tier == "fast"
    assert plan.precision == ("bf16" if device.bf16 else "fp16")


def test_verified_micro_batch_matches_exhaustive_search_and_peak_memory() -> None:
    free = torch.cuda.mem_get_info()[0]
    per_rank = 360 if free >= 40 * GiB else 120  # enough headroom that the per-rank batch does not fit whole
    r = sizing().measure("gpt2-small", 1024, per_rank)
    print("\n" + sizing().report(r))
    assert r["exhaustive"] >= 1
    assert r["verified"] >= 0.9 * r["exhaustive"], "verify_micro_batch must land within 10 % of the true maximum"
    assert r["verified"] <= r["exhaustive"], "a verified micro-batch that exhaustive search rejects is a flaky fit"
    assert r["probes"] <= math.log2(per_rank) + 3
    assert r["peak_reserved_gib"] <= r["budget_gib"] + 1e-6  # oom_guard holds the plan's budget
    ratio = r["peak_allocated_gib"] / r["predicted_gib"]
    print(f"peak allocated / predicted = {ratio:.2f}")
    # the probe step is the runner's (chunked loss): the suite's memory part measured +3.6 % at micro-batch 120 on
    # the H200; 1.61 there was transformers' whole-logits loss in bench/sizing.py, not the model (2026-11-28)
    assert 0.8 < ratio < 1.2, "the memory model is off the measured peak: recalibrate jobspec/plan/memory.py"
