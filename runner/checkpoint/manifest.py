"""A checkpoint's `manifest.json`: every file's size and CRC-32, written at save, checked before a resume.

    {"format": 1, "step": 8, "checksum": "crc32",
     "files": {"__0_0.distcp": {"bytes": 1234, "crc32": "89abcdef",
                                "samples": [[0, "..."], [1048576, "..."], ...]},   (files over FULL_CHECK_BYTES)
               ".metadata": {...}, "rng-0.pt": {...}, "meta.json": {...}, "spec.yaml": {...}}}

At save, each rank hashes the files it wrote (its `__<rank>_*.distcp` shards and `rng-<rank>.pt`, still
in the page cache) and rank 0 the rest. CRC-32 (zlib) streams at about 1 GiB/s on one core; it finds
truncation, zeroed blocks and bit rot, not tampering: whoever can write the volume can rewrite the
manifest too. With JOBSPEC_CHECKPOINT_KEY set (jobspec/shared_dir/signing.py) every entry also carries the
file's SHA-256 and the manifest an HMAC-SHA256; `check` then refuses a manifest without a valid MAC and
reads every file whole against its SHA-256 (sampling would let a forged block between samples through).

Every file is opened as a regular file of the directory (runner/checkpoint/files.py: no link, FIFO or
device) and read no further than its size; a listed name must be a plain file name, and an entry holds
at most SAMPLE_BLOCKS samples, so a forged manifest cannot make the check read without end.

`check(path)` reads every file up to FULL_CHECK_BYTES whole (meta.json, .metadata, the RNG files, the
shards of small models), and of a larger file its size and SAMPLE_BLOCKS blocks of 1 MiB spread over
it, head and tail included: a missing, truncated or zeroed shard is found without reading 100 GB
twice (DCP reads it once more to load). `check(path, full=True)` reads everything.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.shared_dir import signing
from runner.checkpoint import files

MANIFEST = "manifest.json"
FORMAT = 1
MAX_BYTES = 64 * 2**20  # ~400 bytes per listed file: 160k files, 40x a 2048-rank checkpoint
FULL_CHECK_BYTES = 256 * 2**20  # ~0.25 s at 1 GiB/s: files up to this are read whole at resume
SAMPLE_BLOCKS = 8
BLOCK_BYTES = 2**20
_CHUNK = 8 * 2**20
_THREADS = 8  # files hashed at once: one rank's shards each, as fast as the volume gives them


def crc32_file(path: Path, offset: int = 0, length: int | None = None) -> str:
    """CRC-32 of `length` bytes of `path` from `offset` (to the end when None), as 8 hex digits."""
    with files.open_regular(path) as f:
        return _digest(f, offset, length)[0]


def _digest(f: BinaryIO, offset: int = 0, length: int | None = None, *, sha: bool = False) -> tuple[str, str | None]:
    """(CRC-32, SHA-256 when `sha`) of `length` bytes of the open file `f` from `offset`, never past its size."""
    size = files.size_of(f)
    left = max(size - offset, 0) if length is None else min(length, max(size - offset, 0))
    crc, sha256 = 0, hashlib.sha256() if sha else None
    f.seek(offset)
    while left > 0:
        data = f.read(min(_CHUNK, left))
        if not data:
            break
        crc = zlib.crc32(data, crc)
        if sha256 is not None:
            sha256.update(data)
        left -= len(data)
    return f"{crc:08x}", sha256.hexdigest() if sha256 is not None else None


def _sample_offsets(size: int) -> list[int]:
    """Where the sampled blocks of a large file start: evenly spread, the first and the last included."""
    last = max(size - BLOCK_BYTES, 0)
    return sorted({last * i // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)})


def file_entry(path: Path, *, sha: bool = False) -> dict[str, Any]:
    """{"bytes", "crc32"} of one file, plus "samples" [[offset, crc32], ...] when it is too large to reread, and
    "sha256" when `sha` (a signed manifest)."""
    with files.open_regular(path) as f:
        size = files.size_of(f)
        crc, sha256 = _digest(f, sha=sha)
        entry: dict[str, Any] = {"bytes": size, "crc32": crc}
        if sha256 is not None:
            entry["sha256"] = sha256
        if size > FULL_CHECK_BYTES:
            entry["samples"] = [[off, _digest(f, off, BLOCK_BYTES)[0]] for off in _sample_offsets(size)]
    return entry


def hash_files(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    sha = signing.key() is not None
    return {p.name: file_entry(p, sha=sha) for p in paths}


def write(directory: Path, step: int, entries: dict[str, dict[str, Any]], *, skip: Iterable[str] = ()) -> bytes:
    """The manifest of `directory` (`entries` already hashed by their writers; the other files hashed here),
    as bytes for the caller to write durably; signed when JOBSPEC_CHECKPOINT_KEY is set."""
    secret = signing.key()
    ignored = {MANIFEST, *skip}
    listed = dict(entries)
    for p in sorted(directory.iterdir()):
        if (
            files.is_regular(p)
            and p.name not in ignored
            and (p.name not in listed or (secret and "sha256" not in listed[p.name]))
        ):
            listed[p.name] = file_entry(p, sha=secret is not None)
    record: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "checksum": "crc32",
        "files": dict(sorted(listed.items())),
    }
    if secret is not None:
        record = signing.sign(record, secret)
    return json.dumps(record, indent=1).encode()


def check(path: Path, step: int, *, required: Iterable[str] = (), full: bool = False) -> str | None:
    """What is wrong with the files of checkpoint `path` against its manifest, or None when they match."""
    secret = signing.key()
    manifest, unread = files.read_or_problem(
        MANIFEST, lambda: files.read_json(path / MANIFEST, MAX_BYTES, "checkpoint manifest"))
    if unread is not None:
        return unread
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(entries, dict) or not all(_well_formed(n, e) for n, e in entries.items()):
        return f"{MANIFEST} is malformed (no valid 'files' table)"
    if secret is not None and (unsigned := signing.problem(manifest, secret, MANIFEST)):
        return unsigned
    if manifest.get("step") != step:
        return f"{MANIFEST} is for step {repr(manifest.get('step'))[:40]}, but the directory is step-{step}"
    for name in required:
        if name not in entries:
            return f"{MANIFEST} does not list {name}"
    if secret is not None and (
        bare := next((n for n, e in entries.items() if not isinstance(e.get("sha256"), str)), None)
    ):
        return f"{MANIFEST} has no SHA-256 for {bare} (signed manifests list one for every file)"
    whole = full or secret is not None
    with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(entries)))) as pool:  # CRC and SHA-256 free the GIL
        problems = pool.map(lambda item: _file_problem(path / item[0], item[1], full=whole), entries.items())
        return next((p for p in problems if p), None)  # the first in the manifest's order


def _well_formed(name: Any, entry: Any) -> bool:
    samples = entry.get("samples", []) if isinstance(entry, dict) else None
    return (
        isinstance(name, str)
        and files.plain_name(name)
        and isinstance(entry, dict)
        and type(entry.get("bytes")) is int
        and entry["bytes"] >= 0
        and isinstance(entry.get("crc32"), str)
        and isinstance(samples, list)
        and len(samples) <= SAMPLE_BLOCKS
    )


def _file_problem(path: Path, entry: dict[str, Any], *, full: bool) -> str | None:
    name, want = path.name, entry["bytes"]
    try:
        with files.open_regular(path) as f:
            size = files.size_of(f)
            if size != want:
                return f"{name} has {size} bytes, {want} were written (truncated or overwritten)"
            if not full and size > FULL_CHECK_BYTES and "samples" not in entry:  # the writer samples every such file
                return f"{MANIFEST} is malformed (the entry of {name}, {size:,} bytes, has no samples)"
            if full or size <= FULL_CHECK_BYTES:
                crc, sha = _digest(f, sha="sha256" in entry and full)
                if crc != entry["crc32"] or (sha is not None and sha != entry["sha256"]):
                    return f"{name} does not match its checksum (its bytes changed: zeroed, corrupted or replaced)"
                return None
            for off, crc in entry["samples"]:
                if type(off) is not int or not 0 <= off < size:
                    return f"{MANIFEST} is malformed (the entry of {name})"
                if _digest(f, off, BLOCK_BYTES)[0] != crc:
                    return f"{name} does not match its checksum at byte {off} (zeroed or corrupted)"
    except FileNotFoundError:
        return f"{name} is missing"
    except files.UnsafeFile as err:
        return str(err)
    except OSError as err:
        return f"{name} cannot be read ({err.strerror or err})"
    except (TypeError, ValueError):  # a "samples" entry that is not [offset, crc32]
        return f"{MANIFEST} is malformed (the entry of {name})"
    return None
