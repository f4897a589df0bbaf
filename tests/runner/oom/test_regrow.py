"""Growing back after a shrink: a one-off OOM costs a few steps at the smaller micro-batch, not the run."""

from __future__ import annotations

import pytest

from jobspec.contract import EXIT_OK
from runner.oom.faults import ENV_VAR
from runner.oom.regrow import TRIES, Regrow
from tests.runner.train_helpers import records, tiny_spec, train_in_process


def events(run, kind):
    return [r for r in records(run, "event") if r.get("event") == kind]


def test_a_one_off_oom_grows_back_to_the_old_micro_batch(tmp_path, monkeypatch):
    clean = tmp_path / "clean"
    assert train_in_process(tiny_spec(clean, training={"micro_batch": 8, "steps": 8}))[0] == EXIT_OK
    monkeypatch.setenv(ENV_VAR, "step=3")  # once, no allocator numbers: the next smaller divisor
    run = tmp_path / "run"
    spec = tiny_spec(run, training={"micro_batch": 8, "steps": 8}, memory={"tier": "fast", "regrow_after": 2})
    assert train_in_process(spec)[0] == EXIT_OK
    assert [(e["step"], e["from_micro_batch"], e["to_micro_batch"]) for e in events(run, "oom_shrink")] == [(3, 8, 4)]
    assert [(e["step"], e["to_micro_batch"], e["try"]) for e in events(run, "oom_regrow")] == [(5, 8, 1)]
    assert [r["micro_batch"] for r in records(run)] == [8, 8, 4, 4, 8, 8, 8, 8]
    losses = [r["loss"] for r in records(clean)]
    assert [r["loss"] for r in records(run)] == pytest.approx(losses, rel=1e-5)  # the same training


def test_a_lasting_limit_is_tried_a_bounded_number_of_times_with_doubling_waits(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "mbs>4")
    run = tmp_path / "run"
    spec = tiny_spec(run, training={"micro_batch": 8, "steps": 12}, memory={"tier": "fast", "regrow_after": 1})
    assert train_in_process(spec)[0] == EXIT_OK
    # waits of 1, 2 and 4 steps completed at micro-batch 4 (the step a failed try redoes counts)
    assert [e["step"] for e in events(run, "oom_regrow")] == [2, 4, 8]
    assert len(events(run, "oom_shrink")) == 1 + TRIES
    assert all(r["micro_batch"] == 4 for r in records(run))


def test_regrow_off_keeps_the_smaller_micro_batch():
    g = Regrow(None)
    g.shrunk(8)
    for _ in range(100):
        g.stepped(4)
    assert g.proposal(4) is None
