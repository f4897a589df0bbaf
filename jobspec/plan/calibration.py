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

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobspec.catalog.presets import ModelShape
from jobspec.catalog.tiers import TIERS
from jobspec.contract import METRICS_FILE
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.spec.units import human_bytes

log = logging.getLogger(__name__)
SCALE_LIMITS = (0.25, 8.0)  # beyond these the measurement, not the model, is suspect: clamp and say so
MAX_SETTINGS = 256  # (tier, micro-batch) pairs followed; a run shrinks a few times per tier


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
    """Per tier, the last plan the run trained with there and its measurements. ConfigError without metrics.

    The metrics file is untrusted (jobspec/report/metrics.py): read line by line, records of the wrong type or
    range skipped and counted, a file with no usable record refused. Memory stays bounded: per tier and
    micro-batch a running peak and bounded samples for the medians."""
    from jobspec.report.metrics import MetricsFile, lines  # here: `jobspec plan` without --from reads no run

    path = Path(run_dir) / METRICS_FILE
    if not path.is_symlink() and not path.exists():
        raise ConfigError(f"--from {run_dir}: no readable {METRICS_FILE} (no such file); give a run directory "
                          "(the spec's checkpoints.dir of a run that trained)")  # fmt: skip
    source = MetricsFile(path)
    device: str | None = None  # the device of the latest plan; None before the first plan
    seen: dict[tuple[str, int], _Tally] = {}
    last: dict[str, Any] | None = None  # the previous train record of the same attempt
    for rec in source.records():
        if rec["kind"] == "plan":
            device, last = rec.get("device", "?"), None
        elif rec["kind"] == "train" and device is not None and rec.get("tier") in TIERS and "micro_batch" in rec:
            key = (rec["tier"], rec["micro_batch"])
            if key not in seen and len(seen) >= MAX_SETTINGS:
                continue  # a run does not train at this many settings: the file is not a run's
            tally = seen.setdefault(key, _Tally(device))
            tally.add(rec, last)
            last = rec
    source.require_records()
    if source.skipped.count:
        log.warning("%s: %s ignored; the measurements come from the other %s", path, lines(source.skipped.count),
                    f"{source.usable:,}")  # fmt: skip
    out: dict[str, Measured] = {}
    for (tier, mbs), t in seen.items():  # the last micro-batch a tier trained at wins (dicts keep order)
        on_gpu = t.device == "cuda"
        out[tier] = Measured(tier, mbs, t.device, t.peak if on_gpu else None,
                             statistics.median(t.speeds.values) if t.speeds.values else None,
                             statistics.median(t.steps.values) if t.steps.values else None,
                             t.peaks or t.speeds.count)  # fmt: skip
    return out


class _Tally:
    """One tier and micro-batch of one run: the peak memory and samples of the speed, in bounded memory."""

    def __init__(self, device: str) -> None:
        from jobspec.report.summary import BoundedSample

        self.device = device
        self.peak: int | None = None
        self.peaks = 0  # records that carried a peak
        self.speeds = BoundedSample()  # tokens/s
        self.steps = BoundedSample()  # seconds per optimizer step

    def add(self, rec: dict[str, Any], last: dict[str, Any] | None) -> None:
        step = rec["step"]
        per_step = _seconds_per_step(last, rec) if last is not None else None
        if per_step is not None:
            self.steps.add(per_step)
        if "mem_used_bytes" in rec:
            self.peaks += 1
            self.peak = max(self.peak or 0, rec["mem_used_bytes"])
        if rec.get("tokens_per_s") and step > 1:  # step 1 includes warm-up
            self.speeds.add(float(rec["tokens_per_s"]))


def _seconds_per_step(last: dict[str, Any], rec: dict[str, Any]) -> float | None:
    """Between two train records of one attempt past its first step; None when a time is missing or goes back
    (a clock set back measures nothing)."""
    if last.get("tier") != rec["tier"] or not rec["step"] > last["step"] > 1:
        return None
    if "time" not in rec or "time" not in last or rec["time"] <= last["time"]:
        return None
    return (rec["time"] - last["time"]) / (rec["step"] - last["step"])


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
