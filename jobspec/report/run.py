"""A run directory read into a `Run`: its metrics.jsonl, once, line by line, in bounded memory.

What is read (runner/output/metrics.py, runner/train/recipe.py, runner/oom/shrink.py, runner/oom/ladder.py):
- `plan` records, one per start of the workers: a plan at another tier than the one before is a tier
  change (the OOM ladder stepped down); the reason comes from `tier_state.json` when it is there;
- `train` and `eval` records; a resumed run redoes the steps after its checkpoint, so a record for a step
  already logged replaces the records from that step on (the later record wins);
- `event` records with `event: oom_shrink` (an in-process micro-batch shrink);
- `benchmark` records (lm-evaluation-harness, runner/output/benchmarks.py): the latest of each task, for at most
  MAX_KEPT tasks.
Other kinds are ignored. The file is untrusted (metrics.py): a line that is not a JSON object (a run killed
mid-write leaves a truncated last line) or a record with a field of the wrong type or range is skipped, and
counted. Train and eval records go into bounded series (summary.py): a long run keeps at most MAX_POINTS
points a series (each the mean of consecutive records, memory their peak); plans, tier changes and shrinks
keep the first MAX_KEPT and count the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from jobspec.contract import METRICS_FILE, TIER_STATE_FILE
from jobspec.errors import ConfigError
from jobspec.report.metrics import MetricsFile, Record, Skipped, read_small_json
from jobspec.report.summary import StepSeries

log = logging.getLogger(__name__)
MAX_KEPT = 200  # plans, tier changes and shrinks kept (for the tables and the plot markers); the rest counted


@dataclass
class Run:
    """What one run directory's metrics.jsonl (and tier_state.json) say, in bounded memory."""

    path: Path
    plans: list[Record] = field(default_factory=list)  # the first MAX_KEPT plan records, in file order
    last_plan: Record | None = None
    plan_count: int = 0
    changes: list[tuple[int, str, str]] = field(default_factory=list)  # (step, from, to): the first MAX_KEPT
    change_count: int = 0
    train_series: StepSeries = field(default_factory=StepSeries)
    eval_series: StepSeries = field(default_factory=StepSeries)
    shrinks: list[Record] = field(default_factory=list)  # the first MAX_KEPT oom_shrink events
    shrink_count: int = 0
    first_time: float | None = None  # the smallest and largest `time` of any record
    last_time: float | None = None
    skipped: Skipped = field(default_factory=Skipped)  # lines that were not a usable record
    tier_failures: dict[str, str] = field(default_factory=dict)  # failed tier -> reason
    exhausted: bool = False  # tier_state.json: the last tier failed too
    benchmarks: dict[str, Record] = field(default_factory=dict)  # task -> its latest benchmark record

    @property
    def train(self) -> list[Record]:
        """One train record per step (per point of a long run), by step."""
        return self.train_series.records

    @property
    def evals(self) -> list[Record]:
        return self.eval_series.records

    @property
    def unreadable(self) -> list[int]:
        """The numbers of the first skipped lines (Skipped.count says how many in all)."""
        return [line for line, _, _ in self.skipped.first]

    def tier_changes(self) -> list[tuple[int, str, str]]:
        """(step, from tier, to tier) for each plan whose tier differs from the plan before it (the first MAX_KEPT)."""
        return self.changes

    def add(self, rec: Record) -> None:
        """Take in one validated record."""
        t = rec.get("time")
        if t is not None:
            self.first_time = t if self.first_time is None else min(self.first_time, t)
            self.last_time = t if self.last_time is None else max(self.last_time, t)
        kind = rec["kind"]
        if kind == "train":
            self.train_series.add(rec)
        elif kind == "eval":
            self.eval_series.add(rec)
        elif kind == "plan":
            self._add_plan(rec)
        elif kind == "benchmark" and (rec["task"] in self.benchmarks or len(self.benchmarks) < MAX_KEPT):
            self.benchmarks.pop(rec["task"], None)  # a later run of the task (`jobspec eval` again) replaces it
            self.benchmarks[rec["task"]] = rec
        elif kind == "event" and rec.get("event") == "oom_shrink":
            self.shrink_count += 1
            if len(self.shrinks) < MAX_KEPT:
                self.shrinks.append(rec)

    def _add_plan(self, rec: Record) -> None:
        before, self.last_plan = self.last_plan, rec
        self.plan_count += 1
        if len(self.plans) < MAX_KEPT:
            self.plans.append(rec)
        if before is not None and before.get("tier") != rec.get("tier"):
            self.change_count += 1
            if len(self.changes) < MAX_KEPT:
                self.changes.append((rec.get("step", 0), str(before.get("tier")), str(rec.get("tier"))))


# --- reading ----------------------------------------------------------------------------------------


def load_run(run_dir: str | Path) -> Run:
    """Read a run directory; a ConfigError names the path and what was expected there."""
    path = Path(run_dir)
    expected = f"expected a run directory (the spec's checkpoints.dir) holding {METRICS_FILE}"
    if not path.is_dir():
        raise ConfigError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; {expected}")
    metrics = path / METRICS_FILE
    if not metrics.is_symlink() and not metrics.exists():  # anything else there is the reader's to judge
        raise ConfigError(f"{path}: no {METRICS_FILE}, so not a run directory; {expected}")
    source = MetricsFile(metrics)
    run = Run(path=path, skipped=source.skipped)
    for rec in source.records():
        run.add(rec)
    source.require_records()
    _read_tier_state(run)
    return run


def _read_tier_state(run: Run) -> None:
    """Failure reasons from the tier ladder's state file; the report does without them when it is unreadable."""
    path = run.path / TIER_STATE_FILE
    if not path.is_symlink() and not path.exists():
        return
    try:
        state = read_small_json(path)
        if not isinstance(state, dict) or not isinstance(state.get("failed", []), list):
            raise ValueError("not the object the tier ladder writes")
        run.tier_failures = {f["tier"][:64]: f["reason"][:4096] for f in state.get("failed", [])
                             if isinstance(f, dict) and isinstance(f.get("tier"), str)
                             and isinstance(f.get("reason"), str)}  # fmt: skip
        run.exhausted = state.get("exhausted") is True
    except (ConfigError, ValueError) as err:
        log.warning("%s: unreadable (%s); tier changes are shown without their reason", path, err)
