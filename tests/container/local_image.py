"""Build the runner images with podman, offline, from a Debian base made here (the container tier).

No Docker engine, registry or base-image pull is needed: debootstrap makes a Debian bookworm
minbase with python3 and python3-venv, `podman import` turns it into `localhost/jobspec-base`, and
the wheels the Dockerfiles install (the project's runtime dependencies, the build backend and the
CPU torch wheel) are downloaded on the host into a wheelhouse that the build mounts at /wheels;
the Dockerfiles' RUN steps then install with PIP_NO_INDEX=1, as they cannot reach a registry here.

Two images, both from the repository's own Dockerfiles:
  cpu   images/Dockerfile.cpu on the Debian base (torch installed from the wheelhouse).
  root  the root (CUDA) Dockerfile on `localhost/jobspec-torch-base`, the CPU image's torch stage:
        a Python with torch already in it, like pytorch/pytorch and rocm/pytorch. Its wheelhouse
        holds no torch wheel, so the build fails if the Dockerfile tries to reinstall torch.

The base image (and its rootfs tarball) and the wheelhouse are cached under
$JOBSPEC_CONTAINER_CACHE (default ~/.cache/jobspec-container); podman's own layer cache makes an
unchanged rebuild take seconds. By hand, as root:  python tests/container/local_image.py [cpu|root]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
APT_PACKAGES = ("podman", "runc", "debootstrap")
APT_HINT = "apt-get install -y " + " ".join(APT_PACKAGES)

BASE_IMAGE = "localhost/jobspec-base:bookworm"
TORCH_BASE_IMAGE = "localhost/jobspec-torch-base:bookworm"
IMAGES = {  # name -> (tag, Dockerfile)
    "cpu": ("localhost/jobspec-runner:test-cpu", REPO / "images" / "Dockerfile.cpu"),
    "root": ("localhost/jobspec-runner:test-root", REPO / "Dockerfile"),
}
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = "python3,python3-venv"

# podman as this machine allows it (DESIGN.md): cgroupfs, runc for `run`, chroot isolation for builds
# (runc builds fail on rlimits), host ulimits, and containers.conf with default_ulimits = [].
PODMAN = ("podman", "--runtime", "runc", "--cgroup-manager=cgroupfs")
BUILD = ("podman", "--cgroup-manager=cgroupfs", "build", "--isolation=chroot", "--network", "host")
RUN = (*PODMAN, "run", "--rm", "--ulimit", "host")


def cache_dir() -> Path:
    return Path(os.environ.get("JOBSPEC_CONTAINER_CACHE", "~/.cache/jobspec-container")).expanduser()


def _which(tool: str) -> str | None:
    # debootstrap lives in /usr/sbin, which a non-login PATH may lack.
    return shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


def podman_env() -> dict[str, str]:
    conf = cache_dir() / "containers.conf"
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("[containers]\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def unusable_reason() -> str | None:
    """Why this machine cannot run the container tier, or None when it can."""
    if sys.platform != "linux":
        return f"the container tier needs Linux (podman, debootstrap); this is {sys.platform}"
    missing = [tool for tool in APT_PACKAGES if _which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian/Ubuntu: {APT_HINT})"
    if os.geteuid() != 0:
        return "the container tier needs root (debootstrap, rootful podman with runc); run pytest as root"
    try:
        import tomllib  # noqa: F401  (reads pyproject.toml for the wheelhouse)
    except ModuleNotFoundError:
        return "the container tier needs Python 3.11+ (tomllib)"
    try:
        probe = subprocess.run(
            ["podman", "info", "--format", "{{.Host.OCIRuntime.Name}}"],
            env=podman_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`podman info` failed: {e}"
    if probe.returncode != 0:
        return f"`podman info` failed: {probe.stderr.strip()[-500:]}"
    return None


class CommandFailed(RuntimeError):
    pass


def _run_logged(cmd: Sequence[str], logfile: Path, timeout: float, **kw: object) -> None:
    """Run cmd with its output in logfile; on failure raise with the log's tail."""
    logfile.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with logfile.open("w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kw)  # type: ignore[call-overload]
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    log.info("%s: %.0f s (log %s)", cmd[0], time.monotonic() - start, logfile)
    if rc != 0:
        tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-60:])
        why = "timed out" if rc is None else f"exited {rc}"
        raise CommandFailed(f"{shlex.join(cmd[:6])} ... {why}; log {logfile}, last lines:\n{tail}")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """One builder at a time per cache (parallel pytest workers share the base and wheelhouse)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _image_exists(image: str) -> bool:
    return subprocess.run(["podman", "image", "exists", image], env=podman_env()).returncode == 0


def ensure_base() -> str:
    """localhost/jobspec-base:bookworm: Debian minbase + python3 + python3-venv (~40 s the first time)."""
    if _image_exists(BASE_IMAGE):
        return BASE_IMAGE
    cache = cache_dir()
    tarball = cache / f"debian-{DEBIAN_SUITE}-python3.tar"
    if not tarball.exists():
        mirror = os.environ.get("JOBSPEC_DEBIAN_MIRROR", "http://deb.debian.org/debian")
        rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache))
        try:
            _run_logged(
                [
                    _which("debootstrap") or "debootstrap",
                    "--variant=minbase",
                    f"--include={DEBIAN_PACKAGES}",
                    DEBIAN_SUITE,
                    str(rootfs),
                    mirror,
                ],
                cache / "logs" / "debootstrap.log",
                timeout=1200,
            )
            partial = tarball.with_suffix(".partial")
            _run_logged(["tar", "-C", str(rootfs), "-cf", str(partial), "."], cache / "logs" / "tar.log", 600)
            partial.rename(tarball)
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)
    with tarball.open("rb") as tar:
        _run_logged(
            ["podman", "import", "-", BASE_IMAGE], cache / "logs" / "import.log", 600, stdin=tar, env=podman_env()
        )
    return BASE_IMAGE


def dockerfile_arg(dockerfile: Path, name: str) -> str:
    """The default of `ARG name=value` in a Dockerfile."""
    match = re.search(rf"^ARG {name}=(\S+)", dockerfile.read_text(), re.MULTILINE)
    if not match:
        raise ValueError(f"{dockerfile} has no ARG {name}=...")
    return match.group(1)


def image_extras() -> list[str]:
    """Every extra the built images install: each Dockerfile's `jobspec-image.sh wheel SRC DIST "EXTRAS"`, or the
    script's own default where a Dockerfile names none."""
    script = (REPO / "images" / "jobspec-image.sh").read_text()
    default = re.search(r"extras=\$\{3:-([^}]*)\}", script)
    if default is None:
        raise ValueError("images/jobspec-image.sh has no default extras (extras=${3:-...})")
    names: set[str] = set()
    for _, dockerfile in IMAGES.values():
        for line in dockerfile.read_text().splitlines():
            if "jobspec-image.sh wheel" in line:
                quoted = re.search(r'"([^"]*)"', line)
                names.update((quoted or default).group(1).split())
    return sorted(names)


def _project_requirements() -> tuple[list[str], list[str]]:
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = pyproject["project"]
    extras = project["optional-dependencies"]  # what images/jobspec-image.sh installs
    runtime = [*project["dependencies"], *(req for name in image_extras() for req in extras[name])]
    return runtime, list(pyproject["build-system"]["requires"])


def _base_python() -> tuple[str, list[str]]:
    """Python version ("3.11") and manylinux platform tags of the base image, for `pip download`."""
    probe = subprocess.run(
        [
            *RUN,
            "--network",
            "none",
            BASE_IMAGE,
            "python3",
            "-c",
            "import platform, sys; print('%d.%d' % sys.version_info[:2], platform.libc_ver()[1], platform.machine())",
        ],
        env=podman_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    version, glibc, machine = probe.stdout.split()
    # pip takes the platform tags literally: list every glibc the base's satisfies, and the legacy names.
    minor = int(glibc.split(".")[1])
    tags = [f"manylinux_2_{m}_{machine}" for m in range(minor, 4, -1)]
    tags += [f"{legacy}_{machine}" for legacy in ("manylinux2014", "manylinux2010", "manylinux1")]
    return version, tags


@dataclass(frozen=True)
class Wheelhouse:
    deps: Path  # project runtime deps + build backend; no torch
    torch: Path  # the CPU torch wheel


def ensure_wheelhouse(torch_version: str) -> Wheelhouse:
    """Download every wheel the offline builds need, once per requirement set (~1 min, ~300 MB).

    `pip download` for another interpreter and platform takes wheels only. A requirement published only as an
    sdist (lm-eval's rouge-score, sqlitedict, word2number) is built here into a wheel (`pip wheel --no-deps`),
    which must come out pure Python (`-none-any`), and offered to the download through --find-links."""
    runtime, build_requires = _project_requirements()
    python, platforms = _base_python()
    torch_req = f"torch=={torch_version}"
    extra = shlex.split(os.environ.get("JOBSPEC_CONTAINER_PIP_ARGS", ""))
    key = hashlib.sha256(
        json.dumps([runtime, build_requires, torch_req, python, platforms, extra]).encode()
    ).hexdigest()
    root = cache_dir() / "wheels"
    home = root / key[:16]
    house = Wheelhouse(deps=home / "deps", torch=home / "torch")
    if (home / "complete").exists():
        return house
    shutil.rmtree(root, ignore_errors=True)  # older requirement sets
    house.deps.mkdir(parents=True)
    house.torch.mkdir()
    built = home / "built"  # wheels built here from pure-Python sdists
    built.mkdir()
    download = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--disable-pip-version-check",
        "--dest",
        str(house.deps),
        "--only-binary=:all:",
        "--find-links",
        str(built),
        "--python-version",
        python,
        "--implementation",
        "cp",
        *(arg for tag in platforms for arg in ("--platform", tag)),
        *extra,
        *runtime,
        *build_requires,
        torch_req,
    ]
    logfile = cache_dir() / "logs" / "pip-download.log"
    tried: set[str] = set()
    while True:
        try:
            _run_logged(download, logfile, timeout=1800)
            break
        except CommandFailed:
            sdist = _wheel_missing(logfile.read_text(errors="replace"))
            if sdist is None or sdist in tried or len(tried) >= MAX_SDIST_BUILDS:
                raise
            tried.add(sdist)
            _build_pure_wheel(sdist, built, extra)
    torch_wheels = list(house.deps.glob("torch-*.whl"))
    if not torch_wheels:
        raise CommandFailed(f"pip download brought no torch wheel for {torch_req} into {house.deps}")
    for wheel in torch_wheels:
        wheel.rename(house.torch / wheel.name)
    built_names = sorted(p.name for p in built.glob("*.whl"))
    (home / "complete").write_text(
        json.dumps({"runtime": runtime, "torch": torch_req, "python": python, "built_from_sdist": built_names})
    )
    return house


MAX_SDIST_BUILDS = 12  # sdist-only requirements built into wheels before the download gives up
_NO_WHEEL = re.compile(r"No matching distribution found for (\S+)")


def _wheel_missing(log_text: str) -> str | None:
    """The requirement `pip download --only-binary` found no wheel for ("rouge-score>=0.0.4"), or None."""
    found = _NO_WHEEL.findall(log_text)
    return found[-1] if found else None


def _build_pure_wheel(requirement: str, built: Path, extra: Sequence[str]) -> None:
    """Build `requirement`'s wheel from its sdist into `built`; it must be pure Python to serve another platform."""
    before = set(built.glob("*.whl"))
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    _run_logged(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            name,
            "--wheel-dir",
            str(built),
            *extra,
            requirement,
        ],
        cache_dir() / "logs" / f"pip-wheel-{re.sub(r'[^A-Za-z0-9]+', '-', name)}.log",
        timeout=600,
    )
    new = sorted(set(built.glob("*.whl")) - before)
    if not new or any(not p.name.endswith("-none-any.whl") for p in new):
        raise CommandFailed(f"{requirement} has no wheel for the base image's platform and its sdist did not build "
                            f"a pure-Python wheel ({', '.join(p.name for p in new) or 'none'}): the offline image "
                            "build cannot install it")  # fmt: skip


def build(name: str) -> str:
    """Build image `name` ("cpu" or "root") and return its tag."""
    with _locked():
        base = ensure_base()
        cpu_file = IMAGES["cpu"][1]
        torch_version = os.environ.get("JOBSPEC_CONTAINER_TORCH") or dockerfile_arg(cpu_file, "TORCH_VERSION")
        house = ensure_wheelhouse(torch_version)
        cpu_args = {
            "BASE_IMAGE": base,
            "TORCH_VERSION": torch_version,
            "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": "/wheels/deps /wheels/torch",
        }
        mounts = [f"{house.deps}:/wheels/deps:ro", f"{house.torch}:/wheels/torch:ro"]
        tag, dockerfile = IMAGES[name]
        if name == "cpu":
            _build(dockerfile, tag, cpu_args, mounts)
        else:
            # The vendor bases' layout: torch preinstalled. Only the deps are mounted from here on.
            _build(cpu_file, TORCH_BASE_IMAGE, cpu_args, mounts, target="torch")
            _build(
                dockerfile,
                tag,
                {"BASE_IMAGE": TORCH_BASE_IMAGE, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/wheels/deps"},
                mounts[:1],
            )
        return tag


def _build(dockerfile: Path, tag: str, args: dict[str, str], mounts: list[str], target: str | None = None) -> None:
    cmd = [*BUILD, "-f", str(dockerfile), "-t", tag]
    for key, value in args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for mount in mounts:
        cmd += ["-v", mount]
    if target:
        cmd += ["--target", target]
    slug = re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-")
    _run_logged([*cmd, str(REPO)], cache_dir() / "logs" / f"build-{slug}.log", timeout=1800, env=podman_env())


def inspect(image: str) -> dict:
    out = subprocess.run(
        ["podman", "image", "inspect", image], env=podman_env(), capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return json.loads(out)[0]


def run(
    image: str, args: Sequence[str], *, options: Sequence[str] = (), timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    """`podman run --rm [options] image args`, output captured."""
    return subprocess.run(
        [*RUN, *options, image, *args], env=podman_env(), capture_output=True, text=True, timeout=timeout
    )


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Any other podman command (stop, wait, logs, rm), output captured."""
    return subprocess.run([*PODMAN, *args], env=podman_env(), capture_output=True, text=True, timeout=timeout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("images", nargs="*", metavar="IMAGE", help=f"{' or '.join(IMAGES)} (default: cpu)")
    ns = parser.parse_args(argv)
    unknown = set(ns.images) - set(IMAGES)
    if unknown:
        parser.error(f"unknown image {', '.join(sorted(unknown))}; choose from {', '.join(IMAGES)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    reason = unusable_reason()
    if reason:
        print(f"cannot build here: {reason}", file=sys.stderr)
        return 1
    for name in ns.images or ["cpu"]:
        start = time.monotonic()
        print(f"{build(name)}  ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
