"""Which of a spec's sources come from the Hugging Face hub: the model (`model.path`) and the data
(`data.path`, `data.sources[].path`, `data.eval_path`).

A hub id is `org/name` (or a bare legacy `name`), never a path that starts with '/', '.' or '~', and for
data never a name with a file suffix the data readers take. The renderer asks this without a filesystem
(the paths are the pod's), so a relative local directory spelled like an id counts as one: it costs a
cache volume that stays empty, never a wrong load. The runner asks the disk first (a local path wins, as in
transformers and datasets) and only then treats the text as an id.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobspec.spec.models import JobSpec

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # the data readers' own (runner/data/records.py)
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")  # a file, never a dataset id


def is_hub_id(path: str | None, *, data: bool = False) -> bool:
    """`path` has the shape of a hub repository id (and, for data, no data file suffix)."""
    if not path or path.startswith(("/", ".", "~")) or not HUB_ID.fullmatch(path):
        return False
    return not (data and path.lower().endswith(DATA_SUFFIXES))


def hub_sources(spec: JobSpec) -> list[tuple[str, str]]:
    """(field, id) of every source of `spec` that has the shape of a hub id, the model first."""
    data = spec.data
    found = [("model.path", spec.model.path)] if is_hub_id(spec.model.path) else []
    paths = [("data.path", data.path), ("data.eval_path", data.eval_path)]
    paths += [(f"data.sources[{i}].path", source.path) for i, source in enumerate(data.sources or [])]
    return found + [(field, path) for field, path in paths if path and is_hub_id(path, data=True)]


SNAPSHOT = re.compile(
    r"(?:^|/)hub/models--(?P<org>[\w.-]+?)(?:--(?P<name>[\w.-]+))?/snapshots/(?P<commit>[0-9a-f]{40})/?$"
)


def hub_origin(path: str | None) -> tuple[str, str] | None:
    """(repo id, commit) of a snapshot directory in a Hugging Face cache (`<HF_HOME>/hub/models--org--name/
    snapshots/<commit>`, where the supervisor puts a hub model for its workers), None for any other path. The hub
    forbids '--' in repo ids, so the directory name maps back to one id."""
    found = SNAPSHOT.search(path or "")
    if found is None:
        return None
    repo = found["org"] if found["name"] is None else f"{found['org']}/{found['name']}"
    return repo, found["commit"]
