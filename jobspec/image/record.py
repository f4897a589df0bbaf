"""The record of pushed images, one per vendor, which `render` pins a spec without `image.name` to.

A JSON file of the user's (`$JOBSPEC_IMAGES`, default `$XDG_CONFIG_HOME/jobspec/images.json`, i.e.
~/.config/jobspec/images.json), written by `jobspec image push`:

    {"version": 1, "images": {"cuda": {"reference": "ghcr.io/me/runner:0.1.0-cuda-3f2a...@sha256:<64 hex>",
                                       "jobspec": "0.1.0", "content": "<sha256 hex>", "pushed": "<UTC time>"}}}

Read as untrusted (bounded, no link followed at the file, each reference checked against the image grammar and a
sha256 digest); an entry pushed by another jobspec version is not used (its runner may not read this spec), and a
file that cannot be used is said once and ignored, never a traceback. Written atomically, never through a link.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from jobspec import __version__
from jobspec.errors import ConfigError
from jobspec.image.context import VENDORS
from jobspec.shared_dir import Unsafe, directory, write_atomic
from jobspec.untrusted import json_loads, read_bounded

log = logging.getLogger(__name__)

RECORD_ENV = "JOBSPEC_IMAGES"
MAX_RECORD_BYTES = 64 * 1024
RECORD_VERSION = 1
PINNED = re.compile(r"(?P<name>[^@\s]{1,255}:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})@(?P<digest>sha256:[0-9a-f]{64})")
_said: set[str] = set()


def record_path() -> Path:
    """Where the record lives: $JOBSPEC_IMAGES, else $XDG_CONFIG_HOME/jobspec/images.json (~/.config/...)."""
    if os.environ.get(RECORD_ENV):
        return Path(os.environ[RECORD_ENV]).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "jobspec" / "images.json"


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning(message)


def read_record(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """vendor -> entry of the record; {} when there is none, and when it cannot be used (said once, ignored)."""
    path = path or record_path()
    if not os.path.lexists(path):
        return {}
    try:
        data = json_loads(read_bounded(path, MAX_RECORD_BYTES, what="image record", follow=False))
    except (ConfigError, ValueError) as err:
        _say_once(f"image record {path} ignored ({err}); `jobspec image push` writes it anew")
        return {}
    images = data.get("images") if isinstance(data, dict) and data.get("version") == RECORD_VERSION else None
    if not isinstance(images, dict):
        _say_once(f"image record {path} ignored: not a version-{RECORD_VERSION} record of jobspec image push")
        return {}
    good = {}
    for vendor, entry in images.items():
        reference = entry.get("reference") if isinstance(entry, dict) else None
        if vendor in VENDORS and isinstance(reference, str) and PINNED.fullmatch(reference):
            good[vendor] = entry
            continue
        _say_once(f"image record {path}: the entry {str(vendor)[:20]!r} is not a pinned image reference; ignored")
    return good


def pinned_image(vendor: str) -> str | None:
    """The recorded image of `vendor` (`repo:tag@sha256:...`) when jobspec pushed one for this version, else None."""
    entry = read_record().get(vendor)
    if entry is None:
        return None
    if entry.get("jobspec") != __version__:
        _say_once(f"the recorded {vendor} image was pushed by jobspec {str(entry.get('jobspec'))[:20]}, not "
                  f"{__version__}: not used (its runner may not read this version's specs); push it again with "
                  f"`jobspec image push --vendor {vendor}`")  # fmt: skip
        return None
    return str(entry["reference"])


def record_pushed(vendor: str, reference: str, content: str, path: Path | None = None) -> Path:
    """Add (or replace) `vendor`'s entry; the file is written whole, atomically, never through a link."""
    if not PINNED.fullmatch(reference):
        raise ValueError(f"not a pinned reference: {reference!r}")
    path = path or record_path()
    try:
        directory(path.parent, follow=True)
    except Unsafe as err:
        raise ConfigError(f"image record {path}: its folder {err}") from None
    images = read_record(path)
    images[vendor] = {"reference": reference, "jobspec": __version__, "content": content,
                      "pushed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    text = json.dumps({"version": RECORD_VERSION, "images": images}, indent=2, sort_keys=True) + "\n"
    try:
        write_atomic(path, text.encode(), mode=0o600)
    except IsADirectoryError:
        raise ConfigError(f"image record {path} is a directory: remove it, or set {RECORD_ENV} to a file") from None
    return path
