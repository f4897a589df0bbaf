"""eval.benchmarks' relative task files shipped with a job: the spec ConfigMap carries them beside the spec and the pod
mounts them at the same path relative to it, so the runner in the pod resolves them as on one machine
(jobspec/spec/benchmarks.py ship_task_files, jobspec/render/objects.py, jobspec/render/pod.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import major_minor

from jobspec.contract import EXIT_CONFIG, EXIT_OK, SPEC_FILE_NAME, SPEC_MOUNT_DIR
from jobspec.errors import ConfigError
from jobspec.render import render
from jobspec.spec.benchmarks import MAX_SHIPPED_BYTES
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli
from tests.test_render import K8S_VERSIONS, by_kind, mounts_of

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def task(name: str, data: Path) -> dict[str, Any]:
    return {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}  # fmt: skip


def job_dir(tmp_path: Path, benchmarks: list[str], pad: int = 0) -> Path:
    """A spec file with eval.benchmarks, and a task YAML for each relative .yaml entry (padded by `pad` bytes)."""
    data = tmp_path / "mc.jsonl"
    data.write_text(json.dumps({"q": "2 + 3 =", "choices": ["5", "7"], "answer": 0}) + "\n")
    for entry in benchmarks:
        if entry.endswith(".yaml") and not entry.startswith("/"):
            path = (tmp_path / "spec" / entry).resolve()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(task(path.stem, data), sort_keys=False) + "#" * pad + "\n")
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["eval"] = {"benchmarks": benchmarks, "limit": 1}
    (tmp_path / "spec").mkdir(exist_ok=True)
    (tmp_path / "spec" / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tmp_path / "spec" / "job.yaml"


def rendered(spec_file: Path) -> dict[str, dict[str, Any]]:
    code, out = cli("render", str(spec_file))
    assert code == EXIT_OK, out
    text = "\n".join(line for line in out.splitlines() if not line.startswith("warning: "))  # stderr's notes
    return by_kind([o for o in yaml.safe_load_all(text) if o])


def project(configmap: dict[str, Any], volume: dict[str, Any], into: Path) -> Path:
    """What the kubelet makes of a configMap volume with items: each key's text at its path under the mount."""
    for item in volume["configMap"]["items"]:
        (into / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (into / item["path"]).write_text(configmap["data"][item["key"]])
    return into / SPEC_FILE_NAME


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_relative_task_files_ride_in_the_configmap_and_mount_beside_the_spec(tmp_path: Path, version: str) -> None:
    spec_file = job_dir(tmp_path, ["tasks/mc.yaml", "arc_easy", "./tasks/mc.yaml", "top.yaml", "/abs/pod.yaml"])
    objs = rendered(spec_file)
    configmap, volume = objs["ConfigMap"], mounts_of(objs)[SPEC_MOUNT_DIR]
    for obj in objs.values():
        assert kubernetes_validate.validate(obj, version, strict=True) == major_minor(version)
    # once each (./tasks/mc.yaml is tasks/mc.yaml); the absolute one is the pod's own, not shipped
    assert volume["configMap"]["items"] == [{"key": SPEC_FILE_NAME, "path": SPEC_FILE_NAME},
                                            {"key": "task-0-mc.yaml", "path": "tasks/mc.yaml"},
                                            {"key": "task-1-top.yaml", "path": "top.yaml"}]  # fmt: skip
    assert configmap["data"]["task-0-mc.yaml"] == (spec_file.parent / "tasks" / "mc.yaml").read_text()
    assert set(configmap["data"]) == {SPEC_FILE_NAME, "task-0-mc.yaml", "task-1-top.yaml"}


def test_the_runner_builds_the_shipped_tasks_from_the_projected_mount(tmp_path: Path) -> None:
    """The runner's own pre-training check (lm-eval builds each task) on the files as the pod sees them."""
    pytest.importorskip("lm_eval")
    from runner.process.worker import check_benchmarks

    spec_file = job_dir(tmp_path, ["tasks/mc.yaml", "top.yaml"])
    objs = rendered(spec_file)
    mount = tmp_path / "pod-etc-jobspec"
    pod_spec_file = project(objs["ConfigMap"], mounts_of(objs)[SPEC_MOUNT_DIR], mount)
    (spec_file.parent / "tasks" / "mc.yaml").unlink()  # the pod has only what the ConfigMap carried
    spec = load_spec(pod_spec_file)
    check_benchmarks(spec, pod_spec_file.parent)  # raises ConfigError if a task cannot be found or built
    with pytest.raises(ConfigError, match=r"eval.benchmarks\[0\] tasks/mc.yaml"):
        check_benchmarks(spec, spec_file.parent)  # and without the mount it would not be there


def test_a_spec_without_task_files_renders_the_plain_spec_volume(tmp_path: Path) -> None:
    objs = rendered(job_dir(tmp_path, ["arc_easy"]))
    assert "items" not in mounts_of(objs)[SPEC_MOUNT_DIR]["configMap"]
    assert set(objs["ConfigMap"]["data"]) == {SPEC_FILE_NAME}


def test_render_without_the_task_files_text_is_a_config_error(tmp_path: Path) -> None:
    spec = load_spec(job_dir(tmp_path, ["tasks/mc.yaml"]))
    with pytest.raises(ConfigError, match=r"tasks/mc\.yaml is a task file relative to the spec file"):
        render(spec)


@pytest.mark.parametrize("command", ["validate", "render"])
def test_a_task_file_above_the_spec_directory_exits_2_naming_field_and_file(tmp_path: Path, command: str) -> None:
    spec_file = job_dir(tmp_path, ["arc_easy", "../up.yaml"])
    assert (tmp_path / "up.yaml").is_file()  # it exists: only the pod could not see it
    code, out = cli(command, str(spec_file))
    assert code == EXIT_CONFIG, out
    assert "eval.benchmarks[1] ../up.yaml" in out and "under the spec file's directory" in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize("command", ["validate", "render"])
def test_task_files_over_the_configmap_bound_exit_2_naming_the_one_that_tips_it(tmp_path: Path, command: str) -> None:
    spec_file = job_dir(tmp_path, ["a.yaml", "b.yaml"], pad=MAX_SHIPPED_BYTES // 2 + 1)
    code, out = cli(command, str(spec_file))
    assert code == EXIT_CONFIG, out
    assert "eval.benchmarks[1] b.yaml" in out and f"{MAX_SHIPPED_BYTES:,} allowed" in out, out


def test_a_missing_relative_task_file_fails_render_naming_it(tmp_path: Path) -> None:
    spec_file = job_dir(tmp_path, ["tasks/mc.yaml"])
    (spec_file.parent / "tasks" / "mc.yaml").unlink()
    code, out = cli("render", str(spec_file))
    assert code == EXIT_CONFIG, out
    assert "eval.benchmarks[0] tasks/mc.yaml" in out and "no such file" in out, out


def test_an_edited_task_file_changes_the_jobs_spec_hash(tmp_path: Path) -> None:
    """`jobspec submit` compares the Job's spec-hash to decide "unchanged" (apply nothing): a task file edited beside
    an unchanged spec must change it, in the Job's and its pods' annotations and in the container's env alike."""
    from jobspec.contract import ANNOTATION_SPEC_HASH
    from jobspec.render import ENV_SPEC_HASH

    spec_file = job_dir(tmp_path, ["tasks/mc.yaml"])

    def hashes() -> set[str]:
        job = rendered(spec_file)["Job"]
        pod = job["spec"]["template"]
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        return {job["metadata"]["annotations"][ANNOTATION_SPEC_HASH], pod["metadata"]["annotations"][
            ANNOTATION_SPEC_HASH], env[ENV_SPEC_HASH]}  # fmt: skip

    before = hashes()
    assert len(before) == 1 and before != {load_spec(spec_file).spec_hash()}
    task_file = spec_file.parent / "tasks" / "mc.yaml"
    task_file.write_text(task_file.read_text() + "# edited\n")
    after = hashes()
    assert len(after) == 1 and after != before
    assert hashes() == after  # the same files, the same hash


@pytest.mark.parametrize("how", ["file", "directory"])
def test_a_task_file_linked_from_outside_the_spec_directory_is_not_shipped(tmp_path: Path, how: str) -> None:
    """A link (or a linked directory) under the spec's folder pointing out of it: render refuses it (exit 2, the
    entry named) instead of copying the outside file into the ConfigMap."""
    spec_file = job_dir(tmp_path, ["tasks/mc.yaml"])
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "mc.yaml"
    secret.write_text((spec_file.parent / "tasks" / "mc.yaml").read_text() + "# someone else's file\n")
    tasks = spec_file.parent / "tasks"
    if how == "file":
        (tasks / "mc.yaml").unlink()
        (tasks / "mc.yaml").symlink_to(secret)
    else:
        (tasks / "mc.yaml").unlink()
        tasks.rmdir()
        tasks.symlink_to(outside, target_is_directory=True)
    code, out = cli("render", str(spec_file))
    assert code == EXIT_CONFIG and "eval.benchmarks[0]" in out and "outside" in out, out
    assert "someone else's file" not in out


@pytest.mark.parametrize("secret", [
    "  token: hf_abcdefghijklmnopqrstuvwxyzABCDEF12\n",  # under a secret-like key
    "  hub: https://user:hunter2pass@huggingface.co/datasets/x\n",  # a URL with a password, anywhere
])  # fmt: skip
def test_a_credential_in_a_task_file_is_refused_without_echo(tmp_path: Path, secret: str) -> None:
    spec_file = job_dir(tmp_path, ["tasks/mc.yaml"])
    path = spec_file.parent / "tasks" / "mc.yaml"
    path.write_text(path.read_text().replace("dataset_kwargs:\n", "dataset_kwargs:\n" + secret, 1))
    assert "hunter2pass" in path.read_text() or "hf_abc" in path.read_text()
    for command in ("render", "validate"):
        code, out = cli(command, str(spec_file))
        assert code == EXIT_CONFIG and "credential" in out and "eval.benchmarks[0]" in out, out
        assert "hunter2" not in out and "hf_abcdefg" not in out, out
