"""A checkpoint's `manifest.json`: every file's size and CRC-32, written at save, checked before a resume.

    {"format": 1, "step": 8, "checksum": "crc32",
     "files": {"__0_0.distcp": {"bytes": 1234, "crc32": "89abcdef",
                                "samples": [[0, "..."], [1048576, "..."], ...]},   (files over FULL_CHECK_BYTES)
               ".metadata": {...}, "rng-0.pt": {...}, "meta.json": {...}, "spec.yaml": {...}}}

At save, each rank hashes the files it wrote (its `__<rank>_*.distcp` shards and `rng-<rank>.pt`, still
in the page cache) and rank 0 the rest. CRC-32 (zlib) streams at about 1 GiB/s on one core; it finds
truncation, zeroed blocks and bit rot, not tampering, which is all a checkpoint needs.

`check(path)` reads every file up to FULL_CHECK_BYTES whole (meta.json, .metadata, the RNG files, the
shards of small models), and of a larger file its size and SAMPLE_BLOCKS blocks of 1 MiB spread over
it, head and tail included: a missing, truncated or zeroed shard is found without reading 100 GB
twice (DCP reads it once more to load). `check(path, full=True)` reads everything.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = 1
FULL_CHECK_BYTES = 256 * 2**20  # ~0.25 s at 1 GiB/s: files up to this are read whole at resume
SAMPLE_BLOCKS = 8
BLOCK_BYTES = 2**20
_CHUNK = 8 * 2**20


def crc32_file(path: Path, offset: int = 0, length: int | None = None) -> str:
    """CRC-32 of `length` bytes of `path` from `offset` (to the end when None), as 8 hex digits."""
    crc, left = 0, length
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while left is None or left > 0:
            data = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not data:
                break
            crc = zlib.crc32(data, crc)
            left = None if left is None else left - len(data)
    return f"{crc:08x}"


def _sample_offsets(size: int) -> list[int]:
    """Where the sampled blocks of a large file start: evenly spread, the first and the last included."""
    last = max(size - BLOCK_BYTES, 0)
    return sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})


def file_entry(path: Path) -> dict[str, Any]:
    """{"bytes", "crc32"} of one file, plus "samples" [[offset, crc32], ...] when it is too large to reread."""
    size = path.stat().st_size
    entry: dict[str, Any] = {"bytes": size, "crc32": crc32_file(path)}
    if size > FULL_CHECK_BYTES:
        entry["samples"] = [[off, crc32_file(path, off, BLOCK_BYTES)] for off in _sample_offsets(size)]
    return entry


def hash_files(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: file_entry(p) for p in paths}


def write(directory: Path, step: int, entries: dict[str, dict[str, Any]], *, skip: Iterable[str] = ()) -> bytes:
    """The manifest of `directory` (`entries` already hashed by their writers; the other files hashed here),
    as bytes for the caller to write durably."""
    ignored = {MANIFEST, *skip}
    files = dict(entries)
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in files and p.name not in ignored:
            files[p.name] = file_entry(p)
    record = {"format": FORMAT, "step": step, "checksum": "crc32", "files": dict(sorted(files.items()))}
    return json.dumps(record, indent=1).encode()


def check(path: Path, step: int, *, required: Iterable[str] = (), full: bool = False) -> str | None:
    """What is wrong with the files of checkpoint `path` against its manifest, or None when they match."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (OSError, ValueError) as err:
        return f"{MANIFEST} is unreadable ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(_well_formed(e) for e in files.values()):
        return f"{MANIFEST} is malformed (no valid 'files' table)"
    if manifest.get("step") != step:
        return f"{MANIFEST} is for step {manifest.get('step')!r}, but the directory is step-{step}"
    for name in required:
        if name not in files:
            return f"{MANIFEST} does not list {name}"
    for name, entry in files.items():
        problem = _file_problem(path / name, entry, full=full)
        if problem:
            return problem
    return None


def _well_formed(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("bytes"), int)
        and isinstance(entry.get("crc32"), str)
        and isinstance(entry.get("samples", []), list)
    )


def _file_problem(path: Path, entry: dict[str, Any], *, full: bool) -> str | None:
    name, want = path.name, entry["bytes"]
    try:
        size = path.stat().st_size
        if size != want:
            return f"{name} has {size} bytes, {want} were written (truncated or overwritten)"
        if full or size <= FULL_CHECK_BYTES or "samples" not in entry:
            if crc32_file(path) != entry["crc32"]:
                return f"{name} does not match its checksum (its bytes changed: zeroed or corrupted)"
            return None
        for off, crc in entry["samples"]:
            if crc32_file(path, int(off), BLOCK_BYTES) != crc:
                return f"{name} does not match its checksum at byte {off} (zeroed or corrupted)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as err:
        return f"{name} cannot be read ({err.strerror or err})"
    except (TypeError, ValueError):  # a "samples" entry that is not [offset, crc32]
        return f"{MANIFEST} is malformed (the entry of {name})"
    return None
