"""The runner image of a Job: `image.name`, else the image `jobspec image push` recorded for `hardware.vendor`
(pinned by digest), else the default tag `ghcr.io/jobspec/runner:<version>-<vendor>` (jobspec/image/)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from jobspec.image.context import DEFAULT_REPOSITORY as IMAGE_REPOSITORY
from jobspec.image.context import VENDORS, default_image
from jobspec.image.record import pinned_image
from jobspec.spec.models import JobSpec

DEFAULT_IMAGES: Mapping[str, str] = MappingProxyType({vendor: default_image(vendor) for vendor in VENDORS})

__all__ = ["DEFAULT_IMAGES", "IMAGE_REPOSITORY", "default_image", "image_for", "pull_policy", "unpublished_note"]


def image_for(spec: JobSpec) -> str:
    return spec.image.name or pinned_image(spec.hardware.vendor) or default_image(spec.hardware.vendor)


def pull_policy(spec: JobSpec, image: str) -> str:
    """`image.pull_policy`, else IfNotPresent for an image pinned by digest (what a node has is what was asked) and
    Always for a tag, which can move: a node's cached copy of an older push would run otherwise."""
    return spec.image.pull_policy or ("IfNotPresent" if "@" in image else "Always")


def unpublished_note(spec: JobSpec) -> str | None:
    """What to do when the Job would run the default tag: no image.name, and nothing pushed for the vendor."""
    if spec.image.name or pinned_image(spec.hardware.vendor):
        return None
    vendor = spec.hardware.vendor
    return (f"image.name is not set and no {vendor} image was pushed from here: the Job would pull "
            f"{default_image(vendor)}, which this release does not publish (ImagePullBackOff). Build and push "
            f"yours from a jobspec checkout: `jobspec image push --repository REGISTRY/NAME --vendor {vendor}` "
            "(render then pins it by digest), or set image.name")
