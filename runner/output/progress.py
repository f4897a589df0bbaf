"""The live-progress line: what `jobspec status`, `list` and `status -w` show of a running job.

Rank 0 logs one line per logged train step, `jobspec-progress/v1 {json}` (contract.PROGRESS_PREFIX), with exactly
the keys of contract.PROGRESS_KEYS:
    step, total_steps   optimizer steps done and planned
    loss                the step's loss (as metrics.jsonl)
    tokens_per_s        input tokens per second over every rank
    eta_s               seconds left at the pace of the last RATE_WINDOW logged steps of this plan (null until two)
    tier, micro_batch   the memory tier and micro-batch in use
    event               null, or the last OOM or tier change: {"event", "step", "detail"} (contract.PROGRESS_EVENTS)
The submitter reads it through the pod logs API (a bounded tail): the pods need no API token and write nothing to
the API. A restarted run (the next tier after an OOM) seeds the last event and tier from the tail of its own
metrics.jsonl, so the line still says what happened before the restart.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from pathlib import Path
from typing import Any

from jobspec import shared_dir
from jobspec.contract import PROGRESS_EVENTS, PROGRESS_PREFIX

RATE_WINDOW = 20  # logged steps the ETA's pace is taken over
SEED_BYTES = 64 * 1024  # of an existing metrics.jsonl read at start for the last event


def describe(record: dict[str, Any]) -> str:
    """An event record in a few words: `micro-batch 16 -> 8 after an OOM`."""
    kind = record.get("event")
    if kind == "oom_shrink":
        return f"OOM: micro-batch {record.get('from_micro_batch')} -> {record.get('to_micro_batch')}"
    if kind == "oom_retry":
        return "OOM at micro-batch 1: step retried"
    if kind == "oom_regrow":
        return f"micro-batch {record.get('from_micro_batch')} -> {record.get('to_micro_batch')} (after an OOM)"
    if kind == "tier_change":
        how = "in process" if record.get("in_process") else "at restart"
        return f"tier {record.get('from_tier')} -> {record.get('to_tier')} {how}"
    return str(kind)


class ProgressLine:
    """Follows the records Metrics writes and makes the progress line of each train record."""

    def __init__(self) -> None:
        self.event: dict[str, Any] | None = None
        self.tier: str | None = None  # of the last plan record
        self.to_tier: str | None = None  # of the last tier_change event: its plan record follows
        self.pace: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)  # (time, step)

    def seed(self, path: Path) -> None:
        """The last event and plan tier of an earlier process of this run, from the end of its metrics.jsonl."""
        try:
            with shared_dir.open_read(path) as f:
                start = max(os.fstat(f.fileno()).st_size - SEED_BYTES, 0)
                f.seek(start)
                tail = f.read(SEED_BYTES).decode("utf-8", "replace").splitlines()[1 if start else 0 :]  # cut: skip
        except (OSError, shared_dir.Unsafe):
            return
        for line in tail:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                self._remember(record)
        self.pace.clear()

    def _remember(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "event" and record.get("event") in PROGRESS_EVENTS:
            self.event = {"event": record["event"], "step": record.get("step"), "detail": describe(record)}
            self.to_tier = record.get("to_tier")
        elif record.get("kind") == "plan":
            tier = record.get("tier")
            if self.tier is not None and tier != self.tier and tier != self.to_tier:  # the supervisor's restart
                self.event = {"event": "tier_change", "step": record.get("step"),
                              "detail": f"tier {self.tier} -> {tier} at restart"}  # fmt: skip
                self.to_tier = tier
            self.tier = tier
            self.pace.clear()  # another plan trains at another pace

    def observe(self, record: dict[str, Any]) -> str | None:
        """The progress line for a train record (None for any other record, which may update the event)."""
        if record.get("kind") != "train":
            self._remember(record)
            return None
        step, total = int(record["step"]), int(record["total_steps"])
        self.pace.append((float(record.get("time") or 0.0), step))
        eta = None
        (t0, s0), (t1, s1) = self.pace[0], self.pace[-1]
        if s1 > s0 and t1 > t0:
            eta = round((t1 - t0) / (s1 - s0) * max(total - step, 0), 1)
        loss, rate = record.get("loss"), record.get("tokens_per_s")
        line = {
            "step": step,
            "total_steps": total,
            "loss": float(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) else None,
            "tokens_per_s": round(float(rate), 1) if isinstance(rate, (int, float)) and math.isfinite(rate) else None,
            "eta_s": eta,
            "tier": record.get("tier"),
            "micro_batch": record.get("micro_batch"),
            "event": self.event,
        }
        return PROGRESS_PREFIX + json.dumps(line, separators=(",", ":"), allow_nan=False)
