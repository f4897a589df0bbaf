"""The versions each internal was checked on, the installed ones, and the one error a missing internal gives."""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from jobspec.errors import ConfigError

log = logging.getLogger("jobspec.runner")

CHECKED = {"torch": "2.11, 2.13, 2.14", "accelerate": "1.15", "torchao": "0.13, 0.18", "liger-kernel": "0.8.5",
           "transformers": "4.56, 5.24"}


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


def _release(text: str) -> tuple[int, ...]:
    """(2, 14, 1) for "2.14.1+cu130"; the leading numbers only."""
    parts = []
    for part in text.split("+")[0].split("."):
        digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def unchecked(package: str) -> str | None:
    """None when the installed `package` is one of the versions in CHECKED (or not installed); else how it relates to
    them: "newer than", "older than" or "between" (a checked "2.13" covers 2.13.x, a checked "0.8.5" only 0.8.5)."""
    now = installed(package)
    if now == "not installed":
        return None
    release = _release(now)
    checked = [_release(c) for c in CHECKED[package].split(", ")]
    if any(release[: len(c)] == c for c in checked):
        return None
    if release > max(checked):
        return "newer than"
    return "older than" if release < min(checked) else "between"
