"""The tokenized data cached once per job: content-addressed, shared by every rank and every restart.

One source's `Streams` (runner/data/tokens.py) live in `<cache root>/<key>/` as four flat .npy arrays (ids,
flags, bounds, trainable) and a meta.json that gives each array's dtype, length, byte size and sha256, and
the key's parts in readable form. The key is a sha256 over everything that decides the tokens:

- the source's bytes: a file's content (its sha256, and a sampled digest read at every start: `_digest_file`); a
  `datasets` save_to_disk directory's files (names and contents). A hub
  dataset id names no fixed content (its revision moves, and is only resolved by downloading it): not cached,
  and the log says so; save it with `save_to_disk` and point the spec at the directory to cache it;
- the tokenizer (`cache_identity()`: the byte tokenizer's name and version; a transformers tokenizer's
  serialized state, chat template and special tokens, hashed) and its chat template;
- max_seq_len (chats are cut to max_seq_len + 1 tokens; raw-text documents are stored whole), the record format and
  field names, the splits read,
  and whether the records were read as preference pairs (two records each, checked as such when tokenized);
- FORMAT_VERSION of this layout.
Packing and `data.text_overlap` are not in the key: rows are grouped, and raw-text documents longer than a row cut
into blocks, from the cached records at load time (a pass over the lengths). An entry of FORMAT_VERSION 3 (documents
truncated) is never read: the version is in the key and in meta.json.
The source's path is not in the key either: the same bytes elsewhere hit the same entry.

Content binds the entry: meta.json carries the key's parts (the source's digests, the tokenizer's identity) and a
reader uses an entry only when they are its own (a copy of another entry under this name is damaged); a digest
stamp saves the hashing but cannot redirect a job to other data, since the sampled digest read from the file itself
is in the key. With JOBSPEC_CHECKPOINT_KEY set (jobspec/shared_dir/signing.py), meta.json, the digest stamps and
VERIFIED are signed with it and an unsigned or wrongly signed one is not used.

The cache root is shared by the jobs that name it: every file written there goes through jobspec.shared_dir (no
link followed, temporaries and entries created exclusively under random names, the lock opened as a regular file).
Written once: the first process takes an exclusive `fcntl.flock` on `<key>.lock` in the cache root, checks
again, tokenizes, writes a temp directory (each file fsynced), renames it into place and releases the lock;
the others wait on the lock (at most LOCK_WAIT_S), then read. Read = checks, then `np.memmap`: every file a
regular file inside the entry (opened once, checked on the descriptor), sizes, dtypes and sha256 as meta.json
says, bounds from 0 rising to len(ids), ids inside the vocabulary (the checks that read every byte once per entry
and file identity: `read_entry`; without a key, an unforgeable VERIFIED cannot be had, so it saves the sha256 pass
only and the bounds and vocabulary checks run at every start). Any failure is logged as a warning naming the file
and the entry is rebuilt: a cache is never trusted and never a reason to stop. Mapped read-only, the ids and flags
are shared by every process on the node through the page cache: ~3 B a token resident once touched, not a private
copy per rank.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from numpy.lib import format as npy

from jobspec import shared_dir
from jobspec.errors import ConfigError
from jobspec.shared_dir import signing
from jobspec.spec.models import DataSpec, JobSpec
from jobspec.untrusted import json_loads, open_regular, read_bounded
from runner.data.files import open_data
from runner.data.records import source_kind
from runner.data.tokenizer import Tokenizer
from runner.data.tokens import Streams

log = logging.getLogger("jobspec.runner")
FORMAT_VERSION = 4  # of this layout and of the key's parts: raise it when either changes (3: a preference pair's
# prompt turns are not targets; 4: a raw-text document is stored whole, not truncated to max_seq_len + 1 tokens)
ARRAYS = {"ids": ("uint16", "int32"), "flags": ("bool",), "bounds": ("int64",), "trainable": ("bool",)}
META = "meta.json"
VERIFIED = "verified.stamp"  # the files a reader checked whole, by identity (read_entry)
MAX_META_BYTES = 1 << 20  # a chat template and a few hashes: kilobytes
LOCK_WAIT_S = 3 * 3600.0  # a process tokenizing a very large source; past this a waiting rank stops with an error
READ_BLOCK = 1 << 20
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
SAMPLE_BLOCKS, SAMPLE_BYTES = 16, 4096  # the blocks of a source read at every start (`_sampled`): 64 KiB
USERINFO = re.compile(r"(?<=://)[^/@\s]+@")  # user:password@ in a URL-like source: never written down


def cache_root(spec: JobSpec) -> Path:
    """Where the job's tokenized data is cached: `data.cache_dir`, else `<checkpoints.dir>/data-cache` (the run
    directory's volume: kept across restarts, shared by the pods that share it)."""
    return Path(spec.data.cache_dir) if spec.data.cache_dir else Path(spec.run_dir) / "data-cache"


def usable_root(spec: JobSpec) -> Path | None:
    """`cache_root(spec)`, made when missing, if it is a directory of its own: the default `data-cache` may not be a
    link (planted there, it would lead the cache's writes out of the volume; `data.cache_dir`, named by a person,
    may). None (logged: the data is tokenized without a cache) otherwise."""
    root = cache_root(spec)
    try:
        return shared_dir.directory(root, follow=spec.data.cache_dir is not None)
    except OSError as err:
        log.warning("data cache %s not usable (%s): tokenizing without it", root, err)
        return None


@dataclass(frozen=True)
class CacheKey:
    digest: str  # sha256 hex over `parts`: the entry's directory name
    parts: dict[str, str]  # what went into it, readable (meta.json); no secrets
    vocab_size: int
    source: str  # for the log


def cache_key(
    source: str | Path,
    spec: DataSpec,
    tokenizer: Tokenizer,
    field: str,
    splits: Sequence[str],
    stamps: Path | None = None,
    pairs: bool = False,
) -> CacheKey | None:
    """The key of `source` tokenized by `tokenizer` under `spec`; None (logged) when its content or the
    tokenizer cannot be known before tokenizing. A source that is not there fails here as it would when read.
    `stamps`: the directory where the digests of files already hashed are kept, as `source-*.stamp` files (the cache
    root: see `_digest_file`); None: every file is read."""
    shown = USERINFO.sub("***@", str(source))
    kind = source_kind(str(source), field)
    if kind == "hub":
        log.info(
            "data %s: a hub dataset id: its revision is not known before it is downloaded, so its tokenized records "
            "are not cached (save it with Dataset.save_to_disk and give that directory to cache them)", shown,
        )  # fmt: skip
        return None
    tok, why = tokenizer_identity(tokenizer)
    if tok is None:
        log.info("data %s: tokenized records not cached: %s", shown, why)
        return None
    content = _digest_dir(Path(source), stamps) if kind == "datasets" else _digest_file(Path(source), field, stamps)
    parts = {
        "format_version": str(FORMAT_VERSION),
        "source_kind": kind,
        "source_sha256": content[0],
        "source_sample": content[1],
        **{f"tokenizer.{k}": v for k, v in sorted(tok.items())},
        "max_seq_len": str(spec.max_seq_len),
        "format": spec.format,
        "prompt_field": spec.prompt_field,
        "response_field": spec.response_field,
        "messages_field": spec.messages_field,
        "splits": ",".join(splits),
    }
    if spec.text_field != "text":  # text records' field; left out at its default, so no other entry's key changes
        parts["text_field"] = spec.text_field
    if pairs:  # read as preference pairs (checked so when tokenized): never the entry an SFT run made of the same file
        parts["records"] = "pairs"
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode("utf-8")).hexdigest()
    return CacheKey(digest, parts, tokenizer.vocab_size, shown)


def tokenizer_identity(tokenizer: Tokenizer) -> tuple[dict[str, str] | None, str]:
    """(what decides the tokenizer's output, its `cache_identity()`; or None and why it cannot be named)."""
    identity = getattr(tokenizer, "cache_identity", None)
    if identity is None:
        return None, f"tokenizer {tokenizer.name} cannot name its state"
    try:
        return identity(), ""
    except TypeError as err:  # a slow tokenizer: no serialized state
        return None, str(err)


def _digest_file(path: Path, field: str, stamps: Path | None = None) -> tuple[str, str]:
    """(sha256, sampled digest) of a data file. The sampled digest (`_sampled`: the size and SAMPLE_BLOCKS blocks
    spread over the file) is read every time and enters the cache key beside the sha256. With `stamps`, a file whose
    identity and change times match the stamp written when it was last hashed (device, inode, size, mtime and ctime:
    ctime is the kernel's, no `touch` can set it back) and whose sampled digest matches the stamp's is not read
    again: a restart of a job on a 50 GB source takes a stat and 64 KiB, not minutes of reading. A stamp only saves
    time: one that names another file's sha256 (forged, or copied) still yields this file's sampled digest, so the
    key is no other data's; one that disagrees with the file is ignored and written again."""
    f, size = open_data(path, field)
    with f:
        st = os.fstat(f.fileno())
        identity = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
        name = f"source-{hashlib.sha256(str(identity[:2]).encode()).hexdigest()[:32]}.stamp"  # a file, not an entry
        stamp = stamps / name if stamps else None
        sample = _sampled(f, size)
        known = _read_stamp(stamp, identity, sample) if stamp is not None else None
        if known is not None:
            return known, sample
        digest = _sha256(f, size)
    if stamp is not None:
        _write_stamp(stamp, {"identity": identity, "sha256": digest, "sample": sample})
    return digest, sample


def sampled_digest(f: BinaryIO, size: int) -> str:
    """`_sampled`, for other files bound the same way (a model's weights: runner/train/reference.py)."""
    return _sampled(f, size)


def _sampled(f: BinaryIO, size: int) -> str:
    """sha256 over the file's size and SAMPLE_BLOCKS blocks of SAMPLE_BYTES at evenly spread offsets (the whole
    file when it is smaller): what binds a stamp and a cache key to this file's bytes without reading all of them."""
    h = hashlib.sha256(str(size).encode())
    span = SAMPLE_BLOCKS * SAMPLE_BYTES
    offsets = [0] if size <= span else [i * (size - SAMPLE_BYTES) // (SAMPLE_BLOCKS - 1) for i in range(SAMPLE_BLOCKS)]
    for offset in offsets:
        f.seek(offset)
        h.update(f.read(span if size <= span else SAMPLE_BYTES))
    f.seek(0)
    return h.hexdigest()


def _read_stamp(stamp: Path, identity: list[int], sample: str) -> str | None:
    """The digest a stamp holds for a file of exactly this `identity` and sampled digest (signed, when a key is
    set); None for any other (or a damaged) stamp."""
    record = _read_record(stamp, stamp.parent)  # None: none yet, or not a small regular file of JSON: hash the file
    if not isinstance(record, dict):
        return None
    digest = record.get("sha256")
    if record.get("identity") != identity or not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        return None
    if record.get("sample") != sample:
        log.info("digest stamp %s disagrees with the file it names: hashing the file and writing it again", stamp)
        return None
    return digest


def _write_stamp(stamp: Path, record: dict) -> None:
    """A stamp (signed when a key is set) written whole over `stamp` (jobspec.shared_dir: never through a link)."""
    try:
        secret = signing.key()
        record = signing.sign(record, secret) if secret is not None else record
        stamp.parent.mkdir(parents=True, exist_ok=True)
        shared_dir.write_atomic(stamp, json.dumps(record).encode(), fsync=False)
    except OSError as err:  # a read-only or full cache volume: the next start hashes again
        log.debug("digest stamp %s not written: %s", stamp, err)


def _digest_dir(root: Path, stamps: Path | None = None) -> tuple[str, str]:
    """Names and contents of the regular files of a datasets directory, in name order. Links and other files
    enter by their name and kind only (the reader refuses them anyway); `cache-*.arrow` files that a
    `Dataset.map` on the loaded set may leave there are not part of the data."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            path = Path(folder) / name
            if name.startswith("cache-") and name.endswith(".arrow"):
                continue
            h.update(str(path.relative_to(root)).encode("utf-8", "surrogateescape") + b"\0")
            if path.is_symlink() or not path.is_file():
                h.update(b"not a regular file\0")
                continue
            h.update("".join(_digest_file(path, "data file", stamps)).encode("ascii"))
    return h.hexdigest(), "in source_sha256"  # each file's sampled digest is in the directory's sha256


class Damaged(Exception):
    """A cache entry that fails a check: the file and what is wrong."""


def cached_streams(root: Path, key: CacheKey, build: Callable[[], Streams], wait_s: float = LOCK_WAIT_S) -> Streams:
    """The cached Streams of `key` under `root`, built by `build` and stored first when missing or damaged."""
    entry = root / key.digest
    found = _lookup(entry, key)
    if found is not None:
        return found
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = locked(root / f"{key.digest}.lock", wait_s)
        lock.__enter__()
    except OSError as err:
        log.warning("data %s: cache %s not usable (%s); tokenizing without it", key.source, root, err)
        return build()
    try:
        found = _lookup(entry, key)  # another process may have written it while this one waited
        if found is not None:
            return found
        log.info("data %s: tokenizing once into the cache %s", key.source, entry)
        streams = build()
        try:
            _write(root, entry, key, streams)
        except OSError as err:
            log.warning("data %s: could not write the cache %s (%s); using the records tokenized here", key.source,
                        entry, err)  # fmt: skip
            return streams
    finally:
        lock.__exit__(None, None, None)
    return _lookup(entry, key) or streams


def _lookup(entry: Path, key: CacheKey) -> Streams | None:
    if not os.path.lexists(entry):
        return None
    start = time.perf_counter()
    try:
        streams = read_entry(entry, key)
    except Damaged as err:
        log.warning("data %s: cache entry damaged, rebuilding it: %s", key.source, err)
        return None
    log.info("data %s: %d records, %d tokens from the cache %s (checked in %.1f s)", key.source, len(streams),
             len(streams.ids), entry, time.perf_counter() - start)  # fmt: skip
    return streams


def read_entry(entry: Path, key: CacheKey) -> Streams:
    """The entry's arrays memory-mapped read-only after every check of the module docstring; `Damaged` if one fails.

    The checks that read every byte (sha256, bounds rising, ids in the vocabulary) run once per entry: the reader that
    passed them leaves VERIFIED in the entry, the identity of each file it checked (device, inode, size, mtime and
    ctime: ctime is the kernel's, no write leaves it as it was), and a later reader whose files have exactly those
    identities skips them (a restart of every rank on a 10 GB cache: a stat per file, not seconds per rank). The
    checks of sizes, headers, dtypes and lengths run every time."""
    if entry.is_symlink() or not entry.is_dir():
        raise Damaged(f"{entry} is not a directory")
    names = [META, *(f"{name}.npy" for name in ARRAYS)]
    seen = _identities(entry, names)
    checked = {"identity": seen, "key": key.digest, "vocab_size": key.vocab_size}
    secret = signing.key()
    verified = seen is not None and _read_record(entry / VERIFIED, entry) == checked
    try:
        meta = json_loads(read_bounded(entry / META, MAX_META_BYTES, what="cache file", root=entry))
    except (ConfigError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise Damaged(f"{entry / META}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key.digest:
        raise Damaged(f"{entry / META}: not this format version and key")
    if meta.get("parts") != key.parts:  # the entry names the source digest and tokenizer it holds the tokens of
        raise Damaged(f"{entry / META}: made from other data or another tokenizer than its name says")
    if secret is not None and (unsigned := signing.problem(meta, secret, META)):
        raise Damaged(f"{entry / META}: {unsigned}")
    arrays = {name: _map(entry / f"{name}.npy", meta, allowed, hashed=not verified) for name, allowed in ARRAYS.items()}
    ids, flags, bounds, trainable = arrays["ids"], arrays["flags"], arrays["bounds"], arrays["trainable"]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != len(ids):
        raise Damaged(f"{entry / 'bounds.npy'}: record bounds do not run from 0 to the {len(ids)} tokens")
    if len(flags) != len(ids) or len(trainable) != len(bounds) - 1:
        raise Damaged(f"{entry}: arrays of mismatched lengths (flags {len(flags)}, ids {len(ids)})")
    if not (verified and secret is not None):  # an unsigned stamp may be forged: it saves the sha256 pass only
        if np.any(bounds[1:] < bounds[:-1]):
            raise Damaged(f"{entry / 'bounds.npy'}: record bounds do not rise from 0 to the {len(ids)} tokens")
        if len(ids) and (int(ids.max()) >= key.vocab_size or int(ids.min()) < 0):
            raise Damaged(f"{entry / 'ids.npy'}: token ids outside the vocabulary of {key.vocab_size}")
        if not verified and seen is not None and _identities(entry, names) == seen:  # unchanged while checked
            _write_stamp(entry / VERIFIED, checked)
    return Streams(ids, flags, bounds, trainable)


def _identities(entry: Path, names: Sequence[str]) -> dict[str, list[int]] | None:
    """name -> [device, inode, size, mtime_ns, ctime_ns] of each regular file; None if one is missing or not one."""
    out = {}
    for name in names:
        try:
            st = os.lstat(entry / name)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        out[name] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def _read_record(path: Path, root: Path) -> object:
    """A small JSON record (a stamp), without its signature; None when there is none, or not a small regular file of
    JSON, or (a key set) not signed with the key."""
    secret = signing.key()
    try:
        record = json_loads(read_bounded(path, 4096, what="cache stamp", root=root, follow=False), max_depth=8)
    except (OSError, ValueError, ConfigError):
        return None
    if secret is not None and (not isinstance(record, dict) or signing.problem(record, secret, path.name)):
        return None
    return {k: v for k, v in record.items() if k != signing.FIELD} if isinstance(record, dict) else record


def _map(path: Path, meta: dict, allowed: tuple[str, ...], *, hashed: bool = True) -> np.ndarray:
    """One .npy file of the entry: size and (`hashed`) sha256 as meta.json says, a 1-D array of an allowed dtype,
    mapped."""
    info = meta.get("arrays", {}).get(path.stem) if isinstance(meta.get("arrays"), dict) else None
    if not isinstance(info, dict) or info.get("dtype") not in allowed:
        raise Damaged(f"{path}: meta.json does not describe it")
    try:
        f = open_regular(path, what="cache file", root=path.parent)
    except ConfigError as err:
        raise Damaged(str(err)) from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != info.get("bytes"):
            raise Damaged(f"{path}: {size} bytes, meta.json says {info.get('bytes')}")
        if hashed and _sha256(f, size) != info.get("sha256"):
            raise Damaged(f"{path}: sha256 differs from meta.json's")
        f.seek(0)
        try:
            version = npy.read_magic(f)
            read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
            if read_header is None:
                raise ValueError(f"npy format version {version}")
            shape, fortran, dtype = read_header(f, max_header_size=10_000)
        except (ValueError, SyntaxError, TypeError) as err:
            raise Damaged(f"{path}: not a .npy array ({err})") from None
        count = shape[0] if len(shape) == 1 else -1
        if dtype != np.dtype(info["dtype"]) or fortran or count != info.get("length"):
            raise Damaged(f"{path}: {dtype}{list(shape)}, meta.json says {info['dtype']}[{info.get('length')}]")
        offset = f.tell()
        if offset + count * dtype.itemsize != size:
            raise Damaged(f"{path}: {size} bytes do not hold {count} values of {dtype}")
        if count == 0:
            return np.zeros(0, dtype)
        return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=(count,))


def _sha256(f: BinaryIO, size: int) -> str:
    """The sha256 of the file's first `size` bytes, read with readinto() into one reused buffer: no new block
    per read that the allocator could keep resident afterwards, and read(), not the map, so the pages go to
    the page cache without counting as this process's memory."""
    h, buffer = hashlib.sha256(), bytearray(READ_BLOCK)
    view = memoryview(buffer)
    f.seek(0)
    while size > 0 and (n := f.readinto(view[: min(READ_BLOCK, size)])):  # type: ignore[attr-defined]
        h.update(view[:n])
        size -= n
    return h.hexdigest()


def _write(root: Path, entry: Path, key: CacheKey, streams: Streams) -> None:
    """The entry written in a temp directory (each file fsynced), renamed into place; the lock is held. Every file is
    created exclusively in a directory made here with a random name (jobspec.shared_dir)."""
    for stale in root.glob(f".tmp-{key.digest}-*"):  # a writer that died: the lock says none is writing
        shutil.rmtree(stale, ignore_errors=True)  # a link there is not followed (rmtree refuses one)
    tmp = shared_dir.make_temp_dir(root, f".tmp-{key.digest}-")
    try:
        arrays = {}
        for name in ARRAYS:
            array = np.ascontiguousarray(getattr(streams, name))
            with shared_dir.create(tmp / f"{name}.npy") as f:
                np.save(f, array, allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            with open_regular(tmp / f"{name}.npy", what="cache file") as f:
                size = os.fstat(f.fileno()).st_size
                arrays[name] = {"dtype": str(array.dtype), "length": len(array), "bytes": size,
                                "sha256": _sha256(f, size)}  # fmt: skip
        meta = {"format_version": FORMAT_VERSION, "key": key.digest, "parts": key.parts, "source": key.source,
                "records": len(streams), "tokens": len(streams.ids), "arrays": arrays,
                "packing": "not in the key: rows are packed from these records when loaded",
                "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        secret = signing.key()
        meta = signing.sign(meta, secret) if secret is not None else meta
        with shared_dir.create(tmp / META) as f:
            f.write(json.dumps(meta, indent=1, sort_keys=True).encode())
            f.flush()
            os.fsync(f.fileno())
        shared_dir.fsync_dir(tmp)
        install(root, tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("data %s: cached %d records, %d tokens in %s", key.source, len(streams), len(streams.ids), entry)


def install(root: Path, tmp: Path, entry: Path) -> None:
    """The finished temp directory `tmp` renamed to `entry` (both in `root`, under the entry's lock): what is there
    (a damaged entry, a name planted there) moved aside whole first, then removed; never followed."""
    if os.path.lexists(entry):
        aside = root / f".tmp-{entry.name}-damaged-{shared_dir.temp_name('entry')[1:]}"
        shared_dir.replace(entry, aside)
        if aside.is_dir() and not aside.is_symlink():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.unlink()
    os.rename(tmp, entry)  # a directory renamed onto a free name: nothing there to follow
    shared_dir.fsync_dir(root)


@contextlib.contextmanager
def locked(path: Path, wait_s: float, doing: str = "tokenizing this source") -> Iterator[None]:
    """An exclusive flock on `path` (created), waited for up to `wait_s` seconds (then ConfigError: the holder has
    been `doing` it for too long); the holder's name is in it."""
    fd = shared_dir.open_lock(path)  # a link or a FIFO planted at the name is refused, never written through
    try:
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited > wait_s:
                    holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
                    raise ConfigError(
                        f"data cache {path}: {holder} has been {doing} for over {waited:.0f} s "
                        f"(LOCK_WAIT_S {wait_s:.0f} s); if it is stuck, stop it, or set data.cache_dir to another "
                        "directory"
                    ) from None
                if not told:
                    log.info("data cache %s: another process is %s; waiting for it", path, doing)
                    told = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock
