"""Default runner images, one per `hardware.vendor` (the images/ Dockerfiles build these tags)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from jobspec import __version__
from jobspec.spec.models import JobSpec

IMAGE_REPOSITORY = "ghcr.io/jobspec/runner"
DEFAULT_IMAGES: Mapping[str, str] = MappingProxyType(
    {vendor: f"{IMAGE_REPOSITORY}:{__version__}-{vendor}" for vendor in ("cuda", "rocm", "cpu")}
)


def default_image(vendor: str) -> str:
    """`ghcr.io/jobspec/runner:<version>-<vendor>` for vendor cuda, rocm or cpu."""
    return DEFAULT_IMAGES[vendor]


def image_for(spec: JobSpec) -> str:
    return spec.image.name or default_image(spec.hardware.vendor)
