"""One writer per run directory: the lease (runner/checkpoint/lease.py) and what a second run sees."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK, EXIT_PREEMPTED
from jobspec.errors import ConfigError
from runner.checkpoint import lease as lease_mod
from runner.checkpoint.lease import LEASE_FILE, Lease, LeaseHeld, LeaseLost
from tests.runner.train_helpers import (
    ROOT,
    communicate_or_fail,
    records,
    run_supervisor,
    runner_env,
    timeout_s,
    tiny_spec_dict,
    write_spec,
)


def _holder(root, **fields) -> dict:
    """Write a lease record as another holder would have, with this host's identity unless overridden."""
    record = {"holder": "other", "job": "runner-test", **lease_mod._identity(), "since": time.time() - 5,
              "heartbeat": time.time() - 1, **fields}  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    (root / LEASE_FILE).write_text(json.dumps(record))
    return record


@pytest.fixture
def live_process():
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait(60)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait(60)
    return proc.pid


def test_acquire_writes_the_holder_and_release_removes_it(tmp_path):
    lease = Lease(tmp_path, "job-a")
    lease.acquire()
    record = json.loads((tmp_path / LEASE_FILE).read_text())
    assert record["job"] == "job-a" and record["holder"] == lease.holder and record["host"] == socket.gethostname()
    assert record["pid"] > 0 and record["since"] <= record["heartbeat"] <= time.time()
    lease.release()
    assert not (tmp_path / LEASE_FILE).exists()


def test_a_live_holder_is_refused_with_its_host_pid_and_start(tmp_path, live_process):
    _holder(tmp_path, pid=live_process.pid, pid_start=lease_mod._proc_stat(live_process.pid)[1])
    with pytest.raises(LeaseHeld) as err:
        Lease(tmp_path, "runner-test").acquire()
    text = str(err.value)
    assert err.value.exit_code == EXIT_CONFIG and f"{tmp_path} is in use by another run" in text
    assert f"on host {socket.gethostname()}, pid {live_process.pid}, since " in text and " UTC" in text
    assert "expires in" in text and f"delete {tmp_path / LEASE_FILE}" in text


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, caplog):
    pid = _dead_pid()
    _holder(tmp_path, pid=pid)
    lease = Lease(tmp_path, "runner-test")
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        lease.acquire()
    assert f"its process {pid} on this host has exited" in caplog.text
    assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == lease.holder


def test_a_reused_pid_is_not_the_holder(tmp_path, live_process):
    _holder(tmp_path, pid=live_process.pid, pid_start=1)  # the pid runs, but a process started at another time
    Lease(tmp_path, "runner-test").acquire()


def test_a_holder_that_stopped_renewing_is_taken_over_after_the_timeout(tmp_path, monkeypatch, caplog):
    _holder(tmp_path, host="elsewhere", boot_id="b", pid_ns="n", pid=1, heartbeat=time.time() - 60)
    with pytest.raises(LeaseHeld, match="on host elsewhere, pid 1"):
        Lease(tmp_path, "runner-test").acquire()  # default timeout 600 s: still held
    monkeypatch.setenv("JOBSPEC_LEASE_TIMEOUT_S", "30")
    with caplog.at_level(logging.WARNING, logger="jobspec.runner"):
        Lease(tmp_path, "runner-test").acquire()
    assert "its last heartbeat was 60 s ago (JOBSPEC_LEASE_TIMEOUT_S=30)" in caplog.text


def test_the_previous_pod_of_the_same_job_index_is_stale(tmp_path, monkeypatch):
    """Kubernetes: the replacement pod has the same hostname (`<job>-<index>`) in a new PID namespace."""
    _holder(tmp_path, pid_ns="pid:[1]", pid=7)
    with pytest.raises(LeaseHeld):
        Lease(tmp_path, "runner-test").acquire()  # outside a Job the same hostname proves nothing
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    Lease(tmp_path, "runner-test").acquire()


def test_an_unreadable_lease_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_mod, "SETTLE_S", 0.0)
    (tmp_path / LEASE_FILE).write_text('{"holder": "x", "pi')
    lease = Lease(tmp_path, "runner-test")
    lease.acquire()
    assert lease.held


def test_heartbeats_are_rate_limited_and_a_lost_lease_stops_the_writer(tmp_path):
    lease = Lease(tmp_path, "runner-test", timeout=600)
    lease.acquire()
    first = json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"]
    lease.beat()  # within the interval: no write
    assert json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] == first
    lease.beat(force=True)
    assert json.loads((tmp_path / LEASE_FILE).read_text())["heartbeat"] > first
    _holder(tmp_path, holder="taker", host="elsewhere")  # another run took it over while we stalled
    with pytest.raises(LeaseLost, match="taken over by job 'runner-test' on host elsewhere"):
        lease.beat(force=True)
    lease.release()
    assert json.loads((tmp_path / LEASE_FILE).read_text())["holder"] == "taker"  # not ours to remove


def test_a_bad_timeout_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_LEASE_TIMEOUT_S", "ten minutes")
    with pytest.raises(ConfigError, match="JOBSPEC_LEASE_TIMEOUT_S='ten minutes'"):
        Lease(tmp_path, "runner-test")


HOLD = """
import sys, time
from runner.checkpoint.lease import Lease
Lease(sys.argv[1], "runner-test").acquire()
print("HELD", flush=True)
time.sleep(300)
"""


def test_a_sigkilled_holder_is_taken_over_by_the_next_process(tmp_path):
    """What the supervisor's relaunch after a worker crash (or a host OOM kill) meets."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT, env=runner_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    watchdog = threading.Timer(300, proc.kill)  # readline has no timeout of its own
    watchdog.start()
    try:
        assert proc.stdout.readline().strip() == "HELD", "the holder did not take the lease within 300 s"
        with pytest.raises(LeaseHeld):
            Lease(tmp_path, "runner-test").acquire()  # alive: refused
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait(60)
    Lease(tmp_path, "runner-test").acquire()  # dead (reaped): stale


NO_EXPORT = {"export": False}  # the lease is the point here, not the model


# --- real runs ----------------------------------------------------------------------------------------------


def test_a_second_run_on_the_same_directory_exits_2_and_the_first_goes_on(tmp_path):
    run = tmp_path / "run"
    endless = tiny_spec_dict(run, training={"steps": 100000}, checkpoints={"every_steps": 100000}, output=NO_EXPORT)
    spec = write_spec(tmp_path / "s.yaml", endless)
    # Its log goes to a file: a pipe nobody reads while the second run starts fills (64 KiB of step lines) and then
    # blocks the first run in its next log line, which the loop below took for a first run that stopped training.
    log_path = tmp_path / "first.stderr"
    with log_path.open("w") as log_file:
        first = subprocess.Popen([sys.executable, "-m", "runner", str(spec)], cwd=ROOT, env=runner_env(),
                                 stdout=subprocess.DEVNULL, stderr=log_file, text=True,
                                 start_new_session=True)  # fmt: skip
    try:
        limit = timeout_s()
        deadline = time.monotonic() + limit
        while not any(r["step"] >= 2 for r in records(run)):
            assert first.poll() is None, "the first run ended before its second step"
            assert time.monotonic() < deadline, f"waited {limit:g} s for the first run's second step"
            time.sleep(0.2)
        holder = json.loads((run / LEASE_FILE).read_text())
        term = tmp_path / "termination-log"
        second = run_supervisor([str(spec), "--set", "training.steps=3"], timeout=600,
                                JOBSPEC_TERMINATION_LOG=str(term))  # fmt: skip
        assert second.returncode == EXIT_CONFIG, second.stderr[-3000:]
        reason = json.loads(term.read_text())["reason"]
        assert (
            f"{run} is in use by another run: job 'runner-test' on host {holder['host']}, pid {holder['pid']}" in reason
        )
        assert first.poll() is None, "the first run must go on"
        seen, deadline = len(records(run)), time.monotonic() + limit
        while len(records(run)) < seen + 2:
            assert first.poll() is None, "the first run stopped after the second one was refused"
            assert time.monotonic() < deadline, (f"waited {limit:g} s for two more steps of the first run:\n"
                                                 f"{log_path.read_text()[-3000:]}")  # fmt: skip
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        communicate_or_fail(first, "the first run to checkpoint and exit after SIGTERM")
    finally:
        if first.poll() is None:  # the supervisor and its worker
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(60)
    assert first.returncode == EXIT_PREEMPTED, log_path.read_text()[-3000:]
    steps = [r["step"] for r in records(run)]
    assert steps == list(range(1, len(steps) + 1))  # one writer: every step logged once, in order
    assert not (run / LEASE_FILE).exists()  # released at exit


def test_a_relaunch_after_a_tier_failure_takes_the_lease_back(tmp_path):
    """JOBSPEC_STEP_DOWN=restart: the supervisor starts a new worker at the next tier; it must get the lease."""
    run = tmp_path / "run"
    spec = write_spec(
        tmp_path / "s.yaml", tiny_spec_dict(run, training={"micro_batch": 8, "steps": 4}, output=NO_EXPORT)
    )
    result = run_supervisor([str(spec)], timeout=600, JOBSPEC_FAULT_OOM="tier=fast", JOBSPEC_STEP_DOWN="restart")
    assert result.returncode == EXIT_OK, result.stderr[-3000:]
    assert result.stderr.count(f"lease {run / LEASE_FILE} taken") == 2 and "in use by another run" not in result.stderr
    assert [p["tier"] for p in records(run, "plan")] == ["fast", "zero2_offload"]
    assert not (run / LEASE_FILE).exists()


@pytest.mark.parametrize(
    "fields",
    [{"pid": 10**30}, {"pid": -1}, {"pid": 1.5}, {"pid": True}, {"pid_start": "x"}, {"heartbeat": 1e308},
     {"heartbeat": -1e308}, {"since": 10**400}, {"heartbeat": "now"}, {"host": "h" * 100_000}, {"job": ["a"]},
     {"boot_id": {"a": [1]}}],
)  # fmt: skip
def test_a_hostile_lease_record_is_unreadable_never_a_traceback(tmp_path, monkeypatch, fields):
    """Numbers past any bound (a pid past pid_max, a time that overflows a datetime), wrong types and long texts: the
    lease is unreadable, so it is taken over with a warning, and every rank's holder check reads it as held by no run
    of this job; no OverflowError, ValueError or TypeError (exit 1, which the Job retries for ever)."""
    monkeypatch.setattr(lease_mod, "SETTLE_S", 0.0)
    root = tmp_path / "run"
    record = _holder(root)
    (root / LEASE_FILE).write_text(json.dumps({**record, **fields}))
    assert lease_mod.read_record(root / LEASE_FILE) is None
    with pytest.raises(lease_mod.Superseded):
        lease_mod.check_holder(root, "mine", "runner-test")
    mine = Lease(root, "runner-test", timeout=60)
    mine.acquire()
    assert json.loads((root / LEASE_FILE).read_text())["holder"] == mine.holder
    mine.release()


def test_a_lease_deeper_than_any_record_is_unreadable(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    (root / LEASE_FILE).write_text("[" * 60_000 + "]" * 60_000)
    assert lease_mod.read_record(root / LEASE_FILE) is None
    assert "unknown holder" in lease_mod.describe(lease_mod.read_record(root / LEASE_FILE))


def test_a_directory_at_the_lease_name_is_a_config_error_naming_it(tmp_path):
    """A directory planted at RUN/lease.json: no record can replace it (a rename cannot land on a directory). It was an
    IsADirectoryError traceback, exit 1, which the Job retried for ever; now exit 2 naming it and the fix, unit and
    end to end (the supervisor's termination message)."""
    run = tmp_path / "run"
    (run / LEASE_FILE).mkdir(parents=True)
    with pytest.raises(ConfigError, match=f"{run / LEASE_FILE} is a directory"):
        Lease(run, "job").acquire()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        Lease(tmp_path / "file", "job").acquire()
    term = tmp_path / "termination-log"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run))
    result = run_supervisor([str(spec)], timeout=300, JOBSPEC_TERMINATION_LOG=str(term))
    assert result.returncode == EXIT_CONFIG, result.stderr[-3000:]
    assert "is a directory" in json.loads(term.read_text())["reason"] and "Traceback" not in result.stderr
