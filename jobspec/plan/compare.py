"""`jobspec plan --gpus any`: the same job on each GPU type of the catalogue (the spec's GPU count and
nodes): whether it fits, at which tier, how long it takes and, given `--price`, what it costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.errors import ConfigError
from jobspec.plan.job_length import job_length
from jobspec.plan.output import format_columns, time_notes
from jobspec.plan.planner import PlanReport, plan_spec
from jobspec.plan.throughput import format_duration
from jobspec.spec.models import JobSpec

GiB = 1024**3


def _known(name: str) -> gpu_catalogue.GpuInfo:
    info = gpu_catalogue.lookup(name)
    if info is None:
        close = gpu_catalogue.suggest(name)
        guess = f"did you mean {' or '.join(close)}? " if close else ""
        shown = name if len(name) <= 24 and name.replace("-", "").isalnum() else "a GPU type"
        known = ", ".join(gpu_catalogue.known_names())
        raise ConfigError(f"{shown!r} is not in the GPU catalogue: {guess}known: {known}")
    return info


def parse_prices(items: Sequence[str]) -> dict[str, float]:
    """`--price H100=2.49,A100-80GB=1.79` (repeatable) -> {catalogue name: price per GPU-hour}."""
    prices: dict[str, float] = {}
    for n, part in enumerate((p.strip() for item in items for p in item.split(",")), 1):
        if not part:
            continue
        name, eq, value = part.partition("=")
        if not eq:
            raise ConfigError(f"--price item {n}: expected GPU=PRICE per GPU-hour, e.g. --price H100=2.49")
        info = _known(name.strip())
        try:
            price = float(value)
        except ValueError:
            price = math.nan
        if not math.isfinite(price) or price < 0:
            raise ConfigError(f"--price {info.name}: expected a price per GPU-hour such as 2.49")
        prices[info.name] = price
    return prices


def select_gpus(which: str) -> list[gpu_catalogue.GpuInfo]:
    """`any`: the whole catalogue; else a comma-separated list of types."""
    if which.strip().lower() == "any":
        return gpu_catalogue.catalogue()
    names = [n.strip() for n in which.split(",") if n.strip()]
    if not names:
        raise ConfigError("--gpus: expected `any` or GPU types, e.g. --gpus H100,A100-80GB")
    return list({info.name: info for info in map(_known, names)}.values())


def compare(
    spec: JobSpec, gpus: Sequence[gpu_catalogue.GpuInfo], prices: dict[str, float], rows: int | None = None
) -> list[PlanReport]:
    """One plan per GPU type, those the job runs on first, fastest first."""
    length = job_length(spec, rows)
    reports = [plan_spec(spec, gpu=g, length=length, prices=prices) for g in gpus]

    def key(r: PlanReport) -> tuple[int, float]:
        time = r.times.get(r.runs.tier) if r.runs else None
        return (r.runs is None, time.step_seconds if time else math.inf)

    return sorted(reports, key=key)


def _row(report: PlanReport, priced: bool) -> tuple[str, ...]:
    gpu, spec, p = report.gpu, report.spec, report.runs
    assert gpu is not None
    t = report.times.get(p.tier) if p else None
    cost = report.cost
    notes = []
    if p is None:
        smallest = min(report.plans, key=lambda x: x.estimate.gpu_bytes)
        notes.append(f"nothing fits ({smallest.tier}: {smallest.reason})")
    if gpu.vendor != spec.hardware.vendor:
        notes.append(f"hardware.vendor {gpu.vendor}")
    if spec.hardware.gpus.type and gpu_catalogue.lookup(spec.hardware.gpus.type) == gpu:
        notes.append("<- spec")
    return (
        gpu.name,
        gpu.vendor,
        f"{gpu.memory_bytes / GiB:.0f}",
        p.tier if p else "-",
        f"{p.micro_batch} x {p.grad_accum}" if p else "-",
        f"{t.step_seconds:.3g} s" if t else "-",
        f"{t.tokens_per_second:,.0f}" if t else "-",
        format_duration(t.total_seconds) if t else "-",
        *((f"{cost:,.2f}" if cost is not None else "-",) if priced else ()),
        "; ".join(notes),
    )


def compare_table(spec: JobSpec, reports: list[PlanReport]) -> str:
    priced = any(r.price is not None for r in reports)
    head = (
        f"{spec.name}: {reports[0].shape.params / 1e6:,.0f}M params, seq {spec.data.max_seq_len}, "
        f"global batch {spec.training.global_batch} over {spec.world_size} GPU(s) of each type "
        f"({spec.hardware.nodes} node(s) x {spec.hardware.gpus.count}); memory.tier {spec.memory.tier}"
    )
    rows = [("gpu", "vendor", "GiB", "tier", "micro x accum", "step", "tok/s", "time", *("cost",) * priced, "note")]
    rows += [_row(r, priced) for r in reports]
    lines = [head, "", *format_columns(rows)]
    if not any(r.runs for r in reports):
        lines.append("\nnothing fits on any of these GPUs: more GPUs, a shorter data.max_seq_len, or LoRA")
    if priced:
        lines.append("\ncost: the job's GPU-hours x --price (per GPU-hour), for the GPUs given a price.")
    timed = next((r for r in reports if r.peak_tflops is not None), None)
    if timed:
        lines += ["", *time_notes(timed, peak="each type's TFLOPS")]
    return "\n".join(lines)


def compare_dict(spec: JobSpec, reports: list[PlanReport]) -> dict[str, Any]:
    out = []
    for r in reports:
        t = r.times.get(r.runs.tier) if r.runs else None
        assert r.gpu is not None
        out.append(
            {
                "gpu": r.gpu.name,
                "vendor": r.gpu.vendor,
                "gpu_bytes": r.gpu_bytes,
                "peak_tflops": r.peak_tflops,
                "tier": r.runs.tier if r.runs else None,
                "micro_batch": r.runs.micro_batch if r.runs else None,
                "grad_accum": r.runs.grad_accum if r.runs else None,
                "step_seconds": t.step_seconds if t else None,
                "tokens_per_second": t.tokens_per_second if t else None,
                "mfu": t.mfu if t else None,
                "duration_seconds": t.total_seconds if t else None,
                "price_per_gpu_hour": r.price,
                "cost": r.cost,
            }
        )
    first = reports[0].to_dict()
    keep = ("job", "model_params", "world_size", "global_batch", "seq_len", "steps", "tokens_per_step",
            "job_tokens", "steps_from", "assumptions")  # fmt: skip
    return {**{k: first[k] for k in keep}, "gpus": out}
