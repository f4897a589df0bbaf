"""`jobspec plan --trace`: the runner's own step traced on FakeTensors (runner/train/trace.py), tier by tier.

The submitter never imports torch: the trace runs as `python -m runner.train.trace` in a process of its own, at
the micro-batch the memory model chose for each tier (1 where none fits), and its JSON comes back here. It needs
the runner's packages (torch, transformers, accelerate, peft): the `trace` extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from importlib.util import find_spec
from typing import Any

from jobspec import install_hint
from jobspec.errors import ConfigError
from jobspec.plan import memory
from jobspec.plan.memory import TierPlan
from jobspec.plan.planner import PlanReport, lora_shape
from jobspec.spec.models import JobSpec

TIMEOUT_S = 900.0  # seconds for every tier together; a 7B model's tier traces in seconds to a minute


def trace_tiers(
    spec_path: str, overrides: Sequence[str], plans: list[TierPlan], world_size: int, precision: str
) -> dict[str, dict[str, Any]]:
    """tier -> the trace's figures (peak, parts, host, micro_batch, seconds) at each tier's planned micro-batch."""
    missing = [m for m in ("torch", "transformers", "accelerate", "runner") if find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"jobspec plan --trace runs the runner's training step on fake tensors and needs {', '.join(missing)}: "
            f"{install_hint('trace')}"
        )
    rows: list[dict[str, Any]] = []
    for base in dict.fromkeys(p.quantize for p in plans):  # `model.quantize: auto`: each tier's base as planned
        pairs = [(p.tier, max(1, p.micro_batch)) for p in plans if p.quantize == base]
        held = [*overrides, f"model.quantize={base}"] if base else list(overrides)
        try:
            rows += run_trace(spec_path, held, pairs, world_size, precision, TIMEOUT_S)
        except TraceFailed as err:
            why = f"{err}; plan without --trace" if err.timed_out else str(err)
            raise ConfigError(f"jobspec plan --trace: {why}") from None
    return {row["tier"]: row for row in rows}


def with_optimizer(spec: JobSpec, report: PlanReport, traced: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The traced peaks with the spec's `training.optimizer` in place of the AdamW the trace steps (torchao's compiled
    8-bit step does not run on fake tensors): its state's difference, as the model counts it (`optimizer_change`)."""
    lora, out = lora_shape(spec), dict(traced)
    for p in report.plans:
        if p.tier in traced and p.optimizer != "adamw":
            change = memory.optimizer_change(report.shape, p.tier, spec.world_size, lora, p.quantize, p.optimizer)
            out[p.tier] = {**traced[p.tier], "peak": traced[p.tier]["peak"] + change}
    return out


class TraceFailed(Exception):
    """The trace process failed, timed out or printed no result (the message says which)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def run_trace(
    spec_path: str,
    overrides: Sequence[str],
    pairs: Sequence[tuple[str, int]],
    world_size: int,
    precision: str,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """`python -m runner.train.trace` for (tier, micro-batch) pairs, in a process of its own: its JSON rows."""
    tiers = ",".join(f"{tier}={mbs}" for tier, mbs in pairs)
    cmd = [sys.executable, "-m", "runner.train.trace", spec_path, "--tiers", tiers, "--world-size", str(world_size),
           "--precision", precision]  # fmt: skip
    for item in overrides:
        cmd += ["--set", item]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TraceFailed(f"the trace took longer than {timeout_s:.0f} s", timed_out=True) from None
    if proc.returncode != 0:
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-6:])
        raise TraceFailed(f"the trace failed (exit {proc.returncode}):\n  {tail}")
    try:
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise TraceFailed("the trace printed no result") from None
    return list(rows)
