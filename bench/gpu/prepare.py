"""Download the wheels the device machine lacks into `.gpu-wheels/` (git-ignored), to carry with the suite.

    python -m bench.gpu.prepare [--dest .gpu-wheels] [--dry-run]

The device machine's python3 (CPython 3.12, x86-64 Linux, no network) has torch, accelerate, transformers,
peft, numpy, pyyaml, nvidia-ml-py and pytest, but not jobspec's own dependencies: pydantic (with
pydantic-core, annotated-types, typing-inspection and a recent typing-extensions), tenacity (the OOM
ladder's relaunch policy), torchao (`zero2_offload`'s optimizer; its wheel is CPython-ABI3) and liger-kernel
(`training.loss_kernel: liger`, pure Python; its Triton is the one the device's CUDA torch brings). kubernetes
is left out: only `jobspec submit/status/...` import it, and the suite runs none of them. Versions are the
ones installed here, so the device runs what the tests here ran with.
The project itself needs no install there: the suite runs from the repository root with it on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from bench.gpu.common import ROOT

PACKAGES = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions", "tenacity",
            "torchao", "liger-kernel")  # torchao: zero2_offload's optimizer; liger-kernel: training.loss_kernel liger
PYTHON = "3.12"  # the device's python3 (the device tool's KINDS.md)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",  # torchao
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
CARRY_LIMIT = 64 * 1024**2  # what travels with a `run` call: the working tree and the carried paths together


def pins() -> list[str]:
    """NAME==VERSION as installed here (NAME alone when it is not installed)."""
    out = []
    for name in PACKAGES:
        try:
            out.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            out.append(name)
    return out


def command(dest: Path) -> list[str]:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        *pins(),
    ]


def _name(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower().replace("_", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=ROOT / ".gpu-wheels")
    parser.add_argument("--dry-run", action="store_true", help="print the pip command and download nothing")
    args = parser.parse_args(argv)
    cmd = command(args.dest)
    print(" ".join(cmd))
    if args.dry_run:
        return 0
    args.dest.mkdir(parents=True, exist_ok=True)
    if subprocess.run(cmd).returncode:
        return 1
    wanted = {p.split("==")[0]: p for p in pins()}
    for wheel in sorted(args.dest.glob("*.whl")):  # one version of each: two stop the install on the device
        pin = wanted.get(_name(wheel))
        if pin is None or ("==" in pin and f"-{pin.split('==')[1]}-" not in wheel.name):
            print(f"removing {wheel.name} (not pinned: {pin or 'not needed'})")
            wheel.unlink()
    size = sum(w.stat().st_size for w in args.dest.glob("*.whl"))
    print(
        f"{len(list(args.dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {args.dest} "
        f"(the carry limit is {CARRY_LIMIT // 2**20} MiB with the working tree)"
    )
    return 0 if size < CARRY_LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
