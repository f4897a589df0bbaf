"""`jobspec image build | push | show` (issue 43): the project's Dockerfiles built with the engine on PATH, tagged by
version and content, pushed, the digest recorded and pinned by `render`. The engine is the boundary: a fake `docker`
(or `podman`) on PATH records what it was asked and answers as the real one does (RepoDigests after a push; podman's
--digestfile). tests/container/ builds the Dockerfiles with a real podman."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import yaml

from jobspec import __version__
from jobspec.image import context, record
from tests.cli_helpers import cli

REPO = Path(__file__).resolve().parents[1]
DIGEST = "sha256:" + "ab" * 32
FAKE = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_ENGINE_LOG"], "a") as log:
    log.write(json.dumps([os.path.basename(sys.argv[0])] + args) + "\\n")
if os.environ.get("FAKE_ENGINE_FAIL") and args[0] == os.environ["FAKE_ENGINE_FAIL"]:
    print("denied: requested access to the resource is denied", file=sys.stderr)
    sys.exit(1)
if args[:2] == ["image", "inspect"]:
    repo = args[-1].rpartition(":")[0]
    print(json.dumps([repo + "@" + os.environ["FAKE_DIGEST"]]))
if args[0] == "push" and "--digestfile" in args:
    open(args[args.index("--digestfile") + 1], "w").write(os.environ["FAKE_DIGEST"])
"""


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake docker and podman on PATH (nothing else of the machine's); their calls in the returned log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("docker", "podman"):
        (bin_dir / name).write_text(FAKE.replace("{python}", sys.executable))
        (bin_dir / name).chmod(0o755)
    for tool in ("git",):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    log = tmp_path / "engine.log"
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_ENGINE_LOG", str(log))
    monkeypatch.setenv("FAKE_DIGEST", DIGEST)
    monkeypatch.setenv("JOBSPEC_IMAGES", str(tmp_path / "config" / "images.json"))
    return log


def job_of(out: str) -> dict:
    """The Job of `render`'s stdout, its stderr lines (warning: ...) left out."""
    text = "\n".join(line for line in out.splitlines() if not line.startswith("warning: "))
    return next(d for d in yaml.safe_load_all(text) if d and d.get("kind") == "Job")


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_build_tags_by_version_and_content_from_each_dockerfile(engine: Path) -> None:
    mirror = "PIP_INDEX_URL=https://user:s3cret@mirror/simple"
    code, said = cli("image", "build", "--vendor", "cuda,cpu", "--repository", "ghcr.io/me/runner",
                     "--source", str(REPO), "--build-arg", mirror)  # fmt: skip
    assert code == 0, said
    builds = [c for c in calls(engine) if c[1] == "build"]
    assert [c[0] for c in builds] == ["docker", "docker"]  # docker first when both are there
    content = {}
    for call, vendor, dockerfile in zip(builds, ("cuda", "cpu"), ("Dockerfile", "images/Dockerfile.cpu"), strict=True):
        assert call[call.index("-f") + 1] == str(REPO / dockerfile) and call[-1] == str(REPO)
        tags = [call[i + 1] for i, a in enumerate(call) if a == "-t"]
        assert tags[0] == f"ghcr.io/me/runner:{__version__}-{vendor}"
        assert tags[1].startswith(tags[0] + "-") and len(tags[1]) == len(tags[0]) + 1 + context.CONTENT_CHARS
        content[vendor] = tags[1]
        assert f"VERSION={__version__}" in call and "PIP_INDEX_URL=https://user:s3cret@mirror/simple" in call
        assert f"{vendor}: {tags[0]}, {tags[1]}" in said
    assert "s3cret" not in said and "PIP_INDEX_URL=..." in said  # the command is shown, a build-arg's value never
    assert content["cuda"].rsplit("-", 1)[1] != content["cpu"].rsplit("-", 1)[1]  # the Dockerfile is in the hash


def test_the_content_tag_follows_what_the_image_holds(tmp_path: Path) -> None:
    root = tmp_path / "src"
    for rel in ("Dockerfile", "pyproject.toml", ".dockerignore", "jobspec/a.py", "runner/b.py", "tests/t.py",
                "images/jobspec-image.sh", "runner/__pycache__/b.cpython-311.pyc"):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((REPO / ".dockerignore").read_text() if rel == ".dockerignore" else rel)
    files = list(context.context_files(root))
    assert files == ["images/jobspec-image.sh", "jobspec/a.py", "pyproject.toml", "runner/b.py"]
    first = context.plan_build(root, "cuda", "r/x", {}).content
    (root / "tests" / "t.py").write_text("outside the context")
    assert context.plan_build(root, "cuda", "r/x", {}).content == first
    (root / "runner" / "b.py").write_text("changed")
    changed = context.plan_build(root, "cuda", "r/x", {}).content
    assert changed != first
    assert context.plan_build(root, "cuda", "r/x", {"BASE_IMAGE": "other"}).content != changed


@pytest.mark.parametrize("name", ["docker", "podman"])
def test_push_records_the_digest_and_render_pins_it(engine: Path, tmp_path: Path, name: str) -> None:
    if name == "podman":
        (tmp_path / "bin" / "docker").unlink()
    code, said = cli("image", "push", "--repository", "registry.example.com:5000/team/runner", "--vendor", "cuda",
                     "--source", str(REPO))  # fmt: skip
    assert code == 0, said
    pushes = [c for c in calls(engine) if c[1] == "push"]
    assert len(pushes) == 2 and all(c[0] == name for c in pushes)
    content_tag = pushes[0][-1]
    assert content_tag.startswith(f"registry.example.com:5000/team/runner:{__version__}-cuda-")
    assert pushes[1][-1] == f"registry.example.com:5000/team/runner:{__version__}-cuda"
    saved = json.loads((tmp_path / "config" / "images.json").read_text())
    assert saved["images"]["cuda"]["reference"] == f"{content_tag}@{DIGEST}"
    assert stat.S_IMODE(os.stat(tmp_path / "config" / "images.json").st_mode) == 0o600
    code, out = cli("render", str(REPO / "examples" / "sft_fast.yaml"))
    assert code == 0, out
    job = job_of(out)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == (f"{content_tag}@{DIGEST}", "IfNotPresent")
    assert "not publish" not in out
    code, out = cli("image", "show")
    assert code == 0 and f"cuda: {content_tag}@{DIGEST}" in out and f"cpu: {context.default_image('cpu')}" in out


def test_nothing_built_renders_the_default_tag_pulled_always_and_says_what_to_do(engine: Path) -> None:
    code, out = cli("render", str(REPO / "examples" / "sft_fast.yaml"))
    assert code == 0
    job = job_of(out)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert (container["image"], container["imagePullPolicy"]) == (context.default_image("cuda"), "Always")
    assert "jobspec image push --repository REGISTRY/NAME --vendor cuda" in out
    code, said = cli("validate", str(REPO / "examples" / "sft_fast.yaml"))
    assert code == 0 and "image.name is not set and no cuda image was pushed from here" in said
    code, said = cli("validate", str(REPO / "examples" / "quickstart.yaml"))  # a CPU spec runs here: no image
    assert code == 0 and "image push" not in said
    code, said = cli("validate", str(REPO / "examples" / "sft_fast.yaml"), "--set", f"image.name=me/t:1@{DIGEST}")
    assert code == 0 and "image push" not in said


def test_a_record_from_another_version_or_tampered_is_not_used(engine: Path, tmp_path: Path) -> None:
    path = tmp_path / "config" / "images.json"
    path.parent.mkdir(parents=True)
    other = {"version": 1, "images": {"cuda": {"reference": f"me/r:0.0.1-cuda@{DIGEST}", "jobspec": "0.0.1"},
                                      "cpu": {"reference": "me/r:latest", "jobspec": __version__}}}  # fmt: skip
    path.write_text(json.dumps(other))
    assert record.pinned_image("cuda") is None and record.pinned_image("cpu") is None
    for garbage in ('{"version": 1, "images": [', '"\\"' * 40_000, json.dumps({"version": 9})):
        path.write_text(garbage)
        assert record.read_record() == {}
    path.unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"version": 1, "images": {"cuda": {"reference": f"me/r:1@{DIGEST}",
                                                                      "jobspec": __version__}}}))  # fmt: skip
    path.symlink_to(elsewhere)
    assert record.read_record() == {}  # a link is not followed
    record.record_pushed("cpu", f"me/r:1-cpu@{DIGEST}", "c" * 64)  # the link is replaced, never written through
    assert not path.is_symlink() and "cpu" not in elsewhere.read_text()
    assert record.pinned_image("cpu") == f"me/r:1-cpu@{DIGEST}"


def test_bad_input_and_a_failed_push_exit_with_what_to_do(engine: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    code, said = cli("image", "push", "--vendor", "cuda")
    assert code == 2 and "--repository" in said
    code, said = cli("image", "build", "--vendor", "tpu", "--source", str(REPO))
    assert code == 2 and "expected cuda, rocm, cpu" in said
    code, said = cli("image", "build", "--repository", "Ghcr.io/Me Runner", "--source", str(REPO))
    assert code == 2 and "not an image repository" in said
    code, said = cli("image", "build", "--source", str(tmp_path))
    assert code == 2 and "not a jobspec source checkout" in said
    code, said = cli("image", "build", "--source", str(REPO), "--build-arg", "hf_abcdefghijklmnopqrstuvwxyz0123")
    assert code == 2 and "hf_abc" not in said
    monkeypatch.setenv("FAKE_ENGINE_FAIL", "push")
    code, said = cli("image", "push", "--repository", "ghcr.io/me/runner", "--source", str(REPO))
    assert code == 1 and "docker login ghcr.io" in said and "Traceback" not in said
    assert not (tmp_path / "config" / "images.json").exists()
    for name in ("docker", "podman"):
        (tmp_path / "bin" / name).unlink()
    code, said = cli("image", "build", "--source", str(REPO))
    assert code == 2 and "no docker or podman on PATH" in said
