"""Fixtures of the container tier: images built once per session by local_image.py."""

from __future__ import annotations

import os

import pytest

from . import local_image


@pytest.fixture(scope="session")
def container_host() -> None:
    """Skip (or, with JOBSPEC_CONTAINER_REQUIRED=1, fail) where podman and debootstrap cannot run."""
    reason = local_image.unusable_reason()
    if reason is None:
        return
    if os.environ.get("JOBSPEC_CONTAINER_REQUIRED") == "1":
        pytest.fail(f"JOBSPEC_CONTAINER_REQUIRED=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def cpu_image(container_host: None) -> str:
    """images/Dockerfile.cpu built on the local Debian base."""
    return local_image.build("cpu")


@pytest.fixture(scope="session")
def root_image(container_host: None) -> str:
    """The root (CUDA) Dockerfile built on a base with torch preinstalled, as the vendor bases are."""
    return local_image.build("root")


@pytest.fixture(scope="session")
def runner_ready() -> None:
    """Skip the tests that run training while the runner's entry point does not exist yet."""
    missing = [p for p in ("runner/__main__.py", "examples/quickstart.yaml") if not (local_image.REPO / p).exists()]
    if missing:
        pytest.skip(f"the runner is not written yet: {', '.join(missing)} missing")
