"""The run directory's own files kept beside the steps in an object store (`checkpoints.dir: s3://...` or `gs://`).

With a bucket the run directory is the pod's local disk (`checkpoints.local_dir`), gone with the pod. Two of its
files must outlive it:

    tier_state.json   the OOM ladder (runner/oom/ladder.py): the tiers that ran out of memory, micro-batch caps
    metrics.jsonl     every logged record of the run (runner/output/metrics.py)

Global rank 0 puts both under the checkpoints prefix (`<prefix>/tier_state.json`, `<prefix>/metrics.jsonl`) after each
published step and before it exits to be relaunched at the next tier (75); the supervisor of a pod whose run
directory lacks them (another node of the gang, a pod the Job created again) gets them back before anything reads
them. Without them a gang restarted on new pods tried again the tier that had run out of memory, each attempt
counted against the Job's backoffLimit, and its metrics started over. A local file is never replaced: a supervisor
that relaunches its own workers keeps the newer one it has.

What comes back was written by anyone who can write the bucket: read no further than its bound, written into the
run directory without following a link (shared_dir), then parsed by its own reader, which refuses a damaged one
(ladder.load_state: a ConfigError naming the file; the report: record by record). Putting or getting one is best
effort: a store that fails is logged, and the run goes on as it would have without the file. Torch-free, for the
supervisor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from jobspec import shared_dir
from jobspec.contract import METRICS_FILE, TIER_STATE_FILE
from jobspec.spec.object_store import parse
from runner.checkpoint import stores

log = logging.getLogger("jobspec.runner")
LIMITS = {TIER_STATE_FILE: 1 << 20, METRICS_FILE: 256 << 20}  # a few failures; ~800k records of ~300 bytes


def put(checkpoints_dir: str, root: Path, names: Iterable[str] = tuple(LIMITS)) -> None:
    """Each of `names` the local run directory `root` holds, into the bucket (global rank 0)."""
    url = parse(checkpoints_dir)
    if url is None:
        return
    try:
        store = stores.open_store(url.scheme, f"checkpoints.dir {url}")
        for name in names:
            path = root / name
            if not path.is_file() or path.is_symlink():
                continue
            data = path.read_bytes()
            if len(data) > LIMITS[name]:
                log.warning("%s: %d bytes, over the %d kept in %s; not uploaded", path, len(data), LIMITS[name], url)
                continue
            store.put(url.bucket, _key(url.key, name), data)
    except Exception as err:  # best effort: the checkpoint itself is published; the next put tries again
        log.warning("could not keep the run's %s in %s (%s)", ", ".join(names), url, stores.brief(err))


def get(checkpoints_dir: str, root: Path) -> list[str]:
    """The files the bucket keeps that the local run directory `root` lacks, copied into it (the supervisor, before
    the OOM ladder reads its state); the names copied."""
    url = parse(checkpoints_dir)
    if url is None:
        return []
    got: list[str] = []
    try:
        store = stores.open_store(url.scheme, f"checkpoints.dir {url}")
        for name, limit in LIMITS.items():
            path = root / name
            if path.exists() or path.is_symlink():
                continue
            try:
                found = store.get(url.bucket, _key(url.key, name), limit)
            except ValueError as err:  # over its bound: not this run's file as jobspec writes it
                log.warning("%s/%s not restored: %s", url, name, err)
                continue
            if found is not None:
                root.mkdir(parents=True, exist_ok=True)
                shared_dir.write_atomic(path, found[0])
                got.append(name)
    except Exception as err:  # best effort: without them the run starts as a first attempt would
        log.warning("could not read the run's files from %s (%s); going on without them", url, stores.brief(err))
    if got:
        log.info("restored %s from %s (this pod's run directory had none)", ", ".join(got), url)
    return got


def _key(prefix: str, name: str) -> str:
    return f"{prefix}/{name}" if prefix else name
