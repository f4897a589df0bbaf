"""Every GPU run calibrates the memory model: the first step's peak beside the prediction, in metrics.jsonl.

A real Recipe on the CPU; only the device's allocator figures (torch.cuda.max_memory_*) are faked."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from jobspec.contract import METRICS_FILE
from runner.train import outputs
from tests.runner.train_helpers import tiny_spec, train_in_process


def _events(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [r for r in rows if r.get("event") == "memory_check"]


def test_memory_check_records_prediction_and_peak(tmp_path: Path, monkeypatch) -> None:
    from runner.train.recipe import Recipe

    spec = tiny_spec(tmp_path, training={"steps": 3})
    recipe = Recipe(spec)
    try:
        recipe.setup()
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * 2**30)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 4 * 2**30)
        outputs.memory_check(recipe)
    finally:
        recipe.cleanup()
    (event,) = _events(tmp_path)
    plan = recipe.plan
    assert event["predicted_bytes"] == plan.estimated_bytes > 0
    assert (event["peak_allocated_bytes"], event["peak_reserved_bytes"]) == (3 * 2**30, 4 * 2**30)
    assert event["measured_over_predicted"] == round(3 * 2**30 / plan.estimated_bytes, 4)
    assert (event["tier"], event["micro_batch"], event["step"]) == (plan.tier, plan.micro_batch, 1)


def test_a_cpu_run_writes_no_memory_check(tmp_path: Path) -> None:
    code, _ = train_in_process(tiny_spec(tmp_path, training={"steps": 3}))
    assert code == 0
    assert _events(tmp_path) == []  # the CPU has no allocator peak to compare
