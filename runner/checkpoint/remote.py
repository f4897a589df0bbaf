"""Checkpoints in an object store (`checkpoints.dir: s3://bucket/prefix`, or `gs://`): staged on local disk,
published there through the store's requests (stores.py: S3 and GCS behind one interface).

    s3://bucket/prefix/  (gs://bucket/prefix/)
        step-<N>/<file>   the files of a local step-N (store.py): shards, rng-<rank>.pt, .metadata, meta.json,
                          spec.yaml; then manifest.json, once every other file is there; then DONE, last
        lease.json        the run's lease (lease.py), written with conditional requests (`RemoteLeaseFile`)
        model/...         the exported model, when the spec sets no output.dir

Save (`publish`, collective, right after store.save wrote step-N into the local run directory,
`checkpoints.local_dir`): rank 0 deletes what the bucket holds under step-N/ (DONE first); every rank uploads the
files it wrote (its shards and RNG state, from its own node's disk); rank 0 uploads the rest, then manifest.json,
then DONE, then prunes the bucket to `checkpoints.keep`. Each phase runs after the fence (the gang's heartbeat and
the lease: a rank of a superseded attempt uploads nothing) and ends in an agreement: an upload that fails on any
rank fails it on every rank (RemoteUnavailable, retryable; StorageError when the store refuses: no bucket, access
denied). An object store's PUT is whole or absent, so a step is published when its DONE object is there and
complete then: a killed upload leaves a step without DONE, which no reader takes and a later prune removes.

Resume (`fetch`, collective, before store.resume_point): rank 0 lists the complete steps, newest first, and
downloads each into the local run directory: the manifest within manifest.MAX_BYTES, then only the names it lists,
each one checked to have the size the manifest gives before a byte is read and read no further; then store.verify
checks the copy exactly as a local checkpoint (sizes, checksums, signature when JOBSPEC_CHECKPOINT_KEY is set, the
pickles without running code). A damaged step is logged and skipped (left in the bucket: a later save of that step
replaces it, a prune removes it once older than the kept ones) and the next older one tried. Every local step
directory but the chosen one is removed: the bucket is the truth. Ranks on other nodes then download that step and
verify it too. `export_source` does the same for `jobspec export s3://...` (or gs://).

What the store cannot give: a rename. A writer that passed its last fence and then stalled past the lease timeout
can still overwrite objects of a step (the fence is a check before each phase, not a token the store enforces);
what it writes then is found by the manifest's checksums at resume, and the step is skipped as damaged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from jobspec import shared_dir
from jobspec.contract import EXIT_FAILED
from jobspec.errors import ConfigError, JobspecError
from jobspec.spec.object_store import ObjectUrl, parse, redacted
from jobspec.untrusted import json_loads
from runner.checkpoint import lease, manifest, storage, store, stores
from runner.checkpoint.files import plain_name
from runner.checkpoint.storage import StorageError
from runner.checkpoint.stores import brief
from runner.dist import Control

log = logging.getLogger("jobspec.runner")
MAX_FILES = 200_000  # names one manifest may list: 50x a 2048-rank checkpoint
_THREADS = 8  # objects moved at once
_CHUNK = 8 * 2**20
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rng-(\d+)\.pt)$")  # the files each rank writes itself
_STEP_KEY = re.compile(r"^step-(\d+)/(.+)$")
MODEL_DIR = "model"


class RemoteUnavailable(JobspecError):
    """The object store did not answer, or failed, after its client's retries: retryable (the Job restarts the pod,
    which resumes from the newest step the bucket holds)."""

    exit_code = EXIT_FAILED


class Bucket:
    """`checkpoints.dir` in its object store: the few operations the checkpoints need, every read bounded."""

    def __init__(self, url: ObjectUrl | str, store: stores.Store | None = None):
        self.url = parse(url) if isinstance(url, str) else url
        if self.url is None:
            raise ValueError(f"{url!r} is not an object-store URL")
        self.store = store if store is not None else stores.open_store(self.url.scheme, f"checkpoints.dir {self.url}")
        self.fs = self.store.fs  # fsspec's generic calls: put_file, open, exists, rm, find

    def __str__(self) -> str:
        return str(self.url)

    def uri(self, *parts: str) -> str:
        return f"{self.url.scheme}://{self.url.join(*parts)}"

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.url.key, *parts) if p)

    def check(self) -> None:
        """ConfigError when the bucket is not there or these credentials may not use it (names neither secret)."""
        try:
            self.store.check_bucket(self.url.bucket)
        except PermissionError:
            raise ConfigError(f"checkpoints.dir {self}: access denied to bucket {self.url.bucket!r}: check "
                              f"{self.store.credentials}") from None  # fmt: skip
        except FileNotFoundError:
            raise ConfigError(f"checkpoints.dir {self}: no bucket {self.url.bucket!r} at this endpoint "
                              f"({self.store.endpoint}): create it, or fix the name") from None  # fmt: skip
        except Exception as err:  # OSError, the clients' connection errors: after their retries
            raise RemoteUnavailable(f"checkpoints.dir {self}: the object store did not answer ({brief(err)})") from None

    # --- objects ----------------------------------------------------------------------------------------------

    def put_bytes(self, data: bytes, *parts: str, if_none_match: bool = False,
                  if_match: str | None = None) -> str | None:  # fmt: skip
        """Write the object; its tag (ETag, generation), or None when a condition (`if_none_match`: none there;
        `if_match`: that tag there) did not hold."""
        return self.store.put(self.url.bucket, self.key(*parts), data, if_absent=if_none_match, if_tag=if_match)

    def get_bytes(self, limit: int, *parts: str) -> tuple[bytes, str] | None:
        """(content, tag) of the object, read no further than `limit` bytes (ValueError beyond); None when there is
        none."""
        try:
            return self.store.get(self.url.bucket, self.key(*parts), limit)
        except ValueError as err:
            raise ValueError(f"{self.uri(*parts)} {err}") from None

    def put_file(self, local: Path, *parts: str) -> None:
        self.fs.put_file(str(local), self.url.join(*parts))

    def download(self, size: int, local: Path, *parts: str) -> str | None:
        """Copy the object into the new file `local` if it has exactly `size` bytes, reading no more; else the
        problem ("X is missing", "X has N bytes in the bucket, M were written")."""
        name = parts[-1]
        try:
            f = self.fs.open(self.url.join(*parts), "rb", cache_type="none", block_size=_CHUNK)
        except FileNotFoundError:
            return f"{name} is missing"
        with f, shared_dir.create(local) as out:
            if f.size != size:
                return f"{name} has {f.size} bytes in the bucket, {size} were written (truncated or overwritten)"
            left = size
            while left > 0:
                data = f.read(min(_CHUNK, left))
                if not data:
                    return f"{name} ended at byte {size - left} of {size} while it was read"
                out.write(data)
                left -= len(data)
        return None

    def exists(self, *parts: str) -> bool:
        return bool(self.fs.exists(self.url.join(*parts)))

    def delete(self, *parts: str, if_match: str | None = None) -> None:
        self.store.delete(self.url.bucket, self.key(*parts), if_tag=if_match)

    def delete_tree(self, *parts: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.url.join(*parts), recursive=True)

    def names(self) -> list[str]:
        """Every object's name under the prefix, relative to it."""
        root = self.url.join()
        try:
            found = self.fs.find(root)
        except FileNotFoundError:
            return []
        return [p[len(root) + 1:] for p in found if p.startswith(root + "/")]

    def steps(self) -> tuple[list[int], list[int]]:
        """(complete steps: a DONE object, oldest first; every step with any object)."""
        done, seen = set(), set()
        for name in self.names():
            m = _STEP_KEY.match(name)
            if m:
                seen.add(int(m.group(1)))
                if m.group(2) == store.DONE:
                    done.add(int(m.group(1)))
        return sorted(done), sorted(seen)


def _failure(err: BaseException, bucket: Bucket) -> JobspecError:
    """An object-store client's error while writing the checkpoint, as what it means for the Job."""
    if isinstance(err, JobspecError):
        return err
    if isinstance(err, PermissionError) or bucket.store.no_bucket(err, bucket.url.bucket):
        return StorageError(f"cannot write checkpoints to {bucket}: {brief(err)}. Check the bucket exists and the "
                            "credentials from the pod's Secret may write it")  # fmt: skip
    return RemoteUnavailable(f"publishing a checkpoint to {bucket} failed after retries: {brief(err)}")


# --- the lease ----------------------------------------------------------------------------------------------------


class RemoteLeaseFile(lease.LeaseFile):
    """The lease record as the object `<prefix>/lease.json`: created with `If-None-Match: *` (GCS:
    `ifGenerationMatch=0`; one of two runs that start at once wins), renewed and taken over with `If-Match: <the ETag
    it read>` (GCS: `ifGenerationMatch=<the generation it read>`; a renewal after a takeover, or two takeovers at once,
    fail instead of overwriting), removed with the same condition. `etag` holds the tag: ETag or generation."""

    def __init__(self, bucket: Bucket):
        super().__init__(Path(lease.LEASE_FILE))
        self.bucket = bucket
        self.etag: str | None = None  # of the record this process last read or wrote
        self.honoured: bool | None = None  # whether the store refuses a second exclusive create

    def __str__(self) -> str:
        return self.bucket.uri(lease.LEASE_FILE)

    def prepare(self) -> None:
        self.bucket.check()

    def create(self, data: bytes) -> bool:
        if not self.honoured and self.exists():  # a store not known to honour the condition would overwrite it
            return False
        etag = self.bucket.put_bytes(data, lease.LEASE_FILE, if_none_match=True)
        if etag is None:
            return False
        self.etag = etag
        if self.honoured is None:  # the same record once more: a store that ignores the condition overwrites it
            self.honoured = self.bucket.put_bytes(data, lease.LEASE_FILE, if_none_match=True) is None
            if not self.honoured:
                self.etag = self._read_etag()
                log.warning("%s ignores conditional writes (%s): the lease cannot keep two runs that start within "
                            "the same second out of one prefix", self.bucket, self.bucket.store.create_condition)
        return True

    def _read_etag(self) -> str | None:
        self.read()
        return self.etag

    def replace(self, data: bytes, seen: str | None) -> bool:
        """A conditional write on the lease's etag as last read: refused when anyone wrote it since (`seen`, the
        holder that read found, is what the etag stands for)."""
        if self.etag is None:
            return False
        etag = self.bucket.put_bytes(data, lease.LEASE_FILE, if_match=self.etag)
        if etag is None:
            return False
        self.etag = etag
        return True

    def read(self) -> dict[str, Any] | None:
        try:
            got = self.bucket.get_bytes(lease.MAX_BYTES, lease.LEASE_FILE)
        except ValueError:
            return None
        if got is None:
            self.etag = None
            return None
        data, self.etag = got
        try:
            return lease._clean(json_loads(data))
        except ValueError:
            return None

    def exists(self) -> bool:
        return self.bucket.exists(lease.LEASE_FILE)

    def remove(self) -> None:
        self.bucket.delete(lease.LEASE_FILE, if_match=self.etag)


# --- save ---------------------------------------------------------------------------------------------------------


def _agree(ctrl: Control, bucket: Bucket, part: Any) -> None:
    """Run this rank's `part`; then every rank raises when it failed on any (StorageError wins, else
    RemoteUnavailable), each with its own message or "on another rank"."""
    failure: JobspecError | None = None
    try:
        part()
    except (lease.LeaseLost, lease.Superseded):
        raise
    except (OSError, ValueError, JobspecError) as err:
        failure = _failure(err, bucket)
    code = 2.0 if isinstance(failure, StorageError) else 1.0 if failure is not None else 0.0
    worst = ctrl.all_reduce([code], "max")[0]
    if worst == 2.0:
        raise failure if isinstance(failure, StorageError) else StorageError(
            f"publishing a checkpoint to {bucket} failed on another rank (see its log)")
    if worst == 1.0:
        raise failure or RemoteUnavailable(f"publishing a checkpoint to {bucket} failed on another rank (see its log)")


def publish(bucket: Bucket, root: Path, step: int, *, rank: int, ctrl: Control, keep: int, attempt: str,
            fence: Any = lambda: None) -> None:  # fmt: skip
    """Upload step-`step`, which store.save has just written under the local `root` (collective; module docstring)."""
    name = f"step-{step}"
    final, tmp = root / name, store.temp_dir(root, step, attempt)  # tmp: where a node other than rank 0's wrote
    fence()
    _agree(ctrl, bucket, lambda: _clear_step(bucket, name) if rank == 0 else None)

    def mine() -> None:
        here = tmp if (tmp / f"rng-{rank}.pt").is_file() else final  # a node other than rank 0's keeps its temp dir
        own = [p for p in sorted(here.iterdir()) if _owner(p.name) == rank]
        with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(own)))) as pool:
            list(pool.map(lambda p: bucket.put_file(p, name, p.name), own))

    fence()
    _agree(ctrl, bucket, mine)

    def finish() -> None:
        listed = json.loads((final / manifest.MANIFEST).read_bytes())["files"]
        for other in sorted(n for n in listed if _owner(n) is None):
            bucket.put_file(final / other, name, other)
        bucket.put_file(final / manifest.MANIFEST, name, manifest.MANIFEST)  # after every file it lists
        fence()  # the last moment a writer of a superseded attempt finds out, before it publishes
        bucket.put_bytes(b"", name, store.DONE)
        prune(bucket, keep)

    fence()
    _agree(ctrl, bucket, finish if rank == 0 else lambda: None)
    if rank != 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a node other than rank 0's: its share is in the bucket now
    if rank == 0:
        log.info("checkpoint %s published to %s", name, bucket.uri(name))


def _owner(name: str) -> int | None:
    m = _RANK_FILE.match(name)
    return None if m is None else int(m.group(1) or m.group(2))


def _clear_step(bucket: Bucket, name: str) -> None:
    """What the bucket holds under `name` (an unfinished upload, a damaged step), DONE first: never a mix."""
    bucket.delete(name, store.DONE)
    bucket.delete_tree(name)


def prune(bucket: Bucket, keep: int) -> None:
    """Keep the newest `keep` complete steps; remove older ones, and steps without DONE older than the newest."""
    done, seen = bucket.steps()
    newest = done[-1] if done else -1
    doomed = set(done[:-keep]) | {s for s in seen if s < newest and s not in done}
    for step in sorted(doomed):
        _clear_step(bucket, f"step-{step}")


# --- resume -------------------------------------------------------------------------------------------------------


def download_step(bucket: Bucket, root: Path, step: int) -> Path | str:
    """Step `step` of the bucket as `root`/step-N (module docstring): its path, or why it cannot be had whole. A local
    copy whose manifest is byte for byte the bucket's is kept."""
    name = f"step-{step}"
    try:
        got = bucket.get_bytes(manifest.MAX_BYTES, name, manifest.MANIFEST)
    except ValueError as err:
        return f"{manifest.MANIFEST}: {err}"
    if got is None:
        return f"{manifest.MANIFEST} is missing"
    data = got[0]
    try:
        listed = json_loads(data).get("files")
    except (ValueError, AttributeError):
        listed = None
    if not isinstance(listed, dict) or len(listed) > MAX_FILES or not all(
        isinstance(n, str) and plain_name(n) and n not in (manifest.MANIFEST, store.DONE) and isinstance(e, dict)
        and type(e.get("bytes")) is int and e["bytes"] >= 0 for n, e in listed.items()
    ):  # fmt: skip
        return f"{manifest.MANIFEST} is malformed (no valid 'files' table)"
    final = root / name
    local = final / manifest.MANIFEST
    if final.is_dir() and not final.is_symlink() and shared_dir.lstat_regular(local) and local.read_bytes() == data:
        return final
    storage.check_space(root, sum(e["bytes"] for e in listed.values()))
    tmp = shared_dir.make_temp_dir(root, f".tmp-{name}-fetch-")  # store.prune removes one a killed fetch left
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(_THREADS, len(listed)))) as pool:
            problems = list(pool.map(lambda item: bucket.download(item[1]["bytes"], tmp / item[0], name, item[0]),
                                     sorted(listed.items())))  # fmt: skip
        problem = next((p for p in problems if p), None)
        if problem:
            shutil.rmtree(tmp, ignore_errors=True)
            return problem
        shared_dir.write_atomic(tmp / manifest.MANIFEST, data)
        shared_dir.write_atomic(tmp / store.DONE, b"")
        if os.path.lexists(final):  # an older or damaged copy, or a name planted there
            shutil.rmtree(final) if final.is_dir() and not final.is_symlink() else final.unlink()
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def newest_intact(bucket: Bucket, root: Path) -> int | None:
    """Rank 0: the newest complete step of the bucket that verifies, downloaded into `root`; every other local step
    directory removed. None: the bucket has no complete step. DamagedCheckpoint when none verifies."""
    root.mkdir(parents=True, exist_ok=True)
    done, _ = bucket.steps()
    damaged: list[tuple[int, str]] = []
    chosen = None
    for step in reversed(done):
        got = download_step(bucket, root, step)
        problem = got if isinstance(got, str) else store.verify(got)
        if problem is None:
            chosen = step
            break
        damaged.append((step, problem))
        shutil.rmtree(root / f"step-{step}", ignore_errors=True)
    for p in root.iterdir():  # the bucket is the truth: a local step it does not hold was never published
        if store.is_step_dir(p) and p.name != f"step-{chosen}":
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink()
    for step, why in damaged:
        log.warning("checkpoint %s is damaged (%s): skipped%s", bucket.uri(f"step-{step}"), why,
                    f"; resuming from step-{chosen}" if chosen is not None else "")  # fmt: skip
    if chosen is None and damaged:
        listed = "; ".join(f"step-{s}: {why}" for s, why in damaged)
        raise store.DamagedCheckpoint(
            f"no intact checkpoint in {bucket} ({listed}). Restore the damaged steps, or start over from step 0 by "
            f"removing them ({bucket.store.cli} rm --recursive {bucket.uri('step-N')}/)"
        )
    return chosen


def fetch(bucket: Bucket, root: Path, *, rank: int, local_rank: int, local_world_size: int, ctrl: Control) -> None:
    """Collective, before store.resume_point(root): the bucket's newest intact step in the local run directory of every
    node (rank 0 chooses it; module docstring)."""
    answer = ""
    if rank == 0:
        try:
            chosen = newest_intact(bucket, root)
            answer = json.dumps({"step": chosen})
        except (store.DamagedCheckpoint, StorageError) as err:
            answer = json.dumps({"error": str(err), "kind": type(err).__name__})
        except OSError as err:
            answer = json.dumps({"error": f"reading {bucket}: {brief(err)}", "kind": "RemoteUnavailable"})
    agreed = json.loads(str(ctrl.all_gather_object(answer)[0]))  # rank 0's answer, on every rank
    if "error" in agreed:
        kind = {"DamagedCheckpoint": store.DamagedCheckpoint, "StorageError": StorageError}
        raise kind.get(agreed["kind"], RemoteUnavailable)(agreed["error"])
    step = agreed["step"]
    problem = None
    other_node = rank // max(local_world_size, 1) != 0
    if other_node and local_rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for p in root.iterdir():
                if store.is_step_dir(p) and p.name != f"step-{step}" and p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
            if step is not None:
                got = download_step(bucket, root, step)
                problem = got if isinstance(got, str) else store.verify(got)
        except OSError as err:
            problem = brief(err)
    if ctrl.any(problem is not None):
        raise store.DamagedCheckpoint(
            f"{bucket.uri(f'step-{step}')} changed while it was read (rank 0 verified it; another node found: "
            f"{problem or 'see its log'}): restart the job to resume from the newest intact step"
        )


def export_source(url: str, into: Path) -> Path:
    """For `jobspec export s3://bucket/prefix[/step-N]`: the newest intact step (or step N) downloaded into `into`.
    A malformed URL (a '..', user info, a control character) is a ConfigError that never shows the user part."""
    try:
        parsed = parse(url)
    except ValueError as err:
        raise ConfigError(f"jobspec export {redacted(url)}: {err}") from None
    if parsed is None:
        raise ConfigError(f"jobspec export {redacted(url)}: not an s3:// or gs:// location")
    last = parsed.key.rsplit("/", 1)[-1] if parsed and parsed.key else ""
    m = re.match(r"^step-(\d+)$", last)
    bucket = Bucket(parsed._replace(key=parsed.key.rsplit("/", 1)[0] if "/" in parsed.key else "") if m else parsed)
    bucket.check()
    if m is None:
        step = newest_intact(bucket, into)
        if step is None:
            raise ConfigError(f"{url}: no complete checkpoint (step-N/ with a {store.DONE} object) in it")
        return into / f"step-{step}"
    got = download_step(bucket, into, int(m.group(1)))
    problem = got if isinstance(got, str) else store.verify(got)
    if problem:
        raise ConfigError(f"{url}: damaged checkpoint ({problem}); export an intact one")
    return got  # type: ignore[return-value]


def upload_tree(bucket: Bucket, local: Path, name: str) -> None:
    """The regular files under `local` (an export) to `<prefix>/<name>/...`, what was there before removed."""
    bucket.delete_tree(name)
    for path in sorted(local.rglob("*")):
        if shared_dir.lstat_regular(path):
            bucket.put_file(path, name, *path.relative_to(local).parts)

