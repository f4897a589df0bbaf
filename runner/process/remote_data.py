"""Data sources in an object store (`data.path: s3://bucket/chat.jsonl`, or `gs://`), downloaded once per node by the
supervisor, through the store's requests (runner/checkpoint/stores.py: S3 and GCS behind one interface).

`localize(spec)` runs in the supervisor before any worker starts (as runner/process/hub.py does for a hub model): every
`s3://` or `gs://` source of the spec (`data.path`, `data.sources[i].path`, `data.eval_path`; one object, or a prefix
ending in '/': every object under it, a datasets save_to_disk directory) is downloaded into the node's data cache
(`data.cache_dir`, default `<run dir>/data-cache`, runner/data/cache.py) and the workers get the local copy's path as
`--set` overrides. From there the local file is read as any other: the tokenized-data cache (keyed by content),
several sources, streaming, exact resume and the lineage work unchanged (the lineage names the local copy, whose name
holds the object's version: a resume across a changed object is refused as a change of data).

    <cache root>/objects/<url digest>-<version digest>/
        object.json   the URL, each object's name, size, tag (ETag; GCS: generation) and VersionId, and each local
                      file's identity (device, inode, size, mtime, ctime); signed with JOBSPEC_CHECKPOINT_KEY when
                      it is set
        <name>        the object (chat.jsonl), or the prefix's objects under a directory named as the prefix

The version digest is over the URL and every object's (name, size, ETag, VersionId), read with one HEAD (or one
listing) at every start: an unchanged object is not read again (no GET), a changed one (new ETag) is downloaded into a
new entry and the entries of its older versions are removed (those no job chose in the last OLDER_KEPT_S). A copy is
used only when object.json is this version's and every file has the identity recorded when it was written (a file
written over since has another ctime); anything else is downloaded again. The cache is shared: the download runs under
an exclusive lock on `objects/<entry>.lock` (runner/data/cache.py `locked`): the first process downloads, the others
(another pod on a shared cache volume, another job) wait and then use its copy. Files are written through
jobspec.shared_dir: an exclusively created temp directory, each object fetched by ranged GETs with `If-Match: <ETag>`
(and the VersionId; GCS: `generation=<generation>`) so an object replaced meanwhile is never mixed (412, or the
generation gone: listed again and downloaded again, at most ATTEMPTS times), fsynced, then listed once more (a store
that ignores the pin is caught there: a version not the one read is downloaded again), then renamed into place; no
link followed.

Bounds: one source has at most MAX_BYTES (and a prefix MAX_OBJECTS objects), and the cache's volume must have room
for it before a byte is written. Errors: no bucket, no object, access denied, too large: ConfigError (exit 2) naming
the field, the URL (which never holds credentials) and the fix; no room: StorageError; the store unreachable or
failing after its client's retries: RemoteUnavailable (exit 1, retried by the Job, as for checkpoints).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from jobspec import shared_dir
from jobspec.errors import ConfigError, JobspecError
from jobspec.shared_dir import signing
from jobspec.spec import object_store
from jobspec.spec.models import JobSpec
from jobspec.untrusted import json_loads, read_bounded
from runner.checkpoint import stores
from runner.checkpoint.remote import RemoteUnavailable, brief
from runner.checkpoint.storage import MARGIN, StorageError, free_bytes
from runner.data.cache import LOCK_WAIT_S, install, locked, usable_root

log = logging.getLogger("jobspec.runner")
MAX_BYTES = 64 * 2**30  # one source: what a node downloads before it trains (larger: a volume, data.pvc)
MAX_OBJECTS = 10_000  # objects under one prefix
PART = 16 * 2**20  # bytes per ranged GET
THREADS = 8  # ranged GETs at once: THREADS * PART bytes in memory at most
ATTEMPTS = 3  # downloads of a source whose object changed while it was read
OBJECTS = "objects"  # under the data cache root
META = "object.json"
MAX_META_BYTES = 4 * 2**20  # MAX_OBJECTS names, sizes and ETags
FORMAT = 1
OLDER_KEPT_S = 3600.0  # a copy of an older version chosen more recently is left (a job may be about to open it)
_NAME = re.compile(r"^[A-Za-z0-9_.=+@,-][A-Za-z0-9_.=+@, -]*$")  # one part of an object's name under a prefix


class Obj(NamedTuple):
    name: str  # relative to the prefix ('' for a single object)
    key: str
    size: int
    etag: str
    version: str | None


def sources(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, URL) of every object-store data source of `spec`; the field is the spec's path to it (an override)."""
    d = spec.data
    named = [("data.path", d.path), *((f"data.sources.{i}.path", s.path) for i, s in enumerate(d.sources or ())),
             ("data.eval_path", d.eval_path)]  # fmt: skip
    return [(field, path) for field, path in named if path and object_store.is_url(path)]


def localize(spec: JobSpec) -> list[str]:
    """Every object-store source of `spec` downloaded into this node's data cache (or found there): `--set` overrides
    (`data.path=<local copy>`) for the workers; [] when the spec has none."""
    named = sources(spec)
    if not named:
        return []
    root = usable_root(spec)
    if root is None:
        raise ConfigError(f"{named[0][0]} {named[0][1]}: the data cache {spec.data.cache_dir or spec.run_dir} is not "
                          "usable (see the warning above), and object-store data is downloaded there: set "
                          "data.cache_dir to a directory of its own")  # fmt: skip
    root = shared_dir.directory(Path(root).absolute() / OBJECTS)
    clients: dict[str, stores.Store] = {}  # one per scheme: sources may be on S3 and on GCS
    local: dict[str, Path] = {}
    for field, url in named:
        scheme = url.split("://", 1)[0]
        if scheme not in clients:
            clients[scheme] = stores.open_store(scheme, f"{field} {url}")
        if url not in local:
            local[url] = fetch(clients[scheme], url, field, root)
    return [f"{field}={json.dumps(str(local[url]))}" for field, url in named]  # quoted: read as YAML


def fetch(store: stores.Store, url: str, field: str, root: Path) -> Path:
    """The local copy of the source `url` (`field` names it in errors) under the objects directory `root`."""
    where = object_store.parse(url)
    assert where is not None  # the spec's validation: an s3:// or gs:// URL without credentials
    for attempt in range(1, ATTEMPTS + 1):
        objs = _listing(store, where, url, field)
        try:
            return _fetch_version(store, where, url, field, root, objs)
        except stores.Changed:
            log.warning("%s %s changed while it was downloaded (attempt %d of %d): reading it again", field, url,
                        attempt, ATTEMPTS)  # fmt: skip
    raise RemoteUnavailable(f"{field} {url} kept changing while it was downloaded ({ATTEMPTS} attempts): upload it "
                            "once and leave it, or point the spec at a versioned copy")  # fmt: skip


def _fetch_version(store: stores.Store, where: object_store.ObjectUrl, url: str, field: str, root: Path,
                   objs: list[Obj]) -> Path:  # fmt: skip
    ident = {"format": FORMAT, "url": url, "objects": [list(o[:1]) + list(o[2:]) for o in objs]}
    url_digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    entry = root / f"{url_digest}-{hashlib.sha256(_canonical(ident)).hexdigest()[:32]}"
    name = where.key.rsplit("/", 1)[-1]
    total = sum(o.size for o in objs)
    shown = f"{field} {url} ({_version(objs, store.tag_name)}, {total:,} bytes)"
    if _intact(entry, ident, name, quiet=True):
        log.info("%s: this node's copy %s, not downloaded again", shown, entry / name)
        _used(entry)
        return entry / name
    if total > MAX_BYTES:
        raise ConfigError(f"{field} {url} holds {total:,} bytes, more than {MAX_BYTES:,} ({MAX_BYTES / 2**30:g} "
                          "GiB, MAX_BYTES) a node downloads before it trains: split it into several objects "
                          "(data.sources), or put it on a volume (data.pvc) and read it from there "
                          "(data.streaming)")  # fmt: skip
    with locked(root / f"{entry.name}.lock", LOCK_WAIT_S, doing=f"downloading {url}"):
        if _intact(entry, ident, name, quiet=False):  # downloaded by another process while this one waited
            log.info("%s: this node's copy %s, downloaded by another process", shown, entry / name)
            _used(entry)
            return entry / name
        for stale in root.glob(f".tmp-{entry.name}-*"):  # a download that died: the lock says none is running
            shutil.rmtree(stale, ignore_errors=True)
        free = free_bytes(root)
        if free < total * MARGIN:
            raise StorageError(f"{field} {url}: {total:,} bytes to download into the data cache {root.parent}, "
                               f"{free:,} free there: give data.cache_dir a volume with room (or free it)")  # fmt: skip
        log.info("%s: downloading into %s", shown, entry / name)
        start = time.perf_counter()
        tmp = shared_dir.make_temp_dir(root, f".tmp-{entry.name}-")
        try:
            _download(store, where, field, url, objs, tmp / name)
            record = {**ident, "files": _identities(tmp / name, objs)}
            secret = signing.key()
            shared_dir.write_atomic(tmp / META, _canonical(signing.sign(record, secret) if secret else record))
            shared_dir.fsync_dir(tmp)
            install(root, tmp, entry)  # a damaged copy there, or a name planted there: moved aside, removed
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    took = time.perf_counter() - start
    log.info("%s: downloaded in %.1f s (%.0f MB/s)", shown, took, total / max(took, 1e-6) / 1e6)
    _remove_older(root, url_digest, entry)
    return entry / name


def _version(objs: list[Obj], tag_name: str) -> str:
    if len(objs) == 1:
        v = f", VersionId {objs[0].version}" if objs[0].version else ""
        return f"{tag_name} {objs[0].etag}{v}"
    return f"{len(objs)} objects"


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


# --- the store ----------------------------------------------------------------------------------------------------


def _call(store: stores.Store, field: str, url: str, bucket: str, key: str, request: Any, *args: Any) -> Any:
    """`request(*args)`, one of the store's requests (its client's retries): a refusal as ConfigError naming `field`,
    `url` and the fix, a store that cannot be reached as RemoteUnavailable, a pinned read of a replaced version as
    stores.Changed."""
    try:
        return request(*args)
    except PermissionError:
        raise ConfigError(f"{field} {url}: access denied: {store.credentials} must be allowed to read bucket "
                          f"{bucket!r} ({store.read_rights})") from None  # fmt: skip
    except FileNotFoundError as err:
        if not key or store.no_bucket(err, bucket) or not _bucket_exists(store, bucket):
            raise ConfigError(f"{field} {url}: no bucket {bucket!r} at this endpoint ({store.endpoint}): create it "
                              "and upload the data, or fix the URL") from None  # fmt: skip
        raise ConfigError(f"{field} {url}: no object {key!r} in bucket {bucket!r}: upload it, or fix the URL "
                          f"({store.cli} ls {store.scheme}://{bucket}/ lists what is there)") from None  # fmt: skip
    except (JobspecError, stores.Changed):
        raise
    except Exception as err:  # OSError from the clients, their connection errors: after their retries
        raise RemoteUnavailable(f"{field} {url}: the object store did not answer or failed ({brief(err)}); the "
                                "Job retries") from None  # fmt: skip


def _bucket_exists(store: stores.Store, bucket: str) -> bool:
    try:
        store.check_bucket(bucket)
    except FileNotFoundError:
        return False
    except Exception:  # forbidden, or not answering: the object's own error is the one to tell
        return True
    return True


def _listing(store: stores.Store, where: object_store.ObjectUrl, url: str, field: str) -> list[Obj]:
    """The objects of the source as the store has them now: one HEAD, or the listing of a prefix (bounded)."""
    if not url.endswith("/"):
        head = _call(store, field, url, where.bucket, where.key, store.head, where.bucket, where.key)
        return [Obj("", where.key, head.size, head.tag, head.version)]
    prefix, objs = where.key + "/", []

    def listed() -> None:
        for key, head in store.listing(where.bucket, prefix):
            name = key[len(prefix) :]
            if not name or name.endswith("/"):  # the prefix's own marker, a "folder"
                continue
            parts = name.split("/")
            if any(p in (".", "..") or not _NAME.match(p) for p in parts):
                raise ConfigError(f"{field} {url}: object {key[:200]!r} has a name that cannot be a local file "
                                  "(letters, digits and _ . = + @ , - only, no '..'): rename it, or give one "
                                  "object's URL")  # fmt: skip
            objs.append(Obj(name, key, head.size, head.tag, None))
            if len(objs) > MAX_OBJECTS:
                raise ConfigError(f"{field} {url}: more than {MAX_OBJECTS:,} objects under the prefix: a data set of "
                                  "fewer, larger files (save_to_disk's shards), or several sources")  # fmt: skip

    _call(store, field, url, where.bucket, "", listed)
    if not objs:
        raise ConfigError(f"{field} {url}: no objects under the prefix in bucket {where.bucket!r}: upload the data "
                          "set (Dataset.save_to_disk's directory), or fix the URL")  # fmt: skip
    return sorted(objs)


def _download(store: stores.Store, where: object_store.ObjectUrl, field: str, url: str, objs: list[Obj],
              local: Path) -> None:  # fmt: skip
    """Each object into its new file under `local` (the file itself for a single object), by ranged GETs pinned to
    the listed version (S3: If-Match on the ETag, and the VersionId; GCS: the generation), THREADS at once; each file
    fsynced. Then the listing again: an object whose version is not the listed one now may have been mixed on a store
    that ignores the pin (stores.Changed, as a refused pin: listed and downloaded again)."""
    files: dict[str, Any] = {}
    try:
        for o in objs:
            path = local.joinpath(*o.name.split("/")) if o.name else local
            path.parent.mkdir(parents=True, exist_ok=True)
            files[o.key] = shared_dir.create(path)
        parts = [(o, start) for o in objs for start in range(0, o.size, PART)]

        def part(item: tuple[Obj, int]) -> None:
            o, start = item
            end = min(start + PART, o.size)
            pin = stores.Head(o.size, o.etag, o.version)
            data = _call(store, field, url, where.bucket, o.key, store.read_range, where.bucket, o.key, start, end, pin)
            if len(data) != end - start:
                raise RemoteUnavailable(f"{field} {url}: {o.key!r} gave {len(data):,} bytes at {start:,}, "
                                        f"{end - start:,} were asked; the Job retries")  # fmt: skip
            os.pwrite(files[o.key].fileno(), data, start)

        with ThreadPoolExecutor(max_workers=max(1, min(THREADS, len(parts)))) as pool:
            list(pool.map(part, parts))
        for f in files.values():
            os.fsync(f.fileno())
    finally:
        for f in files.values():
            f.close()
    if _listing(store, where, url, field) != objs:  # replaced after its last part was read, or on a store that
        raise stores.Changed()  # serves the current version whatever the pin names (gcp-storage-emulator does)


# --- the local copy -----------------------------------------------------------------------------------------------


def _identities(local: Path, objs: list[Obj]) -> dict[str, list[int]]:
    """name -> [device, inode, size, mtime_ns, ctime_ns] of each downloaded file (ValueError: one is not whole)."""
    out = {}
    for o in objs:
        st = shared_dir.lstat_regular(local.joinpath(*o.name.split("/")) if o.name else local)
        if st is None or st.st_size != o.size:
            raise ValueError(f"{o.key}: not written whole")
        out[o.name] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def _intact(entry: Path, ident: dict[str, Any], name: str, *, quiet: bool) -> bool:
    """Whether `entry` holds this version whole, as it was written (module docstring); a reason logged otherwise."""
    if not os.path.lexists(entry):
        return False
    why = None
    try:
        if entry.is_symlink() or not entry.is_dir():
            why = "not a directory of its own"
        else:
            record = json_loads(read_bounded(entry / META, MAX_META_BYTES, what="object record", root=entry))
            secret = signing.key()
            if not isinstance(record, dict) or {k: record.get(k) for k in ident} != ident:
                why = f"{META} is not this object's version"
            elif secret is not None and (unsigned := signing.problem(record, secret, META)):
                why = unsigned
            else:
                objs = [Obj(o[0], "", o[1], o[2], o[3]) for o in ident["objects"]]
                if _identities(entry / name, objs) != record.get("files"):
                    why = "a file changed since it was downloaded"
    except (OSError, ValueError, ConfigError) as err:
        why = str(err)[:300]
    if why and not quiet:
        log.warning("data cache %s: %s: downloading it again", entry, why)
    return why is None


def _remove_older(root: Path, url_digest: str, keep: Path) -> None:
    """The copies of older versions of the same URL (the object changed) neither written nor chosen (`_used`) in the
    last OLDER_KEPT_S: a job that chose one just now (its workers about to open it) keeps it; one reading it keeps its
    open files (POSIX), and its restart lists the object again and finds this version."""
    for old in root.glob(f"{url_digest}-*"):
        st = shared_dir.lstat_regular(old / META)
        if old == keep or old.is_symlink() or not old.is_dir() or (st and time.time() - st.st_mtime < OLDER_KEPT_S):
            continue
        log.info("data cache: removing %s, an older version of the same object", old)
        shutil.rmtree(old, ignore_errors=True)


def _used(entry: Path) -> None:
    """Mark the copy as chosen now (its record's mtime: what _remove_older reads)."""
    with contextlib.suppress(OSError):
        os.utime(entry / META, follow_symlinks=False)
