"""The runner image, built and run for real (podman, offline): the pod's view of the contract.

Each run mimics the rendered pod: the image's own non-root user, no network (the runner must not
download anything), all capabilities dropped, no privilege escalation, the spec mounted read-only
at contract.SPEC_PATH and a writable volume for the run directory.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
import uuid
from pathlib import Path

import pytest
import yaml

from jobspec import __version__, contract
from jobspec.render.env import SCRATCH_ENV
from jobspec.render.pod import WORKDIR

from . import local_image

pytestmark = pytest.mark.container

QUICKSTART = local_image.REPO / "examples" / "quickstart.yaml"
OUT = "/out"
# Six optimizer steps, a checkpoint every three: step-3 and step-6 (the last) are written.
FEW_STEPS = {
    "training.steps": "6",
    "training.warmup_steps": "1",
    "training.log_every": "1",
    "training.eval_every": "3",
    "checkpoints.every_steps": "3",
    "checkpoints.dir": OUT,
}
# The rendered pod's settings that a container runtime can mimic: a read-only root with a /tmp
# emptyDir the caches are sent to, no capabilities, no privilege escalation, a sized /dev/shm.
# No network: the runner must not download anything.
POD_LIKE = [
    "--network", "none",
    "--cap-drop", "all",
    "--security-opt", "no-new-privileges",
    "--shm-size", "1g",
    "--read-only",  # podman mounts a tmpfs at /tmp (and /var/tmp, /run) of a read-only container
    *(arg for name, value in SCRATCH_ENV.items() for arg in ("--env", f"{name}={value}")),
]  # fmt: skip


def _sets(overrides: dict[str, str]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]


def _mounts(tmp_path: Path, spec_text: str) -> tuple[list[str], Path]:
    """A read-only spec directory at /etc/jobspec and a run directory owned by the container user."""
    spec_dir, out = tmp_path / "spec", tmp_path / "out"
    spec_dir.mkdir()
    (spec_dir / contract.SPEC_FILE_NAME).write_text(spec_text)
    out.mkdir()
    os.chown(out, contract.RUN_AS_UID, contract.RUN_AS_GID)
    return ["-v", f"{spec_dir}:{contract.SPEC_MOUNT_DIR}:ro", "-v", f"{out}:{OUT}"], out


def _output(proc: object) -> str:
    return f"stdout:\n{getattr(proc, 'stdout', '')[-4000:]}\nstderr:\n{getattr(proc, 'stderr', '')[-4000:]}"


def _metrics(out: Path) -> list[dict]:
    path = out / contract.METRICS_FILE
    if not path.exists():
        return []
    complete = path.read_text().split("\n")[:-1]  # the last piece may be a record still being written
    return [json.loads(line) for line in complete if line.strip()]


def _done_steps(out: Path) -> list[int]:
    """Steps of the complete checkpoints (step-<N> directories holding their DONE marker)."""
    steps = []
    for path in out.rglob("step-*"):
        match = re.fullmatch(r"step-(\d+)", path.name)
        if match and path.is_dir() and (path / "DONE").exists():
            steps.append(int(match.group(1)))
    return sorted(steps)


@pytest.mark.parametrize("image_fixture", ["cpu_image", "root_image"])
def test_image_metadata_matches_the_contract(image_fixture: str, request: pytest.FixtureRequest) -> None:
    image = request.getfixturevalue(image_fixture)
    config = local_image.inspect(image)["Config"]
    assert config["User"] == f"{contract.RUN_AS_UID}:{contract.RUN_AS_GID}"
    assert config["Entrypoint"] == ["python", "-m", "runner"]
    assert config["Cmd"] == [contract.SPEC_PATH]
    assert config["Labels"]["org.opencontainers.image.version"] == __version__
    if image_fixture == "root_image":
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in config["Env"]
    assert config["WorkingDir"] == WORKDIR

    proc = local_image.run(
        image,
        ["-c", "import os, jobspec, runner; print(os.getuid(), os.getgid(), os.getcwd())"],
        options=[*POD_LIKE, "--entrypoint", "python"],
    )
    assert proc.returncode == 0, _output(proc)
    assert proc.stdout.split() == [str(contract.RUN_AS_UID), str(contract.RUN_AS_GID), WORKDIR]


def test_root_dockerfile_keeps_the_base_images_torch(root_image: str) -> None:
    """The CUDA/ROCm path: torch comes from the base, not from pip (its wheelhouse has no torch)."""
    probe = ["-c", "import torch; print(torch.__version__, torch.__file__)"]
    in_base = local_image.run(local_image.TORCH_BASE_IMAGE, ["python", *probe], options=["--network", "none"])
    in_image = local_image.run(root_image, probe, options=[*POD_LIKE, "--entrypoint", "python"])
    assert in_base.returncode == 0, _output(in_base)
    assert in_image.returncode == 0, _output(in_image)
    assert in_image.stdout.split() == in_base.stdout.split()


def test_quickstart_trains_and_checkpoints_as_non_root(runner_ready: None, cpu_image: str, tmp_path: Path) -> None:
    spec_text = QUICKSTART.read_text()
    mounts, out = _mounts(tmp_path, spec_text)

    start = time.monotonic()
    proc = local_image.run(cpu_image, [contract.SPEC_PATH, *_sets(FEW_STEPS)], options=[*POD_LIKE, *mounts])
    elapsed = time.monotonic() - start

    assert proc.returncode == contract.EXIT_OK, f"exit {proc.returncode} after {elapsed:.0f} s\n{_output(proc)}"
    records = _metrics(out)
    assert records, f"no records in {contract.METRICS_FILE}; run directory: {sorted(map(str, out.rglob('*')))}"
    last = [r for r in records if r.get("step") == 6 and isinstance(r.get("loss"), float)]
    assert last and math.isfinite(last[0]["loss"]), f"no loss recorded for the last step: {records[-3:]}"
    assert _done_steps(out)[-1:] == [6], f"no complete step-6 checkpoint: {sorted(map(str, out.rglob('*')))}"
    # Everything the runner wrote belongs to the image's user; the spec mount stayed untouched.
    owners = {(p.stat().st_uid, p.stat().st_gid) for p in out.rglob("*")}
    assert owners == {(contract.RUN_AS_UID, contract.RUN_AS_GID)}
    assert (tmp_path / "spec" / contract.SPEC_FILE_NAME).read_text() == spec_text


def test_bad_spec_exits_with_the_config_code(runner_ready: None, cpu_image: str, tmp_path: Path) -> None:
    """podFailurePolicy fails the Job at once on this code: retrying a typo cannot help."""
    mounts, _ = _mounts(tmp_path, QUICKSTART.read_text().replace("training:", "trainig:", 1))
    proc = local_image.run(cpu_image, [contract.SPEC_PATH], options=[*POD_LIKE, *mounts])
    assert proc.returncode == contract.EXIT_CONFIG, _output(proc)
    assert "trainig" in proc.stdout + proc.stderr


def test_sigterm_checkpoints_and_exits_143(runner_ready: None, cpu_image: str, tmp_path: Path) -> None:
    """`podman stop` signals PID 1, which in this image is the runner itself (exec-form ENTRYPOINT)."""
    mounts, out = _mounts(tmp_path, QUICKSTART.read_text())
    long_run = {**FEW_STEPS, "training.steps": "100000", "checkpoints.every_steps": "100000"}
    name = f"jobspec-sigterm-{uuid.uuid4().hex[:8]}"
    started = local_image.podman(
        "run",
        "--detach",
        "--name",
        name,
        "--ulimit",
        "host",
        *POD_LIKE,
        *mounts,
        cpu_image,
        contract.SPEC_PATH,
        *_sets(long_run),
    )
    assert started.returncode == 0, _output(started)
    try:
        deadline = time.monotonic() + 300
        while not _metrics(out) and time.monotonic() < deadline:  # training has begun
            time.sleep(1)
        assert _metrics(out), f"no metrics within 300 s\n{_output(local_image.podman('logs', name))}"
        local_image.podman("stop", "--time", "60", name, timeout=120)
        code = local_image.podman("wait", name).stdout.strip()
        logs = local_image.podman("logs", name)
        assert code == str(contract.EXIT_PREEMPTED), f"exit {code}\n{_output(logs)}"
        assert _done_steps(out), f"no complete checkpoint after SIGTERM: {sorted(map(str, out.rglob('*')))}"
    finally:
        local_image.podman("rm", "--force", name)


def test_end_of_job_benchmarks_run_in_the_image(runner_ready: None, cpu_image: str, tmp_path: Path) -> None:
    """eval.benchmarks in the image (lm-eval is installed there): a local multiple-choice task YAML beside the spec,
    relative to it as the pod's ConfigMap mounts it, runs offline on the job's export; its metrics reach
    metrics.jsonl as eval/<task>/<metric>."""
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["eval"] = {"benchmarks": ["tasks/tiny_mc.yaml"], "limit": 4, "batch_size": 4}
    mounts, out = _mounts(tmp_path, yaml.safe_dump(spec))
    tasks = tmp_path / "spec" / "tasks"
    tasks.mkdir()
    docs = [("2 + 3 =", ["5", "7"], 0), ("The sky is", ["green", "blue"], 1), ("Ice is", ["hot", "cold"], 1),
            ("A cat says", ["meow", "moo"], 0)]  # fmt: skip
    (tasks / "tiny_mc.jsonl").write_text("".join(json.dumps({"q": q, "choices": c, "answer": a}) + "\n"
                                                 for q, c, a in docs))  # fmt: skip
    task = {
        "task": "tiny_mc",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": f"{contract.SPEC_MOUNT_DIR}/tasks/tiny_mc.jsonl"}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{q}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (tasks / "tiny_mc.yaml").write_text(yaml.safe_dump(task, sort_keys=False))

    steps = {**FEW_STEPS, "training.steps": "3", "checkpoints.every_steps": "3"}
    proc = local_image.run(
        cpu_image,
        [contract.SPEC_PATH, *_sets(steps)],
        options=[*POD_LIKE, "--env", "HF_HUB_OFFLINE=1", "--env", "HF_DATASETS_OFFLINE=1", *mounts],
    )
    assert proc.returncode == contract.EXIT_OK, _output(proc)
    bench = [r for r in _metrics(out) if r.get("kind") == "benchmark"]
    assert [r["task"] for r in bench] == ["tiny_mc"], _output(proc)
    rec = bench[0]
    assert rec["step"] == 3 and rec["samples"] == 4
    assert rec["metrics"]["eval/tiny_mc/acc"] in {0.0, 0.25, 0.5, 0.75, 1.0}
    assert "eval/tiny_mc/acc_stderr" in rec["metrics"]
