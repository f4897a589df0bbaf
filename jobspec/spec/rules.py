"""Rules that span sections of a spec: each problem names every field involved and a fix.

`JobSpec` runs them after its fields validate; the loader splits the problems by field path so
that each is reported at its own line. This module never imports the spec: it states what it
reads as protocols (`SpecView`), which `JobSpec` meets, so the two modules form no import circle.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from typing import Protocol

from jobspec.catalog import gpus as gpu_catalogue
from jobspec.catalog.presets import PRESETS
from jobspec.catalog.tiers import divisors
from jobspec.contract import SCRATCH_DIR, SHM_MOUNT, SPEC_MOUNT_DIR, WORKDIR

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")

Problem = tuple[str, str, str | None]  # (field path, message, hint)


class CrossFieldError(ValueError):
    """Rules that span sections; each problem is (field path, message, hint)."""

    def __init__(self, problems: list[Problem]):
        super().__init__("; ".join(f"{p}: {m}" for p, m, _ in problems))
        self.problems = problems


# What the rules read of a spec (read-only properties: a frozen model's narrower types satisfy them).
class _Gpus(Protocol):
    @property
    def type(self) -> str | None: ...
    @property
    def count(self) -> int: ...
    @property
    def memory(self) -> int | None: ...


class _Hardware(Protocol):
    @property
    def vendor(self) -> str: ...
    @property
    def gpus(self) -> _Gpus: ...
    @property
    def nodes(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def memory(self) -> int | None: ...
    @property
    def shm_size(self) -> int: ...


class _Training(Protocol):
    @property
    def global_batch(self) -> int: ...
    @property
    def micro_batch(self) -> int | str: ...
    @property
    def precision(self) -> str: ...


class _Image(Protocol):
    @property
    def name(self) -> str | None: ...


class _Model(Protocol):
    @property
    def preset(self) -> str | None: ...


class _Data(Protocol):
    @property
    def max_seq_len(self) -> int: ...
    @property
    def pvc(self) -> str | None: ...
    @property
    def mount_path(self) -> str: ...


class _Checkpoints(Protocol):
    @property
    def dir(self) -> str: ...
    @property
    def pvc(self) -> str | None: ...


class _Scheduling(Protocol):
    @property
    def labels(self) -> Mapping[str, str]: ...
    @property
    def annotations(self) -> Mapping[str, str]: ...
    @property
    def node_selector(self) -> Mapping[str, str]: ...


class SpecView(Protocol):
    """The parts of a `JobSpec` the rules read."""

    @property
    def hardware(self) -> _Hardware: ...
    @property
    def training(self) -> _Training: ...
    @property
    def image(self) -> _Image: ...
    @property
    def model(self) -> _Model: ...
    @property
    def data(self) -> _Data: ...
    @property
    def checkpoints(self) -> _Checkpoints: ...
    @property
    def scheduling(self) -> _Scheduling: ...


def cross_field_problems(spec: SpecView) -> list[Problem]:
    out: list[Problem] = []
    hw, tr = spec.hardware, spec.training
    world = hw.world_size
    if tr.global_batch % world:
        out.append(
            (
                "training.global_batch",
                f"{tr.global_batch} does not divide over {world} ranks (nodes {hw.nodes} x gpus {hw.gpus.count})",
                f"use a multiple of {world}, e.g. {max(world, tr.global_batch // world * world)}",
            )
        )
    elif isinstance(tr.micro_batch, int) and (tr.global_batch // world) % tr.micro_batch:
        per_rank = tr.global_batch // world
        fits = divisors(per_rank)  # O(sqrt n)
        out.append(
            (
                "training.micro_batch",
                f"{tr.micro_batch} does not divide the per-rank batch {per_rank} (global_batch / ranks)",
                f"use one of {fits} or `auto`",
            )
        )
    image = (spec.image.name or "").lower()
    if (hw.vendor == "cuda" and "rocm" in image) or (hw.vendor == "rocm" and re.search(r"cuda|nvidia", image)):
        out.append(
            (
                "image.name",
                f"image {spec.image.name!r} does not match hardware.vendor {hw.vendor!r}",
                "use an image built for the vendor, or omit image.name for the default",
            )
        )
    info = gpu_catalogue.lookup(hw.gpus.type) if hw.gpus.type else None
    if hw.vendor == "cpu" and hw.gpus.type:
        out.append(("hardware.gpus.type", "vendor cpu takes no GPU type", "remove hardware.gpus.type or set vendor"))
    elif info and info.vendor != hw.vendor:
        out.append(
            (
                "hardware.gpus.type",
                f"{info.name} is a {info.vendor} GPU but hardware.vendor is {hw.vendor!r}",
                f"set hardware.vendor: {info.vendor}",
            )
        )
    elif hw.gpus.type and not info and hw.gpus.memory is None:
        close = gpu_catalogue.suggest(hw.gpus.type)
        known = f"one of {', '.join(gpu_catalogue.known_names())}, or give hardware.gpus.memory"
        hint = f"did you mean {' or '.join(close)}? Otherwise use {known}" if close else f"use {known}"
        out.append(("hardware.gpus.type", f"unknown GPU type {hw.gpus.type!r}", hint))
    if spec.model.preset:
        limit = PRESETS[spec.model.preset].max_positions
        if spec.data.max_seq_len > limit:
            out.append(
                (
                    "data.max_seq_len",
                    f"{spec.data.max_seq_len} exceeds model preset {spec.model.preset!r}'s {limit} positions",
                    f"use data.max_seq_len <= {limit}",
                )
            )
    if spec.checkpoints.pvc and not spec.checkpoints.dir.startswith("/"):
        out.append(
            (
                "checkpoints.dir",
                f"{spec.checkpoints.dir!r} must be an absolute path when checkpoints.pvc mounts a volume there",
                "e.g. /checkpoints",
            )
        )
    if hw.memory is not None and hw.shm_size > hw.memory:
        out.append(
            (
                "hardware.shm_size",
                "exceeds hardware.memory: the memory-backed /dev/shm counts against the pod's memory limit",
                "lower shm_size or raise hardware.memory",
            )
        )
    if spec.data.pvc:
        out += _data_mount_problems(spec)
    for section in ("labels", "annotations", "node_selector"):
        for key, value in getattr(spec.scheduling, section).items():
            if not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63:
                out.append((f"scheduling.{section}.{key}", "not a valid Kubernetes key", "e.g. team, example.com/team"))
            elif section != "annotations" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                out.append(
                    (
                        f"scheduling.{section}.{key}",
                        "not a valid label value",
                        "at most 63 letters, digits, '-', '_' or '.', starting and ending alphanumeric",
                    )
                )
    if hw.vendor == "cpu" and tr.precision == "fp16":
        out.append(("training.precision", "fp16 autocast is not supported for vendor cpu", "use bf16 or fp32"))
    return out


def _data_mount_problems(spec: SpecView) -> list[Problem]:
    """`data.mount_path` must be absolute and not another of the pod's mounts (the API rejects duplicates)."""
    mount = spec.data.mount_path
    if not mount.startswith("/"):
        return [("data.mount_path", "must be an absolute path", "e.g. /data")]
    taken = {
        SPEC_MOUNT_DIR: "the spec", SHM_MOUNT: "/dev/shm", SCRATCH_DIR: "scratch space",
        posixpath.normpath(posixpath.join(WORKDIR, spec.checkpoints.dir)): "checkpoints.dir",
    }  # fmt: skip
    owner = taken.get(posixpath.normpath(mount))
    return [("data.mount_path", f"{mount} is already the pod's mount for {owner}", "use e.g. /data")] if owner else []

