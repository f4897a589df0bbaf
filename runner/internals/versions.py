"""The versions each internal was checked on, the installed ones, and the one error a missing internal gives."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from jobspec.errors import ConfigError

log = logging.getLogger("jobspec.runner")

CHECKED = {"torch": "2.11, 2.13", "accelerate": "1.15", "torchao": "0.13, 0.18", "liger-kernel": "0.8.5",
           "transformers": "5.24"}


def installed(dist: str) -> str:
    """The installed version of distribution `dist`, or "not installed"."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def missing(package: str, names: str, needed_for: str) -> ConfigError:
    """The one error (exit 2) for an internal this install lacks: the package, its version, the internal, the fix."""
    return ConfigError(
        f"{package} {installed(package)} lacks {names}, which jobspec needs for {needed_for} "
        f"(checked on {package} {CHECKED[package]}): install one of those versions "
        f"(pip install '{package}=={CHECKED[package].split(', ')[-1]}.*'), or a jobspec-k8s release that supports "
        f"{package} {installed(package)}"
    )


def has(obj: Any, *names: str) -> bool:
    """Whether `obj` has every attribute of `names`."""
    return all(hasattr(obj, n) for n in names)
