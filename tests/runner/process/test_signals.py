"""Ctrl-C in `jobspec run` behaves like the kubelet's SIGTERM: checkpoint, exit 143, resumable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from jobspec.contract import EXIT_PREEMPTED
from runner.checkpoint import store
from tests.runner.train_helpers import (
    ROOT,
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
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(write_spec(tmp_path / "s.yaml", spec))], cwd=ROOT,
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
    import os

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
