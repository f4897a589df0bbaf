"""One spec from the laptop to the cluster (issue 43, item 7): `init --gpus cpu:N` writes a spec `jobspec run` runs
here; a local run reads relative paths from the spec's folder and writes under runs/<name> unless the spec says
otherwise, and says where; the pod reads the same relative paths from its working directory (the rendered objects
keep them as written), and `validate`/`render` warn when a cluster spec names a path only this machine has."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import yaml

from jobspec.contract import SPEC_PATH, WORKDIR
from jobspec.local_paths import cluster_warnings, run_overrides
from jobspec.render import render
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli

CPU_SPEC = """name: laptop
model: {preset: tiny}
data:
  path: data/train.jsonl
  eval_path: data/eval.jsonl
  max_seq_len: 64
training: {global_batch: 4, steps: 2}
hardware: {vendor: cpu, gpus: 1}
"""


def spec_in(folder: Path, text: str = CPU_SPEC) -> Path:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "eval.jsonl"):
        (folder / "data" / name).write_text('{"prompt": "a", "response": "b"}\n' * 8)
    path = folder / "spec.yaml"
    path.write_text(text)
    return path


def overrides_as_dict(items: list[str]) -> dict[str, object]:
    return {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in items)}


def test_init_writes_a_cpu_spec_for_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for gpus, processes in (("cpu:1", 1), ("cpu:2", 2)):
        code, said = cli("init", "--model", "tiny", "--gpus", gpus, "--data", "train.jsonl", "-o", f"{processes}.yaml")
        assert code == 0, said
        spec = load_spec(tmp_path / f"{processes}.yaml")
        assert (spec.hardware.vendor, spec.world_size, spec.checkpoints.pvc) == ("cpu", processes, None)
        assert cli("validate", f"{processes}.yaml")[0] == 0
        text = (tmp_path / f"{processes}.yaml").read_text()  # its comments speak of this machine, not of a GPU
        assert "on the GPU" not in text and "a GPU" not in text and "GiB a process" in text, text


def test_a_local_run_reads_relative_paths_from_the_spec_folder(tmp_path: Path) -> None:
    spec_file = spec_in(tmp_path / "project", CPU_SPEC + "checkpoints: {dir: out/run}\noutput: {dir: out/model}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    items, said = run_overrides(spec_file, load_spec(spec_file), cwd=elsewhere)
    got = overrides_as_dict(items)
    base = spec_file.parent.resolve()
    assert got == {"data.path": str(base / "data/train.jsonl"), "data.eval_path": str(base / "data/eval.jsonl"),
                   "checkpoints.dir": str(base / "out/run"), "output.dir": str(base / "out/model")}  # fmt: skip
    assert said == []  # the spec chose its run directory
    spec = load_spec(spec_file, items)  # what the runner loads: the same spec, absolute paths
    assert Path(spec.data.path).is_file() and spec.checkpoints.dir == str(base / "out/run")
    typed = ["checkpoints.dir=mine"]  # a path typed on the command line: from the working directory
    items, _ = run_overrides(spec_file, load_spec(spec_file, typed), typed, cwd=elsewhere)
    assert overrides_as_dict(items)["checkpoints.dir"] == str(elsewhere.resolve() / "mine")


def test_a_local_run_writes_under_runs_name_and_says_where(tmp_path: Path) -> None:
    spec_file = spec_in(tmp_path)
    items, said = run_overrides(spec_file, load_spec(spec_file), cwd=tmp_path)
    run_dir = str(tmp_path.resolve() / "runs" / "laptop")
    assert overrides_as_dict(items)["checkpoints.dir"] == run_dir  # not /checkpoints
    assert len(said) == 1 and str(tmp_path / "runs" / "laptop") in said[0]
    claim = spec_in(tmp_path / "c", CPU_SPEC + "checkpoints: {pvc: shared}\n")  # the pod's volume, not this machine's
    got = overrides_as_dict(run_overrides(claim, load_spec(claim), cwd=tmp_path)[0])
    assert got["checkpoints.dir"] == str(tmp_path / "runs" / "laptop") and got["checkpoints.pvc"] is None
    bucket = spec_in(tmp_path / "b", CPU_SPEC + "checkpoints: {dir: 's3://bucket/runs/laptop'}\n")
    got = overrides_as_dict(run_overrides(bucket, load_spec(bucket), cwd=tmp_path)[0])
    assert got["checkpoints.local_dir"] == str(tmp_path / "runs" / "laptop") and "checkpoints.dir" not in got


def test_jobspec_run_hands_the_runner_absolute_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec_file = spec_in(tmp_path / "project")
    monkeypatch.chdir(tmp_path)
    seen: list[list[str]] = []

    def execv(_exe: str, argv: list[str]) -> None:
        seen.append(argv)
        raise SystemExit(0)

    monkeypatch.setattr(os, "execv", execv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        from jobspec.cli import main

        main(["run", "project/spec.yaml", "--set", "training.steps=3"])
    argv = seen[0]
    sets = [argv[i + 1] for i, a in enumerate(argv) if a == "--set"]
    assert sets[0] == "training.steps=3"  # the user's first; the absolute paths after them
    assert f"data.path={json.dumps(str(spec_file.parent.resolve() / 'data/train.jsonl'))}" in sets
    assert f"this run's files go to {tmp_path / 'runs' / 'laptop'}" in err.getvalue()


def test_the_pod_reads_relative_paths_from_its_working_directory(tmp_path: Path) -> None:
    """The other side of the contract: render leaves the paths as written, the runner starts in WORKDIR on the
    mounted spec, and nothing rewrites a path for the pod."""
    spec_file = spec_in(tmp_path, CPU_SPEC.replace("vendor: cpu, gpus: 1", "vendor: cuda, gpus: A10G:1"))
    objects = render(load_spec(spec_file))
    job = next(o for o in objects if o["kind"] == "Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["workingDir"] == WORKDIR
    argv = container.get("command", []) + container.get("args", [])
    assert SPEC_PATH in argv and not [a for a in argv if "data.path" in a or "--set" in a]
    shipped = next(o for o in objects if o["kind"] == "ConfigMap")
    assert "path: data/train.jsonl" in next(iter(shipped["data"].values()))  # as written: /workspace/data/...


def test_validate_and_render_warn_of_paths_only_this_machine_has(tmp_path: Path) -> None:
    cluster = CPU_SPEC.replace("vendor: cpu, gpus: 1", "vendor: cuda, gpus: A10G:1")
    spec_file = spec_in(tmp_path, cluster)
    warnings = cluster_warnings(spec_file, load_spec(spec_file))
    assert len(warnings) == 2 and all(f"{WORKDIR}/data/" in w and "this machine only" in w for w in warnings)
    code, said = cli("validate", str(spec_file))
    assert code == 0 and "data.path 'data/train.jsonl' is relative: the pod reads /workspace/data/train.jsonl" in said
    code, said = cli("render", str(spec_file))
    assert code == 0 and "warning: data.eval_path 'data/eval.jsonl' is relative" in said
    absolute = spec_in(tmp_path / "abs", cluster.replace("data/train.jsonl", str(tmp_path / "data/train.jsonl")))
    assert any("exists on this machine" in w for w in cluster_warnings(absolute, load_spec(absolute)))
    remote = cluster.replace("data/train.jsonl", "s3://bucket/train.jsonl").replace("data/eval.jsonl", "org/evalset")
    quiet = spec_in(tmp_path / "remote", remote + "checkpoints: {pvc: runs}\n")
    assert cluster_warnings(quiet, load_spec(quiet)) == []  # a URL, a hub id and the claim's mount are the pod's
    code, said = cli("validate", str(spec_in(tmp_path / "cpu")))  # a CPU spec runs here: no warning
    assert code == 0 and "relative" not in said


def test_plan_and_validate_read_the_spec_folder_from_anywhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan` counted a relative data.path from the working directory: from elsewhere it knew no rows (no steps for
    an epochs spec); it reads them from the spec's folder, as `run` does, and so does validate's model check."""
    spec_file = spec_in(tmp_path / "project", CPU_SPEC.replace("steps: 2", "epochs: 1"))
    (spec_file.parent / "data" / "train.jsonl").write_text('{"prompt": "a", "response": "b"}\n' * 40)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, said = cli("plan", str(spec_file), "--gpu-memory", "24Gi", "-o", "json")
    assert code == 0, said
    assert json.loads(said[said.index("{"):])["steps"] == 40 // 4
    model = spec_file.parent / "my-model"  # a local model beside the spec: its config.json is read, not skipped
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "no_such_family", "num_hidden_layers": 2}))
    spec_file.write_text(spec_file.read_text().replace("model: {preset: tiny}", "model: {path: my-model}"))
    code, said = cli("validate", str(spec_file))
    assert code == 2 and "no_such_family" in said, said
