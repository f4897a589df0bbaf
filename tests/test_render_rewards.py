"""GRPO's Python reward files shipped with a job as eval.benchmarks' task files are: the spec ConfigMap carries a
relative one beside the spec and the pod mounts it at the same relative path, where the runner loads it; one that
would leave the spec's directory, is missing, is not Python or holds a credential exits 2 naming its field, on the
submitting machine (jobspec/spec/benchmarks.py reward_file_problem, shipped_entries)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from jobspec.contract import EXIT_CONFIG, SPEC_MOUNT_DIR
from jobspec.errors import ConfigError
from jobspec.render import render
from jobspec.spec.loader import load_spec
from tests.cli_helpers import cli
from tests.test_render import mounts_of
from tests.test_render_tasks import QUICKSTART, project, rendered

REWARD = "def reward(completions, **kw):\n    return [float(len(c) > 3) for c in completions]\n"


def job_dir(tmp_path: Path, files: dict[str, str], rewards: list[dict[str, Any]]) -> Path:
    """A GRPO spec file in tmp_path/spec with `files` (relative path -> text) written beside it."""
    spec_dir = tmp_path / "spec"
    for name, text in files.items():
        (spec_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (spec_dir / name).write_text(text)
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["training"] |= {"objective": "grpo", "grpo": {"max_completion_length": 64, "rewards": rewards}}
    spec_dir.mkdir(exist_ok=True)
    (spec_dir / "job.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return spec_dir / "job.yaml"


def test_a_relative_reward_file_rides_in_the_configmap_and_the_runner_loads_it_from_the_mount(tmp_path: Path) -> None:
    from runner.rl.rewards import Rewards

    spec_file = job_dir(tmp_path, {"rl/rewards.py": REWARD},
                        [{"kind": "python", "file": "rl/rewards.py"}, {"kind": "format"},
                         {"kind": "python", "file": "/opt/image/other.py", "function": "other"}])  # fmt: skip
    objs = rendered(spec_file)
    volume = mounts_of(objs)[SPEC_MOUNT_DIR]
    assert {"key": "task-0-rewards.py", "path": "rl/rewards.py"} in volume["configMap"]["items"]
    assert objs["ConfigMap"]["data"]["task-0-rewards.py"] == REWARD
    mount = tmp_path / "pod-etc-jobspec"
    pod_spec = load_spec(project(objs["ConfigMap"], volume, mount))
    (spec_file.parent / "rl" / "rewards.py").unlink()  # the pod has only what the ConfigMap carried
    first = pod_spec.training.grpo.rewards[:1]
    assert Rewards(first, mount, 64).score(["p"], ["abcd"], [[1]], [{}]).tolist() == [[1.0]]
    with pytest.raises(ConfigError, match=r"training.grpo.rewards\[0\].file rl/rewards.py"):
        Rewards(first, spec_file.parent, 64)


def test_render_without_the_reward_files_text_is_a_config_error(tmp_path: Path) -> None:
    spec = load_spec(job_dir(tmp_path, {"r.py": REWARD}, [{"kind": "python", "file": "r.py"}]))
    with pytest.raises(ConfigError, match=r"training.grpo.rewards: r\.py is a file relative to the spec file"):
        render(spec)


@pytest.mark.parametrize(
    ("files", "entry", "message"),
    [({}, "../up.py", "under the spec file's directory"), ({}, "absent.py", "no such file"),
     ({"bad.py": "def reward(:\n"}, "bad.py", "line 1: not Python"),
     ({"key.py": "TOKEN = 'hf_abcdefghijklmnopqrstuvwxyzABCDEF12'\n" + REWARD}, "key.py", "line 1 holds a credential")],
    ids=["outside", "missing", "syntax", "credential"],
)  # fmt: skip
@pytest.mark.parametrize("command", ["validate", "render"])
def test_a_reward_file_the_job_cannot_carry_exits_2_naming_field_and_file(tmp_path: Path, command: str,
                                                                          files: dict[str, str], entry: str,
                                                                          message: str) -> None:  # fmt: skip
    (tmp_path / "up.py").write_text(REWARD)  # it exists: only the pod could not see it
    spec_file = job_dir(tmp_path, files, [{"kind": "accuracy"}, {"kind": "python", "file": entry}])
    code, out = cli(command, str(spec_file))
    assert code == EXIT_CONFIG, out
    assert f"training.grpo.rewards[1].file {entry}" in out and message in out, out
    assert "Traceback" not in out and "hf_abc" not in out
