"""The subprocess helpers of the training tests: generous, scalable limits, and a timeout that says what
it was waiting for and what the process last wrote."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.runner import train_helpers
from tests.runner.train_helpers import TIMEOUT_SCALE_ENV, communicate_or_fail, run_supervisor, timeout_s

SLEEPER = "import sys, time; sys.stderr.write('loading the model\\n'); sys.stderr.flush(); time.sleep(120)"


def test_timeouts_scale_with_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_SCALE_ENV, raising=False)
    assert timeout_s() == train_helpers.TRAINING_TIMEOUT_S >= 600
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "2.5")
    assert timeout_s(100) == 250
    for bad in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv(TIMEOUT_SCALE_ENV, bad)
        with pytest.raises(ValueError, match=TIMEOUT_SCALE_ENV):
            timeout_s()


def test_a_timed_out_wait_names_what_it_waited_for_and_the_stderr_so_far() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stderr=subprocess.PIPE, text=True)
    with pytest.raises(AssertionError) as info:
        communicate_or_fail(proc, "rank 1 of the sleeper", timeout=3)
    text = str(info.value)
    assert "timed out after 3 s" in text and "waiting for rank 1 of the sleeper" in text
    assert "loading the model" in text
    assert proc.poll() is not None  # killed, not left running


def test_run_supervisor_reports_the_command_and_kills_it(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(train_helpers, "TRAINING_TIMEOUT_S", 0.5)  # far less than the runner needs to start
    monkeypatch.setenv(TIMEOUT_SCALE_ENV, "1")
    # A valid spec that trains for long: a bad one is refused (exit 2) in well under 0.5 s on an idle machine.
    spec = train_helpers.write_spec(
        tmp_path / "s.yaml", train_helpers.tiny_spec_dict(tmp_path / "run", training={"steps": 100000})
    )
    with pytest.raises(AssertionError) as info:
        run_supervisor([str(spec)], timeout=0.1, JOBSPEC_KILL_GRACE_S="5")
    text = str(info.value)
    assert "timed out after 0.5 s (JOBSPEC_TEST_TIMEOUT_SCALE=1)" in text
    assert f"JOBSPEC_KILL_GRACE_S=5 {sys.executable} -m runner {spec}" in text and "Last stderr:" in text


LOUD_RANKS = """import sys, time
sys.stderr.write("x" * 1_000_000)  # far past a pipe's 64 KiB
sys.stderr.flush()
sys.stdout.write(sys.argv[1] * 3)
"""


def test_drained_runs_never_block_in_a_full_pipe() -> None:
    """Two processes that each write 1 MB to stderr, waited for one after the other: with Popen's pipes the second
    would block in its write while the test waits on the first (a gang's collective then hangs both)."""
    command = [sys.executable, "-c", LOUD_RANKS]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [train_helpers.Drained([*command, str(r)], **pipes) for r in (0, 1)]
    procs[1].wait(timeout=60)  # the one not being read: it ends, its pipe drained by a thread
    outs = [communicate_or_fail(p, f"rank {r}", timeout=60) for r, p in enumerate(procs)]
    assert outs == [("000", "x" * 1_000_000), ("111", "x" * 1_000_000)]
    assert procs[0].read_so_far("stdout") == "000" and procs[0].read_so_far("missing") is None
