"""Exact resume, and SIGTERM: checkpoint, exit 143, a termination message that tells the truth, and a
loadable checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from jobspec.contract import EXIT_OK, EXIT_PREEMPTED
from runner.checkpoint import store
from tests.runner.train_helpers import (
    ROOT,
    Drained,
    communicate_or_fail,
    records,
    runner_env,
    timeout_s,
    tiny_spec,
    tiny_spec_dict,
    train_and_resume,
    train_in_process,
    worker_in_process,
    write_spec,
)

LORA = {"lora": {"rank": 4, "targets": ["c_attn"], "dropout": 0.1}}  # dropout: the RNG state must resume too


@pytest.mark.parametrize("model", [{}, LORA], ids=["full", "lora-dropout"])
def test_a_resumed_run_matches_an_uninterrupted_one(tmp_path, model):
    """Uninterrupted to step 8 vs stopped at 4 (its checkpoint copied alone) and resumed to 8."""
    sections = {"model": model, "training": {"micro_batch": 4, "steps": 8}, "checkpoints": {"every_steps": 4}}
    full, part = train_and_resume(tmp_path, sections)
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
    proc = Drained(
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
    saved = store.latest(run)
    assert saved is not None and (saved / "DONE").is_file()
    step = store.read_meta(saved)["step"]
    assert step >= 3 and saved.name == f"step-{step}"
    message = json.loads(term.read_text())
    assert message["exit_code"] == EXIT_PREEMPTED and message["tier"] == "fast" and message["step"] == step
    assert message["reason"] == f"preempted at step {step}: checkpoint step-{step} written"
    # Loadable: the next attempt resumes from it and finishes two more steps.
    code, _ = train_in_process(tiny_spec(run, training={"steps": step + 2}, checkpoints={"every_steps": 100000}))
    assert code == EXIT_OK
    assert records(run, "plan")[-1]["step"] == step and records(run)[-1]["step"] == step + 2


# --- the termination message tells the truth ----------------------------------------------------------------

NO_EXPORT = {"export": False}


def test_sigterm_before_the_first_step_writes_no_checkpoint_and_says_so(tmp_path, monkeypatch):
    from runner.train.recipe import Recipe

    real_train = Recipe.train

    def stopped_at_once(self):
        self.stop.signum = signal.SIGTERM  # arrived during setup: seen at the first micro-step
        return real_train(self)

    monkeypatch.setattr(Recipe, "train", stopped_at_once)
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, output=NO_EXPORT))
    code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_PREEMPTED and status["step"] == 0
    assert status["reason"] == "stopped before the first step: no checkpoint written (nothing trained yet)"
    assert store.latest(run) is None and not list(run.glob("*step-*"))


def test_sigterm_while_the_workers_start_reports_no_checkpoint(tmp_path):
    """The supervisor forwards SIGTERM while its worker imports or sets up: whichever it meets, the message
    must not claim a checkpoint (it used to say "preempted: checkpoint written")."""
    run, term = tmp_path / "run", tmp_path / "termination-log"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, output=NO_EXPORT))
    proc = subprocess.Popen([sys.executable, "-m", "runner", str(spec)], cwd=ROOT,
                            env=runner_env(JOBSPEC_TERMINATION_LOG=str(term)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    limit = timeout_s()
    watchdog = threading.Timer(limit, proc.kill)  # reading stderr line by line has no timeout of its own
    watchdog.start()
    try:
        for line in proc.stderr:  # the supervisor's log, until it has started the worker
            if "starting 1 worker(s)" in line:
                break
        assert proc.poll() is None, f"the supervisor did not start its worker within {limit:g} s"
        proc.send_signal(signal.SIGTERM)
        _, stderr = communicate_or_fail(proc, "the runner to stop after a SIGTERM while its worker started")
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # the supervisor and its worker
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
    assert proc.returncode == EXIT_PREEMPTED, stderr[-3000:]
    message = json.loads(term.read_text())
    assert message["exit_code"] == EXIT_PREEMPTED and "no checkpoint written" in message["reason"], message
    assert store.latest(run) is None


def test_sigterm_during_the_final_evaluation_still_ends_done(tmp_path, monkeypatch):
    """The last step is trained: the final evaluation is skipped, the final checkpoint written, exit 0."""
    from runner.train.step import Stepper

    real_evaluate = Stepper.evaluate

    def interrupted(self, *args, **kwargs):
        self.stop.signum = signal.SIGTERM
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(Stepper, "evaluate", interrupted)
    run = tmp_path / "run"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, training={"steps": 4}, output=NO_EXPORT))
    code, status = worker_in_process(spec, tmp_path / "status.json")
    assert code == EXIT_OK and status["reason"] == "done" and status["step"] == 4
    assert store.latest(run) == run / "step-4" and store.verify(run / "step-4") is None
    assert not records(run, "eval")


SIGTERM_AFTER_THE_END = """
import os, signal, sys, time
from runner.process import worker
from runner.train.recipe import Recipe

real_cleanup = Recipe.cleanup

def cleanup_then_sigterm(self):
    real_cleanup(self)
    os.kill(os.getpid(), signal.SIGTERM)  # the kubelet's SIGTERM, just after the final checkpoint
    time.sleep(0.5)

Recipe.cleanup = cleanup_then_sigterm
worker._exit(worker.main([sys.argv[1]]))  # as `python -m runner.process.worker` leaves
"""


def test_sigterm_after_the_final_checkpoint_exits_0(tmp_path):
    run, status = tmp_path / "run", tmp_path / "status.json"
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(run, training={"steps": 3}, output=NO_EXPORT))
    result = subprocess.run([sys.executable, "-c", SIGTERM_AFTER_THE_END, str(spec)], cwd=ROOT,
                            env=runner_env(JOBSPEC_STATUS_FILE=str(status)), capture_output=True, text=True,
                            timeout=timeout_s())  # fmt: skip
    assert result.returncode == EXIT_OK, result.stderr[-3000:]  # it used to die by the signal (-15 -> 143)
    assert json.loads(status.read_text())["reason"] == "done" and store.latest(run) == run / "step-3"
