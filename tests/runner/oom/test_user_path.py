"""The user path under OOMs at seeded random moments, on the CPU: `jobspec run` (supervisor and worker, as a user
runs it) on a tiny spec with the project's fault injection (JOBSPEC_FAULT_OOM) at two seeded random steps, each at a
seeded random allocating op: the first is shrunk in process, the second lands at micro-batch 1 and steps the tier
down in process. The GPU version (a hog process taking the memory from outside, llama-1b) is bench/gpu/userpath.py,
the suite's part `userpath`; this is its CPU analog and shares its checks (`judge`)."""

from __future__ import annotations

import random

import pytest

from bench.gpu import userpath
from tests.runner.train_helpers import timeout_s


@pytest.mark.parametrize("seed", [random.Random(41).randrange(1000)])  # fixed: a red run is never luck
def test_jobspec_run_survives_a_shrink_and_a_step_down_at_random_moments(tmp_path, seed: int) -> None:
    out = userpath.run(userpath.Setup.cpu(), tmp_path, seed=seed, timeout_s=timeout_s(300))
    assert out["failures"] == [], (out["failures"], out["faults"], out["log_tail"])
    assert out["train_steps"] == list(range(1, 9))  # every step once
    assert out["shrinks"] and out["tier_changes"][0]["to_tier"] == "zero2_offload"
    assert out["phases"]["started"] >= 1 and not out["phases"]["never_ended"]


def test_the_log_checks_find_a_phase_that_never_ends_and_a_silence() -> None:
    lines = [(0.0, "19:00:00 INFO [rank 0] building the model ..."),
             (1.0, "19:00:01 INFO [rank 0] building the model: done in 1.00 s (CPU 0.90 s)"),
             (2.0, "19:00:02 WARNING [rank 0] stepping down tier fast -> zero2_offload ..."),
             (30.0, "19:00:30 INFO [rank 0] step 5/8 | loss 1.0")]  # fmt: skip
    phases = userpath.check_phases(lines)
    assert phases == {"started": 2, "ended": 1, "never_ended": ["stepping down tier fast -> zero2_offload"]}
    assert userpath.longest_gap(lines, 0.5, 31.0) == pytest.approx(28.0)
    assert userpath.longest_gap(lines, 0.5, 31.0, unexplained=True) == pytest.approx(1.0)  # the step-down is open
    oom = "19:00:00 INFO [rank 0] step 2: out of memory at micro-batch 1 on rank 0 (x); releasing"
    redo = [(0.0, "19:00:00 INFO [rank 0] step 2: redoing it at micro-batch 1 x 8 ..."),
            (0.1, oom + " ..."),
            (0.2, oom + ": done in 0.1 s"),
            (0.3, "19:00:00 INFO [rank 0] step 3: redoing it at micro-batch 1 x 8 ..."),
            (0.4, "19:00:00 INFO [rank 0] step 3 recovered from its OOM: attempts_s 0.1")]  # fmt: skip
    assert userpath.check_phases(redo) == {"started": 3, "ended": 3, "never_ended": []}
    assert userpath.check_phases(redo[:4])["never_ended"] == ["step 3: redoing it at micro-batch 1 x 8"]
    ended = [*lines[:3], (12.0, "19:00:12 INFO [rank 0] stepping down tier fast -> zero2_offload: done in 10.0 s"),
             lines[3]]  # fmt: skip
    assert userpath.longest_gap(ended, 0.5, 31.0, unexplained=True) == pytest.approx(18.0)


def test_a_recovery_runs_from_its_first_oom_to_the_redone_step_or_the_step_down() -> None:
    train = [{"step": s, "time": 10.0 * s} for s in range(1, 9)]
    shrinks = [{"step": 3, "oom_at": 25.0}, {"step": 5, "oom_at": 41.0}, {"step": 5, "oom_at": 42.0}]
    changes = [{"step": 4, "oom_at": 43.0, "time": 47.0}]  # step 5 ran out at micro-batch 1 too: the tier stepped down
    assert userpath.recoveries(train, shrinks, changes) == [(25.0, 30.0), (41.0, 47.0)]
