"""`jobspec image build | push | show`: the runner images from the project's Dockerfiles, pushed and pinned.

    jobspec image build --vendor cuda                       # ghcr.io/jobspec/runner:0.1.0-cuda and ...-cuda-<hash>
    jobspec image push --repository ghcr.io/me/jobspec-runner --vendor cuda,cpu
    jobspec image show                                      # what `render` puts in a Job, per vendor
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

from jobspec.contract import EXIT_OK
from jobspec.errors import ConfigError
from jobspec.image import context, engine, record

HELP = "build the runner images from the project's Dockerfiles, push them, record the digest render pins"
DESCRIPTION = """\
Build the runner images (CUDA: Dockerfile, ROCm: images/Dockerfile.rocm, CPU: images/Dockerfile.cpu) from a jobspec
source checkout with docker or podman, tagged <repository>:<version>-<vendor> and <repository>:<version>-<vendor>-
<content hash>; `push` pushes both tags to your registry and records the digest, which `render`, `submit` and
`validate` then use for every spec without image.name (repo:tag@sha256:..., pulled IfNotPresent).
"""


def add_image_commands(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Register `image` with its build, push and show subcommands."""
    p = subparsers.add_parser("image", parents=[common], help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="image_command", metavar="build|push|show", required=True, parser_class=type(p))
    for name, text in (("build", "build the images here (no push)"),
                       ("push", "build, push both tags, record the digest render pins")):  # fmt: skip
        q = sub.add_parser(name, parents=[common], help=text, description=text)
        q.add_argument("--vendor", default="cuda", metavar="VENDORS",
                       help="cuda, rocm, cpu (comma-separated) or all; default cuda")  # fmt: skip
        q.add_argument("--repository", metavar="REGISTRY/NAME", required=name == "push",
                       help="image repository, e.g. ghcr.io/me/jobspec-runner (build's default: "
                       f"{context.DEFAULT_REPOSITORY})")  # fmt: skip
        q.add_argument("--engine", choices=engine.ENGINES, help="container engine (default: docker, else podman)")
        q.add_argument("--source", metavar="DIR", help="jobspec source checkout (default: this install's, or here)")
        q.add_argument("--build-arg", dest="build_args", action="append", default=[], metavar="KEY=VALUE",
                       help="passed to the build, e.g. BASE_IMAGE=... (never printed: it may hold a password)")
        if name == "push":
            q.add_argument("--no-build", action="store_true", help="push the tags built before; do not build")
        q.set_defaults(func=cmd_build if name == "build" else cmd_push)
    q = sub.add_parser("show", parents=[common], help="the image render uses per vendor, and where it comes from")
    q.set_defaults(func=cmd_show)


def _vendors(text: str) -> list[str]:
    wanted = list(context.VENDORS) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in wanted if v not in context.VENDORS]
    if bad or not wanted:
        raise ConfigError(f"--vendor: expected cuda, rocm, cpu (comma-separated) or all, not {len(bad)} other value(s)")
    return wanted


def _build_args(items: list[str]) -> dict[str, str]:
    args = {}
    for i, item in enumerate(items):
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ConfigError(f"--build-arg #{i + 1}: expected KEY=VALUE with KEY a variable name (the value is not "
                              "shown: it may be a password)")  # fmt: skip
        if key in ("VERSION", "REVISION"):
            raise ConfigError(f"--build-arg {key}: jobspec sets it (the package version and the source revision)")
        args[key] = value
    return args


def _repository(text: str | None) -> str:
    repository = text or context.DEFAULT_REPOSITORY
    from jobspec.spec.models import ImageSpec  # the image grammar kubelet parses, as image.name is checked

    try:
        ImageSpec(name=f"{repository}:probe")
    except ValueError:
        raise ConfigError(f"--repository {repository!r}: not an image repository; use REGISTRY/NAME in lowercase, "
                          "e.g. ghcr.io/me/jobspec-runner (no tag: jobspec adds them)") from None  # fmt: skip
    if ":" in repository.rsplit("/", 1)[-1] or "@" in repository:
        raise ConfigError(f"--repository {repository!r}: give the repository without a tag or digest; jobspec tags "
                          "by version and content")  # fmt: skip
    return repository


def _revision(root: Path) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip().isalnum() else "unknown"


def _builds(args: argparse.Namespace) -> tuple[engine.Engine, Path, list[context.Build], dict[str, str]]:
    vendors, repository, build_args = _vendors(args.vendor), _repository(args.repository), _build_args(args.build_args)
    root = context.source_checkout(args.source)
    found = engine.find_engine(args.engine)
    return found, root, [context.plan_build(root, v, repository, build_args) for v in vendors], build_args


def _build(found: engine.Engine, root: Path, plan: context.Build, build_args: dict[str, str], revision: str) -> None:
    print(f"building the {plan.vendor} image from {root} with {found.name}: {plan.content_tag}", file=sys.stderr)
    engine.build(found, root, plan, build_args, revision)


def cmd_build(args: argparse.Namespace) -> int:
    found, root, builds, build_args = _builds(args)
    revision = _revision(root)
    for plan in builds:
        _build(found, root, plan, build_args, revision)
        print(f"{plan.vendor}: {plan.version_tag}, {plan.content_tag}")
    return EXIT_OK


def cmd_push(args: argparse.Namespace) -> int:
    found, root, builds, build_args = _builds(args)
    revision = _revision(root)
    for plan in builds:
        if not args.no_build:
            _build(found, root, plan, build_args, revision)
        digest = engine.push(found, plan)
        pinned = f"{plan.content_tag}@{digest}"
        where = record.record_pushed(plan.vendor, pinned, plan.content)
        print(f"{plan.vendor}: {pinned}")
        print(f"recorded in {where}: specs with hardware.vendor {plan.vendor} and no image.name now render it",
              file=sys.stderr)  # fmt: skip
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    path = record.record_path()
    print(f"image record: {path}{'' if path.exists() else ' (none yet: jobspec image push writes it)'}")
    for vendor in context.VENDORS:
        pinned = record.pinned_image(vendor)
        how = "pushed by jobspec image push" if pinned else "the default tag (not published: build and push yours)"
        print(f"  {vendor}: {pinned or context.default_image(vendor)}  ({how})")
    return EXIT_OK
