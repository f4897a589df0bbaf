"""What an image is built from: the source checkout, each vendor's Dockerfile, the content hash, the tags.

The content hash covers what the build can see: the files of the build context (the `.dockerignore` allowlist of
the checkout: `*` then `!name` lines, with `**/pattern` exclusions), the Dockerfile and the build arguments. Two
builds of the same tree and arguments get the same content tag; a change to any file the image holds gets another.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from jobspec import __version__
from jobspec.errors import ConfigError

VENDORS = ("cuda", "rocm", "cpu")
DOCKERFILES = {"cuda": "Dockerfile", "rocm": "images/Dockerfile.rocm", "cpu": "images/Dockerfile.cpu"}
DEFAULT_REPOSITORY = "ghcr.io/jobspec/runner"  # the tags the Dockerfiles' comments and images/README.md give
CONTENT_CHARS = 12  # hex digits of the content hash in a tag
MAX_CONTEXT_FILES = 20_000  # a context this large is not the project's: refused rather than hashed for minutes


def default_image(vendor: str) -> str:
    """`ghcr.io/jobspec/runner:<version>-<vendor>`: the tag `build` gives by default, not one this release publishes."""
    return f"{DEFAULT_REPOSITORY}:{__version__}-{vendor}"


@dataclass(frozen=True)
class Build:
    """One image to build: the vendor, its Dockerfile, and its two tags."""

    vendor: str
    dockerfile: Path
    version_tag: str  # <repo>:<version>-<vendor>
    content_tag: str  # <repo>:<version>-<vendor>-<content>
    content: str  # the full sha256 hex of the context, Dockerfile and arguments


def source_checkout(given: str | None) -> Path:
    """The jobspec source tree to build from: `given` (--source), else the checkout this jobspec runs from (an
    editable install), else the working directory. ConfigError (exit 2) when it holds no Dockerfile."""
    candidates = [Path(given)] if given else [Path(__file__).resolve().parents[2], Path.cwd()]
    for folder in candidates:
        if (folder / "Dockerfile").is_file() and (folder / "pyproject.toml").is_file() and (folder / "runner").is_dir():
            return folder.resolve()
    where = f"--source {given}" if given else "this jobspec's install and the working directory"
    raise ConfigError(
        f"{where}: not a jobspec source checkout (no Dockerfile, pyproject.toml and runner/ there). The images are "
        "built from the project's own Dockerfiles: `git clone` the project and run `jobspec image build` in it, or "
        "pass --source DIR"
    )


def _allowlist(root: Path) -> tuple[list[str], list[str]] | None:
    """(included roots, excluded patterns) of an allowlist .dockerignore (`*`, then `!name` lines); None for any
    other form, whose context is then hashed whole (but .git)."""
    ignore = root / ".dockerignore"
    if not ignore.is_file():
        return None
    lines = [ln.strip() for ln in ignore.read_text(encoding="utf-8", errors="replace").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines or lines[0] != "*":
        return None
    included = [ln[1:].strip("/") for ln in lines[1:] if ln.startswith("!")]
    excluded = [ln for ln in lines[1:] if not ln.startswith("!")]
    return included, excluded


def _excluded(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(name, bare) or any(
            fnmatch.fnmatch(part, bare) for part in rel.split("/")[:-1]
        ):
            return True
    return False


def context_files(root: Path) -> Iterator[str]:
    """The build context's files, relative to `root`, sorted; links are not followed."""
    rule = _allowlist(root)
    tops = [root / inc for inc in rule[0]] if rule else [root]
    excluded = rule[1] if rule else [".git", "**/.git"]
    found: list[str] = []
    for top in tops:
        if top.is_file() and not top.is_symlink():
            found.append(top.relative_to(root).as_posix())
            continue
        for folder, dirs, files in os.walk(top, followlinks=False):
            dirs.sort()
            for name in files:
                rel = (Path(folder) / name).relative_to(root).as_posix()
                if not _excluded(rel, excluded):
                    found.append(rel)
            if len(found) > MAX_CONTEXT_FILES:
                raise ConfigError(f"{root}: the build context has over {MAX_CONTEXT_FILES:,} files; build from a "
                                  "clean jobspec checkout (its .dockerignore keeps runs, caches and venvs out)")
    return iter(sorted(set(found)))


def content_hash(root: Path, dockerfile: Path, build_args: Mapping[str, str]) -> str:
    """sha256 hex over the context's files (names and bytes), the Dockerfile and the build arguments."""
    digest = hashlib.sha256()
    for rel in context_files(root):
        path = root / rel
        if path.is_symlink():
            digest.update(f"link {rel} -> {os.readlink(path)}\0".encode())
            continue
        digest.update(f"file {rel} {path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    digest.update(b"dockerfile\0" + dockerfile.read_bytes())
    for key in sorted(build_args):
        digest.update(f"arg {key}={build_args[key]}\0".encode())
    return digest.hexdigest()


def plan_build(root: Path, vendor: str, repository: str, build_args: Mapping[str, str]) -> Build:
    """The Build of `vendor` from checkout `root` into `repository`."""
    dockerfile = root / DOCKERFILES[vendor]
    if not dockerfile.is_file():
        raise ConfigError(f"{root}: {DOCKERFILES[vendor]} is missing: the {vendor} image is built from it")
    content = content_hash(root, dockerfile, build_args)
    version_tag = f"{repository}:{__version__}-{vendor}"
    return Build(vendor, dockerfile, version_tag, f"{version_tag}-{content[:CONTENT_CHARS]}", content)
