"""Plans that learn from runs: what a run's metrics.jsonl measured, per tier, against the memory model.

A run's `plan` records say which tier, micro-batch and device it trained with; its `train` records carry
the device's peak allocated bytes since the previous record (`mem_used_bytes`, GPU only) and the input
tokens per second. From the peak at micro-batch m the bytes a sample really costs follow:

    measured per sample = (peak - model's states at micro-batch 0) / m
    sample_scale        = measured per sample / model's per-sample bytes (activations + logits)

(the allocator's peak holds the states and the samples, not the CUDA context or fragmentation, which is
why the states and not the whole fixed estimate are taken off). `jobspec plan --from RUN_DIR` and the
runner (from its own run directory) scale the model's per-sample bytes by it, tier by tier, and use the
measured tokens/s instead of the FLOPs estimate. A CPU run measures no device memory: only its
throughput is taken. Pure Python: no torch.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.catalog.presets import ModelShape
from jobspec.contract import METRICS_FILE
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.spec.units import human_bytes

SCALE_LIMITS = (0.25, 8.0)  # beyond these the measurement, not the model, is suspect: clamp and say so


@dataclass(frozen=True)
class Measured:
    """One tier of one run: the micro-batch it trained at and what it measured there."""

    tier: str
    micro_batch: int
    device: str  # "cuda" | "cpu" | "?" (an older run that did not record it)
    peak_bytes: int | None  # device peak allocated over the run at this tier and micro-batch; None on CPU
    tokens_per_s: float | None  # median input tokens/s of the train records
    step_seconds: float | None  # median seconds per optimizer step between train records
    records: int  # train records behind the figures


def read_run(run_dir: str | Path) -> dict[str, Measured]:
    """Per tier, the last plan the run trained with there and its measurements. ConfigError without metrics."""
    from jobspec.report import read_records  # the report's reader: a truncated line is skipped, not fatal

    path = Path(run_dir) / METRICS_FILE
    try:
        records, _ = read_records(path)
    except OSError as err:
        raise ConfigError(f"--from {run_dir}: no readable {METRICS_FILE} ({err.strerror or err}); give a run "
                          "directory (the spec's checkpoints.dir of a run that trained)") from None  # fmt: skip
    plan: dict[str, Any] | None = None
    seen: dict[tuple[str, int], dict[str, Any]] = {}
    last: dict[str, Any] | None = None  # the previous train record of the same attempt
    for rec in records:
        if rec.get("kind") == "plan":
            plan, last = rec, None
        elif rec.get("kind") == "train" and plan is not None and rec.get("tier") and rec.get("micro_batch"):
            key = (rec["tier"], int(rec["micro_batch"]))
            entry = seen.setdefault(key, {"device": plan.get("device", "?"), "peaks": [], "speeds": [], "steps": []})
            if last is not None and last.get("tier") == rec["tier"] and rec.get("step", 0) > last.get("step", 0) > 1:
                entry["steps"].append((rec["time"] - last["time"]) / (rec["step"] - last["step"]))
            last = rec
            if rec.get("mem_used_bytes") is not None:
                entry["peaks"].append(int(rec["mem_used_bytes"]))
            if rec.get("tokens_per_s") and int(rec.get("step", 0)) > 1:  # step 1 includes warm-up
                entry["speeds"].append(float(rec["tokens_per_s"]))
    out: dict[str, Measured] = {}
    for (tier, mbs), e in seen.items():  # the last micro-batch a tier trained at wins (dicts keep order)
        on_gpu = e["device"] == "cuda"
        out[tier] = Measured(tier, mbs, e["device"], max(e["peaks"]) if on_gpu and e["peaks"] else None,
                             statistics.median(e["speeds"]) if e["speeds"] else None,
                             statistics.median(e["steps"]) if e["steps"] else None,
                             len(e["peaks"]) or len(e["speeds"]))  # fmt: skip
    return out


def sample_scale(shape: ModelShape, measured: Measured, **estimate_kw: Any) -> tuple[float | None, str]:
    """(the correction of the per-sample bytes at measured.tier, a line saying model vs measurement);
    None when the run measured no device memory there."""
    if measured.peak_bytes is None:
        why = "CPU run: no device memory measured" if measured.device == "cpu" else "no device peak recorded"
        return None, f"{measured.tier}: {why}"
    at0 = memory.estimate(shape, tier=measured.tier, micro_batch=0, **estimate_kw)
    at1 = memory.estimate(shape, tier=measured.tier, micro_batch=1, **estimate_kw)
    model_sample = (at1.activations + at1.logits) - (at0.activations + at0.logits)
    measured_sample = (measured.peak_bytes - at0.states) / measured.micro_batch
    if model_sample <= 0 or measured_sample <= 0:
        return None, f"{measured.tier}: peak {human_bytes(measured.peak_bytes)} is below the model's states: not used"
    scale = measured_sample / model_sample
    low, high = SCALE_LIMITS
    clamped = min(max(scale, low), high)
    line = (
        f"{measured.tier}: at micro-batch {measured.micro_batch} the model says {human_bytes(model_sample)} a sample, "
        f"the run measured {human_bytes(measured_sample)} (peak {human_bytes(measured.peak_bytes)}): x{scale:.2f}"
    )
    if clamped != scale:
        line += f", clamped to x{clamped:.2f}"
    return clamped, line


def scales(shape: ModelShape, runs: dict[str, Measured], **estimate_kw: Any) -> tuple[dict[str, float], list[str]]:
    """`sample_scale` for every measured tier (for memory.plan_all), and the lines that explain them."""
    out: dict[str, float] = {}
    lines = []
    for tier, m in runs.items():
        scale, line = sample_scale(shape, m, **estimate_kw)
        lines.append(line)
        if scale is not None:
            out[tier] = scale
    return out, lines


