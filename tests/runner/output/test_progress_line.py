"""The live-progress line rank 0 logs: a real tiny run with an injected OOM, its log read back with the submitter's
own parser (jobspec.cluster.progress), the contract between them; the ETA; a restart's tier change."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from jobspec.cluster.progress import parse_progress
from jobspec.contract import EXIT_OK, PROGRESS_KEYS, PROGRESS_PREFIX
from runner.oom.faults import ENV_VAR
from runner.output.metrics import Metrics
from runner.output.progress import ProgressLine
from tests.runner.train_helpers import tiny_spec, train_in_process


def test_a_run_logs_progress_the_submitter_reads(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv(ENV_VAR, "step=2")  # an OOM at step 2: micro-batch 4 -> 2
    caplog.set_level(logging.INFO, logger="jobspec.runner")
    code, _ = train_in_process(tiny_spec(tmp_path / "run", training={"micro_batch": 4, "steps": 4}))
    assert code == EXIT_OK
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(PROGRESS_PREFIX)]
    assert len(lines) == 4  # log_every 1
    assert all(set(json.loads(ln[len(PROGRESS_PREFIX) :])) == set(PROGRESS_KEYS) for ln in lines)
    first, last = parse_progress(lines[0]), parse_progress("\n".join(lines))
    assert first is not None and (first.step, first.micro_batch, first.event, first.eta_s) == (1, 4, None, None)
    assert last is not None and (last.step, last.total_steps, last.tier, last.micro_batch) == (4, 4, "fast", 2)
    assert (last.event, last.event_step, last.event_detail) == ("oom_shrink", 2, "OOM: micro-batch 4 -> 2")
    assert last.eta_s == 0.0 and last.loss is not None and last.tokens_per_s and last.tokens_per_s > 0


@pytest.mark.parametrize("terminal", [False, True])
def test_the_progress_line_is_for_pods_not_for_a_terminal(tmp_path, monkeypatch, caplog, terminal: bool) -> None:
    """Issue 43, item 9: on a terminal each step was logged twice (the human line and the JSON line)."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    caplog.set_level(logging.INFO, logger="jobspec.runner")
    metrics = Metrics(tmp_path / "metrics.jsonl", enabled=True)
    metrics.write({"kind": "train", "step": 1, "total_steps": 2, "loss": 1.5, "lr": 1e-3, "tokens_per_s": 10.0,
                   "tier": "fast", "micro_batch": 2, "grad_accum": 1, "world_size": 1, "global_batch": 2})  # fmt: skip
    metrics.close()
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if m.startswith("step 1/2 | loss 1.5000")]  # the human line, either way
    assert any(m.startswith(PROGRESS_PREFIX) for m in said) is not terminal
    caplog.clear()
    caplog.set_level(logging.DEBUG, logger="jobspec.runner")
    metrics = Metrics(tmp_path / "again.jsonl", enabled=True)
    metrics.write({"kind": "train", "step": 1, "total_steps": 2, "loss": 1.5, "lr": 1e-3, "tokens_per_s": 10.0,
                   "tier": "fast", "micro_batch": 2, "grad_accum": 1, "world_size": 1, "global_batch": 2})  # fmt: skip
    metrics.close()
    assert any(r.getMessage().startswith(PROGRESS_PREFIX) for r in caplog.records)  # --debug shows it on a terminal


def test_eta_from_the_pace_of_the_last_steps() -> None:
    p = ProgressLine()
    assert p.observe({"kind": "plan", "tier": "fast", "step": 0}) is None
    rec = {"kind": "train", "total_steps": 100, "loss": 1.0, "tokens_per_s": 10.0, "tier": "fast", "micro_batch": 2}
    p.observe({**rec, "step": 10, "time": 1000.0})
    line = p.observe({**rec, "step": 20, "time": 1030.0})  # 3 s a step, 80 steps left
    assert parse_progress(line).eta_s == pytest.approx(240.0)


def test_a_restart_at_another_tier_is_the_last_change(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    earlier = [
        {"kind": "plan", "tier": "fast", "step": 0},
        {"kind": "event", "event": "oom_retry", "step": 5, "tier": "fast"},
    ]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in earlier))
    p = ProgressLine()
    p.seed(metrics)  # the new process, after the supervisor chose the next tier
    p.observe({"kind": "plan", "tier": "zero2_offload", "step": 4})
    line = p.observe({"kind": "train", "step": 5, "total_steps": 10, "loss": 1.0, "tokens_per_s": 1.0,
                      "tier": "zero2_offload", "micro_batch": 1, "time": 1.0})  # fmt: skip
    got = parse_progress(line)
    assert (got.event, got.event_step, got.event_detail) == ("tier_change", 4, "tier fast -> zero2_offload at restart")
    same = ProgressLine()
    same.seed(metrics)
    same.observe({"kind": "plan", "tier": "fast", "step": 4})  # restarted at the same tier: the OOM stays the last
    assert same.event is not None and same.event["event"] == "oom_retry"
