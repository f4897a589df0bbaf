"""docker or podman: build an image with both its tags, push them, and read the digest the registry gave.

The engine's own output goes to the terminal as it comes (a build takes minutes); what jobspec prints of a command
never shows a build argument's value (a PIP_INDEX_URL may hold a password). A failed build or push exits 1 (the
network, the registry, a login: another attempt may pass); an engine that is missing, or an argument that is wrong,
exits 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jobspec.errors import ConfigError, JobspecError
from jobspec.image.context import Build

ENGINES = ("docker", "podman")
INSPECT_TIMEOUT_S = 60


class ImageBuildFailed(JobspecError):
    """docker/podman build or push failed (exit 1: the registry, the network or a login may be fixed and tried
    again)."""


@dataclass(frozen=True)
class Engine:
    name: str  # docker | podman
    path: str


def find_engine(wanted: str | None) -> Engine:
    """The engine named (--engine), else docker, else podman, from PATH; ConfigError (exit 2) when none is there."""
    for name in [wanted] if wanted else ENGINES:
        path = shutil.which(name)
        if path:
            return Engine(name, path)
    which = wanted or "docker or podman"
    raise ConfigError(f"no {which} on PATH: `jobspec image` builds with a container engine; install Docker or "
                      "podman (or pass --engine), or build by hand with the commands in images/README.md")  # fmt: skip


def shown(argv: Sequence[str]) -> str:
    """The command as jobspec prints it: each --build-arg's value hidden."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append(arg.partition("=")[0] + "=...")
        else:
            out.append(arg)
        hide = arg == "--build-arg"
    return " ".join(out)


def _run(engine: Engine, argv: list[str], what: str, hint: str) -> None:
    print(f"$ {shown([engine.name, *argv])}", file=sys.stderr, flush=True)
    try:
        done = subprocess.run([engine.path, *argv], check=False)
    except OSError as err:
        raise ConfigError(f"{engine.name} could not be started ({err.strerror or err})") from None
    if done.returncode != 0:
        raise ImageBuildFailed(f"{engine.name} {what} failed (exit {done.returncode}, its output is above): {hint}")


def build(engine: Engine, root: Path, plan: Build, build_args: Mapping[str, str], revision: str) -> None:
    """Build `plan`'s Dockerfile from `root` with both tags."""
    from jobspec import __version__

    argv = ["build", "-f", str(plan.dockerfile), "-t", plan.version_tag, "-t", plan.content_tag,
            "--build-arg", f"VERSION={__version__}", "--build-arg", f"REVISION={revision}"]  # fmt: skip
    for key in sorted(build_args):
        argv += ["--build-arg", f"{key}={build_args[key]}"]
    _run(engine, [*argv, str(root)], f"build of the {plan.vendor} image",
         "fix what it says (a base image it cannot pull: --build-arg BASE_IMAGE=...), then build again")  # fmt: skip


def push(engine: Engine, plan: Build) -> str:
    """Push both tags; the digest (sha256:...) the registry stored for the content tag."""
    registry = plan.content_tag.split("/", 1)[0]
    hint = f"log in first (`{engine.name} login {registry}`) and check the repository exists and you may push to it"
    digest_file = None
    if engine.name == "podman":
        handle, digest_file = tempfile.mkstemp(prefix="jobspec-digest-")
        os.close(handle)
    try:
        extra = ["--digestfile", digest_file] if digest_file else []
        _run(engine, ["push", *extra, plan.content_tag], f"push of {plan.content_tag}", hint)
        _run(engine, ["push", plan.version_tag], f"push of {plan.version_tag}", hint)
        if digest_file:
            digest = Path(digest_file).read_text(encoding="utf-8", errors="replace").strip()[:80]
        else:
            digest = _repo_digest(engine, plan.content_tag)
    finally:
        if digest_file:
            Path(digest_file).unlink(missing_ok=True)
    if not (digest.startswith("sha256:") and len(digest) == 71 and all(c in "0123456789abcdef" for c in digest[7:])):
        raise ImageBuildFailed(f"{engine.name} pushed {plan.content_tag} but gave no sha256 digest for it: pin it by "
                               f"hand (`crane digest {plan.content_tag}`) in image.name")  # fmt: skip
    return digest


def _repo_digest(engine: Engine, tag: str) -> str:
    """The digest docker recorded for `tag`'s repository after the push (`RepoDigests`: repo@sha256:...)."""
    repository = tag.rpartition(":")[0]
    done = subprocess.run([engine.path, "image", "inspect", "--format", "{{json .RepoDigests}}", tag],
                          capture_output=True, text=True, timeout=INSPECT_TIMEOUT_S, check=False)  # fmt: skip
    try:
        digests = json.loads(done.stdout or "null") if done.returncode == 0 else None
    except ValueError:
        digests = None
    for entry in digests if isinstance(digests, list) else []:
        if isinstance(entry, str) and entry.partition("@")[0] == repository:
            return entry.partition("@")[2]
    return ""
