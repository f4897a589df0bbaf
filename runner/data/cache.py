"""The tokenized data cached once per job: content-addressed, shared by every rank and every restart."""

from __future__ import annotations

from pathlib import Path

from jobspec.spec.models import JobSpec


def cache_root(spec: JobSpec) -> Path:
    """Where the job's tokenized data is cached: `data.cache_dir`, else `<checkpoints.dir>/data-cache` (the run
    directory's volume: kept across restarts, shared by the pods that share it)."""
    return Path(spec.data.cache_dir) if spec.data.cache_dir else Path(spec.checkpoints.dir) / "data-cache"
