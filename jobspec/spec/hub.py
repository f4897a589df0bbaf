"""Which of a spec's sources come from the Hugging Face hub: the model (`model.path`) and the data
(`data.path`, `data.sources[].path`, `data.eval_path`).

A hub id is `org/name` (or a bare legacy `name`), never a path that starts with '/', '.' or '~', and for
data never a name with a file suffix the data readers take. The renderer asks this without a filesystem
(the paths are the pod's), so a relative local directory spelled like an id counts as one: it costs a
cache volume that stays empty, never a wrong load. The runner asks the disk first (a local path wins, as in
transformers and datasets) and only then treats the text as an id.

At validate time every id is also checked against the hub's own rules (`hub_id_problems`: huggingface_hub's
`validate_repo_id`, where it is installed: `org/..` or `a--b` has the shape above but no hub serves it, and the pod
would fail with the retryable code), and the token is given once (`hub_token_problems`).
"""

from __future__ import annotations

import re
from typing import Any

TOKEN_ENV = "HF_TOKEN"  # what model.hub_token becomes in the pods (jobspec/render/hub.py)
LEGACY_TOKEN_ENV = "HUGGING_FACE_HUB_TOKEN"  # huggingface_hub still reads it, after HF_TOKEN

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # the data readers' own (runner/data/records.py)
DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".parquet")  # a file, never a dataset id


def is_hub_id(path: str | None, *, data: bool = False) -> bool:
    """`path` has the shape of a hub repository id (and, for data, no data file suffix)."""
    if not path or path.startswith(("/", ".", "~")) or not HUB_ID.fullmatch(path):
        return False
    return not (data and path.lower().endswith(DATA_SUFFIXES))


def hub_sources(spec: Any) -> list[tuple[str, str]]:  # a JobSpec: not imported, the spec's rules import this module
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


def hub_id_problems(spec: Any) -> list[tuple[str, str, str | None]]:
    """Every hub id of `spec` (`hub_sources`) that the hub's own rules refuse (huggingface_hub's validate_repo_id):
    (field, why, fix). Without huggingface_hub (a submitter installed without it) none: the runner, which has it,
    checks again at its preflight. The value is not echoed (a credential pasted there is reported elsewhere)."""
    sources = hub_sources(spec)
    if not sources:
        return []
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError:
        return []
    out: list[tuple[str, str, str | None]] = []
    for field, repo in sources:
        try:
            validate_repo_id(repo)
        except HFValidationError as err:
            reason = str(err).split(": '", 1)[0].rstrip(".")
            out.append((field, f"is not a Hugging Face repository id ({reason})",
                        "give a hub id `org/name`, or a local path starting with / or ./"))  # fmt: skip
    return out


def hub_token_problems(spec: Any) -> list[tuple[str, str, str | None]]:
    """`model.hub_token`, `env.HF_TOKEN` and `env.HUGGING_FACE_HUB_TOKEN` (the hub client's older name, read only when
    HF_TOKEN is unset) each give the pods a hub token: with two of them one would be dropped without a word."""
    given = [f"env.{name}" for name in (TOKEN_ENV, LEGACY_TOKEN_ENV) if name in spec.env]
    if spec.model.hub_token is not None:
        given.insert(0, "model.hub_token")
    if len(given) < 2:
        return []
    first, second = given[:2]
    return [(first, f"is given twice, here and as {second}: both give the pods a hub token ({TOKEN_ENV} wins in the "
             f"hub client), and one would be dropped", f"keep one: remove {second} or {first}")]  # fmt: skip
