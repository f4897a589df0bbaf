"""`jobspec run` fails fast and says what it does: checks before the heavy imports, the CPU stand-in for
GPUs this machine lacks, a finished job that is not trained again."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from jobspec.contract import EXIT_CONFIG, EXIT_OK
from jobspec.errors import ConfigError
from runner.process import preflight, supervisor
from tests.runner.train_helpers import (
    ROOT,
    runner_env,
    timeout_s,
    tiny_spec,
    tiny_spec_dict,
    train_in_process,
    write_spec,
)


def jobspec_run(args: list[str], **env: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "jobspec.cli", "run", *args], cwd=ROOT, env=runner_env(**env),
                            capture_output=True, text=True, timeout=timeout_s())  # fmt: skip
    return result, time.perf_counter() - t0


@pytest.mark.parametrize(
    ("sections", "env", "needle"),
    [
        ({"data": {"path": "/no/such/train.jsonl"}}, {}, "data.path /no/such/train.jsonl: no such file"),
        ({"data": {"eval_path": "/no/such/eval.jsonl"}}, {}, "data.eval_path /no/such/eval.jsonl: no such file"),
        ({}, {"JOBSPEC_FAULT_OOM": "mbs<3"}, "cannot read rule 'mbs<3'"),
    ],
    ids=["data", "eval", "fault-rule"],
)
def test_bad_input_is_reported_in_seconds_without_a_traceback(tmp_path, sections, env, needle):
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", **sections))
    result, seconds = jobspec_run([str(spec)], **env)
    assert result.returncode == EXIT_CONFIG and needle in result.stderr
    assert "Traceback" not in result.stderr
    assert seconds < 5, f"took {seconds:.1f} s: the check must come before torch is imported"


def test_a_missing_runner_extra_says_which_extra_to_install(tmp_path, monkeypatch, capsys):
    real = preflight.find_spec
    monkeypatch.setattr(preflight, "find_spec", lambda name: None if name == "peft" else real(name))
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run"))
    assert supervisor.main([str(spec)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "peft not installed" in err and "[runner]" in err and "Traceback" not in err


def test_the_checks_import_no_torch(tmp_path):
    """Nor does the supervisor's look for a finished run in a fresh run directory: torch's and DCP's imports cost
    every start about 3 s of CPU (preflight.finished imported checkpoint.store for a directory with no step)."""
    spec = write_spec(tmp_path / "s.yaml", tiny_spec_dict(tmp_path / "run", training={"steps": 4}))
    code = ("import sys; import runner.process.preflight as p, runner.process.supervisor; "
            "from jobspec.spec.loader import load_spec; spec = load_spec(sys.argv[1]); p.check(spec); "
            "assert p.finished(spec) is None; print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, str(spec)], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s())  # fmt: skip
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_gpu_spec_on_a_machine_without_gpus_runs_on_at_most_its_cores(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(supervisor, "_visible_gpus", lambda: 0)
    monkeypatch.setattr(supervisor.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    spec = tiny_spec(tmp_path, hardware={"vendor": "cuda", "gpus": "H100:8", "nodes": 2}, training={"global_batch": 48})
    topo = supervisor.topology(spec, None)
    assert (topo.nnodes, topo.nproc, topo.cpu) == (1, 2, True)
    assert "asks for 2 nodes x 8 H100 GPU(s) (cuda) and this machine has none: running 1 node x 2 CPU" in caplog.text
    assert supervisor.topology(spec, 3).nproc == 3  # asked for: honoured


def test_a_finished_job_is_not_trained_again(tmp_path):
    spec_dict = tiny_spec_dict(tmp_path / "run", training={"steps": 4})
    assert train_in_process(tiny_spec(tmp_path / "run", training={"steps": 4}))[0] == EXIT_OK
    result, _ = jobspec_run([str(write_spec(tmp_path / "s.yaml", spec_dict))])
    assert result.returncode == EXIT_OK, result.stderr[-2000:]
    assert "nothing to do" in result.stderr and "step 4 of 4" in result.stderr and "starting" not in result.stderr
    assert preflight.finished(tiny_spec(tmp_path / "run", training={"steps": 6})) is None  # more steps: train on
    # The last checkpoint damaged (a file cut short): not "complete"; the workers resume from an intact one.
    shard = next((tmp_path / "run" / "step-4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])
    assert preflight.finished(tiny_spec(tmp_path / "run", training={"steps": 4})) is None


def test_preflight_names_a_tracker_whose_client_is_missing(tmp_path, monkeypatch):
    from runner.output import tracking

    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install mlflow"):
        preflight.check(tiny_spec(tmp_path, tracking={"mlflow": True}))


def test_zero2_offload_on_a_gpu_without_torchao_is_refused_before_any_import(tmp_path, monkeypatch) -> None:
    real = preflight.find_spec
    monkeypatch.setattr(preflight, "find_spec", lambda name: None if name == "torchao" else real(name))
    gpu = {"vendor": "cuda", "gpus": "H100:1"}
    spec = tiny_spec(tmp_path / "run", memory={"tier": "zero2_offload"}, hardware=gpu)
    with pytest.raises(ConfigError, match=r"zero2_offload.*torchao.*jobspec-k8s\[offload\]"):
        preflight.check(spec)
    preflight.check(tiny_spec(tmp_path / "run2", memory={"tier": "zero2_offload"}))  # CPU: trains as zero2


def test_a_4_bit_base_without_torchao_is_refused_before_any_import(tmp_path, monkeypatch) -> None:
    real = preflight.find_spec
    monkeypatch.setattr(preflight, "find_spec", lambda name: None if name == "torchao" else real(name))
    spec = tiny_spec(tmp_path / "run", model={"preset": "llama-tiny", "lora": {"rank": 4, "targets": ["q_proj"]},
                                              "quantize": "nf4"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.quantize nf4.*torchao.*jobspec-k8s\[offload\]"):
        preflight.check(spec)
