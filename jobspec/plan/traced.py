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
from jobspec.plan.memory import TierPlan

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
    tiers = ",".join(f"{p.tier}={max(1, p.micro_batch)}" for p in plans)
    cmd = [sys.executable, "-m", "runner.train.trace", spec_path, "--tiers", tiers, "--world-size", str(world_size),
           "--precision", precision]  # fmt: skip
    for item in overrides:
        cmd += ["--set", item]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        why = f"the trace took longer than {TIMEOUT_S:.0f} s; plan without --trace"
        raise ConfigError(f"jobspec plan --trace: {why}") from None
    if proc.returncode != 0:
        tail = "\n  ".join(proc.stderr.strip().splitlines()[-6:])
        raise ConfigError(f"jobspec plan --trace: the trace failed (exit {proc.returncode}):\n  {tail}")
    try:
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ConfigError("jobspec plan --trace: the trace printed no result") from None
    return {row["tier"]: row for row in rows}
