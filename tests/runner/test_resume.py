"""Exact resume, and SIGTERM: checkpoint, exit 143, termination message, and a loadable checkpoint."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from jobspec.contract import EXIT_OK, EXIT_PREEMPTED
from runner import checkpoint
from tests.runner.train_helpers import (
    ROOT,
    records,
    runner_env,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    write_spec,
)

LORA = {"lora": {"rank": 4, "targets": ["c_attn"], "dropout": 0.1}}  # dropout: the RNG state must resume too


@pytest.mark.parametrize("model", [{}, LORA], ids=["full", "lora-dropout"])
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path, model):
    """Uninterrupted to step 8 vs stopped at 4 (its checkpoint copied alone) and resumed to 8."""
    sections = {"model": model, "training": {"micro_batch": 4, "steps": 8}, "checkpoints": {"every_steps": 4}}
    code, full = train_in_process(tiny_spec(tmp_path / "full", **sections))
    assert code == EXIT_OK
    (tmp_path / "part").mkdir()
    shutil.copytree(tmp_path / "full" / "step-4", tmp_path / "part" / "step-4")
    code, part = train_in_process(tiny_spec(tmp_path / "part", **sections))
    assert code == EXIT_OK
    plan = records(tmp_path / "part", "plan")[0]
    assert plan["resumed"] and plan["step"] == 4
    a = {r["step"]: r["loss"] for r in records(tmp_path / "full")}
    b = {r["step"]: r["loss"] for r in records(tmp_path / "part")}
    assert sorted(b) == [5, 6, 7, 8]
    # Same data order, optimizer moments, LR and RNG on a deterministic CPU: bit-identical.
    assert all(b[s] == a[s] for s in b), (a, b)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), part.model.state_dict().items(), strict=True):
        assert torch.equal(v, w), k


def test_sigterm_checkpoints_exits_143_and_the_checkpoint_resumes(tmp_path):
    run = tmp_path / "run"
    spec = write_spec(
        tmp_path / "s.yaml", tiny_spec_dict(run, training={"steps": 100000}, checkpoints={"every_steps": 100000})
    )
    term = tmp_path / "termination-log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", str(spec)],
        cwd=ROOT,
        env=runner_env(JOBSPEC_TERMINATION_LOG=str(term)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(r["step"] >= 3 for r in records(run)):
            assert proc.poll() is None and time.monotonic() < deadline, "no training progress"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # to the supervisor, as the kubelet does to PID 1
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr
    saved = checkpoint.latest(run)
    assert saved is not None and (saved / "DONE").is_file()
    step = checkpoint.read_meta(saved)["step"]
    assert step >= 3 and saved.name == f"step-{step}"
    message = json.loads(term.read_text())
    assert message["exit_code"] == EXIT_PREEMPTED and message["tier"] == "fast" and message["step"] == step
    assert "preempted" in message["reason"]
    # Loadable: the next attempt resumes from it and finishes two more steps.
    code, _ = train_in_process(tiny_spec(run, training={"steps": step + 2}, checkpoints={"every_steps": 100000}))
    assert code == EXIT_OK
    assert records(run, "plan")[-1]["step"] == step and records(run)[-1]["step"] == step + 2
