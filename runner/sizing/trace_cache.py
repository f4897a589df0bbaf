"""The traced line (bytes at micro-batch 0, bytes per sample) kept beside the tokenized-data cache, content-addressed.

A trace of a 1B model's step at two micro-batches took 33-35 s of the first H200 run's 57-67 s start-up (issue 41),
and a restart, a pod created again or the next run of the same spec would trace the same step again. The line is
stored as `<cache root>/trace-<key>.json`, the key a sha256 over everything the trace depends on: the spec as the
trace reads it (model, data, training, hardware and memory, without the fields that only name the run or where it
writes: `IGNORED`), the tier, world size, precision, 4-bit base, the two micro-batches, the versions of torch,
transformers, accelerate and peft, and the source of the jobspec and runner packages (the runner's code version:
a changed step, loss or memory model traces again). Versioned by `VERSION`.

The cache root is shared (runner/data/cache.py `usable_root`): the file is read bounded, never through a link
(`read_bounded(..., follow=False)`), parsed as JSON (never pickle), and used only when it names its own key and holds
two non-negative integers; with JOBSPEC_CHECKPOINT_KEY set it must carry a valid signature. Anything else is logged
and traced again; a write that fails (a read-only volume) is logged and the run goes on. Written through
jobspec.shared_dir.write_atomic (an exclusive temporary renamed over the name, a planted link replaced, not followed).
"""

from __future__ import annotations

import hashlib
import json
import logging
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from jobspec import shared_dir
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from jobspec.untrusted import json_loads, read_bounded

log = logging.getLogger("jobspec.runner")
VERSION = 1
LIMIT = 64 * 1024  # a record is ~300 bytes
IGNORED = ("name", "namespace", "checkpoints", "scheduling", "output", "eval", "tracking", "env", "labels")
SOURCES = ("jobspec", "runner")  # packages whose source is the code version
FRAMEWORKS = ("torch", "transformers", "accelerate", "peft", "liger-kernel")  # Liger: its blocks' saved tensors


@cache
def code_version() -> str:
    """sha256 over the .py files of the jobspec and runner packages (names and contents): ~0.3 MB, milliseconds."""
    h = hashlib.sha256()
    for package in SOURCES:
        root = Path(__import__(package).__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root.parent)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "-"


def key(spec_data: dict[str, Any], *, tier: str, world_size: int, precision: str, micro_batches: tuple[int, int],
        quantize: str | None) -> tuple[str, dict[str, Any]]:  # fmt: skip
    """(sha256 hex, its parts) of one trace: `spec_data` is the spec as the trace process reads it."""
    parts = {
        "version": VERSION,
        "spec": {k: v for k, v in spec_data.items() if k not in IGNORED},
        "tier": tier,
        "world_size": world_size,
        "precision": precision,
        "quantize": quantize,
        "micro_batches": sorted(micro_batches),
        "frameworks": {name: _version(name) for name in FRAMEWORKS},
        "code": code_version(),
    }
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest(), parts


def path(root: Path, digest: str) -> Path:
    return root / f"trace-{digest}.json"


def read(root: Path | None, digest: str) -> tuple[int, int] | None:
    """The stored line for `digest`, or None: absent (silently), or not usable (logged: it is traced again)."""
    if root is None:
        return None
    file = path(root, digest)
    try:
        record = json_loads(read_bounded(file, LIMIT, what="trace cache", root=root, follow=False))
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        secret = signing.key()
        if secret is not None and (why := signing.problem(record, secret, file.name)):
            raise ValueError(why)
        fixed, per_sample = record.get("fixed"), record.get("per_sample")
        if record.get("key") != digest or record.get("version") != VERSION:
            raise ValueError("it names another key or version")
        if not all(type(v) is int and 0 <= v < 2**62 for v in (fixed, per_sample)) or not per_sample:
            raise ValueError("fixed and per_sample are not two non-negative integers (per_sample above 0)")
    except ConfigError as err:
        if "does not exist" not in str(err):
            log.warning("plan: trace cache %s not usable, tracing again: %s", file, err)
        return None
    except (OSError, ValueError) as err:
        log.warning("plan: trace cache %s not usable, tracing again: %s", file, err)
        return None
    return fixed, per_sample  # type: ignore[return-value]


def write(root: Path | None, digest: str, fixed: int, per_sample: int, parts: dict[str, Any]) -> None:
    """Store the line (logged when it cannot be: the next start traces again)."""
    if root is None:
        return
    record: dict[str, Any] = {"version": VERSION, "key": digest, "fixed": int(fixed), "per_sample": int(per_sample),
                              "tier": parts["tier"], "world_size": parts["world_size"],
                              "micro_batches": parts["micro_batches"], "frameworks": parts["frameworks"]}  # fmt: skip
    try:
        secret = signing.key()
        if secret is not None:
            record = signing.sign(record, secret)
        shared_dir.write_atomic(path(root, digest), json.dumps(record, sort_keys=True).encode())
    except (OSError, ConfigError) as err:
        log.warning("plan: trace cache %s not written (%s): the next start traces again", path(root, digest), err)
