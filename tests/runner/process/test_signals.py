"""Ctrl-C, a closed terminal (SIGHUP) and SIGQUIT in `jobspec run` behave like the kubelet's SIGTERM: checkpoint,
exit 143, resumable. A supervisor killed by SIGKILL takes its worker with it (runner/process/lifeline.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from jobspec.contract import EXIT_PREEMPTED
from runner.checkpoint import store
from tests.runner.train_helpers import (
    ROOT,
    Drained,
    communicate_or_fail,
    records,
    runner_env,
    timeout_s,
    tiny_spec_dict,
    write_spec,
)


def test_sigint_checkpoints_and_exits_143(tmp_path):
    run = tmp_path / "run"
    spec = tiny_spec_dict(run, training={"steps": 100000}, checkpoints={"every_steps": 100000})
    proc = Drained([sys.executable, "-m", "runner", str(write_spec(tmp_path / "s.yaml", spec))], cwd=ROOT,
                            env=runner_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_s()
        while not any(r["step"] >= 2 for r in records(run)):
            assert proc.poll() is None, "the runner ended before its second step"
            assert time.monotonic() < deadline, f"waited {timeout_s():.0f} s for the second training step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends to the foreground process
        _, stderr = communicate_or_fail(proc, "the runner to checkpoint and exit after SIGINT")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    saved = store.latest(run)
    assert saved is not None and store.read_meta(saved)["step"] >= 2 and "Traceback" not in stderr


def test_sigterm_between_two_launches_ends_preempted_with_a_termination_message(tmp_path, monkeypatch):
    """A SIGTERM in the supervisor's relaunch wait (no worker running) starts no new launch: exit 143 and
    the termination message, with the last launch's tier and step, instead of a death by the signal."""
    import json

    from jobspec.contract import EXIT_OOM_RETRY_TIER
    from runner.oom import ladder
    from runner.process import supervisor
    from tests.runner.train_helpers import tiny_spec

    spec = tiny_spec(tmp_path / "run", memory={"tier": "fast"})
    launches: list[str] = []

    def attempt(*_: object) -> supervisor.Outcome:  # a launch whose micro-batch 1 ran out at its tier
        launches.append(ladder.current_tier(spec.checkpoints.dir, "fast"))
        ladder.fail_tier(spec.checkpoints.dir, launches[-1], "test: out of memory")
        os.kill(os.getpid(), signal.SIGTERM)  # arrives after the workers ended, before the relaunch
        return supervisor.Outcome(EXIT_OOM_RETRY_TIER, "out of memory", {"tier": launches[-1], "step": 3})

    monkeypatch.setattr(supervisor, "run_attempt", attempt)
    before = signal.getsignal(signal.SIGTERM)
    outcome = supervisor.supervise(spec, "s.yaml", [], nproc=1)  # without the handler: this process dies
    assert launches == ["fast"] and outcome.exit_code == EXIT_PREEMPTED
    assert "stopped by a signal before the relaunch" in outcome.reason
    assert json.loads(outcome.message())["step"] == 3
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back


def start_training(tmp_path, launcher: str) -> tuple[subprocess.Popen, int]:
    """`jobspec run` or `python -m runner` on a tiny spec that trains for ever, in its own session (the cleanup's
    process group); returns once the worker trained a step: (the supervisor, the worker's pid from its plan record)."""
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, training={"steps": 100000},
                                                          checkpoints={"every_steps": 100000}))  # fmt: skip
    cmd = {"jobspec run": [sys.executable, "-m", "jobspec", "run", str(spec)],
           "python -m runner": [sys.executable, "-m", "runner", str(spec)]}[launcher]  # fmt: skip
    proc = Drained(cmd, cwd=ROOT, env=runner_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + timeout_s()
    while not records(run):
        if proc.poll() is not None or time.monotonic() > deadline:
            _, err = communicate_or_fail(proc, "the runner's end")
            raise AssertionError(f"no training step (exit {proc.returncode}):\n{err[-3000:]}")
        time.sleep(0.1)
    return proc, records(run, "plan")[0]["pid"]


def stop_everything(proc: subprocess.Popen) -> None:
    """SIGKILL what is left of the run: the supervisor's process group holds its workers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.parametrize("launcher", ["jobspec run", "python -m runner"])
def test_a_sigkilled_supervisor_takes_its_worker_with_it(tmp_path, launcher):
    """The H200 finding (issue 41): `jobspec run` killed with SIGKILL left its worker training on the GPU. Now the
    worker gets SIGTERM from the kernel: it checkpoints what it trained and exits within seconds."""
    from tests.runner.process.test_lifeline import gone_within

    proc, worker = start_training(tmp_path, launcher)
    try:
        assert worker != proc.pid  # `jobspec run` execs the supervisor: the pid killed is the worker's parent
        proc.send_signal(signal.SIGKILL)
        took = gone_within(worker, timeout_s(15))
        assert took is not None, f"the worker (pid {worker}) trained on after its supervisor was SIGKILLed"
        _, stderr = communicate_or_fail(proc, "the worker's stderr to close")
    finally:
        stop_everything(proc)
    assert "Traceback" not in stderr, stderr[-3000:]
    saved = store.latest(tmp_path / "run")
    assert saved is not None and store.read_meta(saved)["step"] >= 1, "the orphan stopped without its checkpoint"


def test_a_supervisor_killed_while_its_worker_starts_takes_it_too(tmp_path):
    """The worker's first seconds are imports (torch), before its stop handler exists: it is armed before them
    (lifeline.arm), so a supervisor SIGKILLed then does not leave it to import, bind and only then stop."""
    from pathlib import Path

    from tests.runner.process.test_lifeline import gone_within

    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", training={"steps": 100000}))
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(spec)], cwd=ROOT, env=runner_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        deadline = time.monotonic() + timeout_s(120)
        while not (kids := children.read_text().split()):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.01)
        worker = int(kids[0])
        time.sleep(0.3)  # inside its imports (seconds), past `arm`
        proc.send_signal(signal.SIGKILL)
        took = gone_within(worker, timeout_s(5))
        assert took is not None, f"the starting worker (pid {worker}) went on after its supervisor was SIGKILLed"
        # the kernel's signal, at once: not after the rest of its imports (seconds, even on an idle machine)
        assert took < 1.0, f"the starting worker took {took:.1f} s to go"
    finally:
        stop_everything(proc)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT])
def test_a_closed_terminal_or_sigquit_checkpoints_and_exits_143(tmp_path, sig):
    """A closed terminal's SIGHUP and `kill -QUIT` are stops like SIGTERM (test_resume.py) and Ctrl-C (above): the
    supervisor passes each on, ends 143 with the steps checkpointed, and its worker is gone with it. (Left to their
    default action they ended the supervisor at once, exit -1 or -3, with no termination message.)"""
    from tests.runner.process.test_lifeline import alive

    proc, worker = start_training(tmp_path, "python -m runner")
    try:
        proc.send_signal(sig)
        _, stderr = communicate_or_fail(proc, f"the runner to checkpoint and exit after signal {sig}")
    finally:
        stop_everything(proc)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert not alive(worker)
    saved = store.latest(tmp_path / "run")
    assert saved is not None and store.read_meta(saved)["step"] >= 1 and "Traceback" not in stderr
