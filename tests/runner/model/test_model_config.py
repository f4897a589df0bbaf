"""The runner refuses a hostile or impossible model config before building it, and stops in every phase.

`jobspec run`'s supervisor checks config.json before starting a worker (exit 2 in seconds); a worker that
reads the config through transformers refuses whatever transformers cannot read; a model whose states fit
no tier of this machine is refused before a weight is allocated. A SIGTERM during setup ends the worker at
once (143), and a worker deaf to it (a long C call) is killed by the supervisor within the grace period.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_PREEMPTED
from jobspec.errors import ConfigError
from tests.runner.train_helpers import (
    ROOT,
    communicate_or_fail,
    run_supervisor,
    runner_env,
    save_test_tokenizer,
    tiny_spec_dict,
    write_spec,
)

LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
}


def model_spec(tmp_path: Path, config: dict, **sections: dict) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    save_test_tokenizer(model)
    spec = tiny_spec_dict(tmp_path / "run", **sections)
    spec["model"] = {"path": str(model)}
    return write_spec(tmp_path / "s.yaml", spec)


def test_run_refuses_a_hostile_config_before_any_worker(tmp_path):
    t0 = time.perf_counter()
    result = run_supervisor([str(model_spec(tmp_path, {**LLAMA, "num_attention_heads": 0}))], timeout=120)
    seconds = time.perf_counter() - t0
    assert result.returncode == EXIT_CONFIG, result.stderr[-2000:]
    assert "num_attention_heads: 0 is not positive" in result.stderr and "Traceback" not in result.stderr
    assert "starting 1 worker" not in result.stderr and seconds < 60  # preflight: no torch import, no worker


def test_run_refuses_a_model_that_fits_no_tier_of_this_host(tmp_path):
    """1024 layers of width 65536, every number in bounds: ~70 T parameters. The worker's plan refuses it from
    the parameter count, before build_model allocates anything (it would take minutes and then the host)."""
    huge = {
        **LLAMA,
        "num_hidden_layers": 1024,
        "hidden_size": 65536,
        "num_attention_heads": 512,
        "num_key_value_heads": 64,
        "intermediate_size": 262144,
    }
    result = run_supervisor([str(model_spec(tmp_path, huge))], timeout=180)
    assert result.returncode == EXIT_CONFIG, result.stderr[-2000:]
    assert "fit no memory tier" in result.stderr and "Traceback" not in result.stderr


def test_a_config_transformers_cannot_read_is_a_config_error(tmp_path):
    from runner.model.build import checked_config

    for bad in ({**LLAMA, "model_type": "no-such-model"}, {**LLAMA, "head_dim": 0}, {**LLAMA, "rope_scaling": 7}):
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=r"model\.path"):
            checked_config(str(d))


SLOW_BUILD = """
import sys, time
from runner.model import build
from runner.process import worker

def slow(*args, **kwargs):
    print("building", file=sys.stderr, flush=True)
    time.sleep(600)  # a build that takes minutes (Python-level: the signal handler runs)

build_model = slow
import runner.train.recipe as recipe
recipe.build_model = slow
worker._exit(worker.main([sys.argv[1]]))
"""


def test_sigterm_during_the_model_build_ends_the_worker_at_once(tmp_path):
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run"))
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_BUILD, str(spec)], cwd=ROOT, env=runner_env(), stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # until the build has started
            if line.startswith("building"):
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = communicate_or_fail(proc, "the worker to stop after SIGTERM during the build", timeout=30)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED and "stopped by signal 15 before training" in err, err[-2000:]
    assert "Traceback" not in err and seconds < 10


DEAF = """
import os, signal, sys, time
if os.environ.get("RANK") is not None:  # a worker, not the supervisor: deaf to SIGTERM, as in a long C call
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    print("deaf worker", file=sys.stderr, flush=True)
    time.sleep(600)
"""


def test_a_worker_deaf_to_sigterm_is_killed_within_the_grace_period(tmp_path):
    """The supervisor passes SIGTERM on, and kills a worker still running `termination_grace_seconds - 10` s
    later: the pod ends on its own, with exit 143 and a termination message, before the kubelet's SIGKILL."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(DEAF)
    spec = write_spec(
        tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", scheduling={"termination_grace_seconds": 15})
    )
    term = tmp_path / "termination"
    env = runner_env(PYTHONPATH=f"{site}:{ROOT}", JOBSPEC_TERMINATION_LOG=str(term))
    proc = subprocess.Popen(
        [sys.executable, "-m", "runner", str(spec)], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "deaf worker" in line:
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = communicate_or_fail(proc, "the supervisor to kill its deaf worker", timeout=60)
        seconds = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert 4 < seconds < 14, seconds  # 15 s grace - 10 s margin, plus the poll
    assert "did not stop within the grace period" in term.read_text()
