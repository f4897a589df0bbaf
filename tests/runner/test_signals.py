"""Ctrl-C in `jobspec run` behaves like the kubelet's SIGTERM: checkpoint, exit 143, resumable."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from jobspec.contract import EXIT_PREEMPTED
from runner import checkpoint
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
    saved = checkpoint.latest(run)
    assert saved is not None and checkpoint.read_meta(saved)["step"] >= 2 and "Traceback" not in stderr
