"""Load a spec file: YAML -> JobSpec, with every problem reported at once.

Each problem names the file, the line, the field path and a fix. Values are never
echoed back in messages (a mistyped secret must not end up in a CI log).
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jobspec.errors import ConfigError, SpecError, SpecIssue
from jobspec.rules import CrossFieldError
from jobspec.spec import JobSpec

Loc = tuple[str | int, ...]


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read and validate a spec file; `overrides` are `key.path=value` strings (`--set`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        hint = "give the path to a job spec YAML, e.g. examples/quickstart.yaml"
        raise ConfigError(f"{path}: no such file ({hint})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the spec: {err}") from err
    return parse_spec(text, str(path), overrides)


def parse_spec(text: str, file: str = "<spec>", overrides: Sequence[str] = ()) -> JobSpec:
    data, lines, issues = _read_yaml(text)
    set_paths: dict[Loc, str] = {}
    for item in overrides:
        key = item.partition("=")[0].strip()
        source = f"--set {key}=..."  # never the value: it may be the secret the spec is about to refuse
        try:
            loc = apply_override(data, item)
        except ValueError as err:
            issues.append(SpecIssue(path=key, message=str(err), source=source))
        else:
            set_paths[loc] = source
    if issues:
        raise SpecError(file, issues)
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        issues = [_issue(e, lines, set_paths) for e in _expand(err.errors())]
        issues.sort(key=lambda i: (i.line is None, i.line or 0))
        raise SpecError(file, issues) from None


def apply_override(data: dict[str, Any], item: str) -> Loc:
    """Set `a.b.c=value` in `data` (value parsed as YAML: 64, true, [a, b]); returns the path."""
    key, eq, raw = item.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not eq or not all(parts):
        raise ValueError("expected key.path=value, e.g. training.global_batch=64")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node: Any = data
    loc: list[str | int] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        step: str | int = int(part) if isinstance(node, list) and part.isdigit() else part
        loc.append(step)
        if isinstance(node, list):
            if not isinstance(step, int) or step >= len(node):
                raise ValueError(f"{'.'.join(map(str, loc))}: no list item {part}")
            if last:
                node[step] = value
            node = node[step]
        elif isinstance(node, dict):
            if last:
                node[step] = value
            else:
                node = node.setdefault(step, {})
        else:
            raise ValueError(f"{'.'.join(map(str, loc[:-1]))} is not a mapping")
    return tuple(loc)


# --- YAML with line numbers -------------------------------------------------------------


class _Lines:
    """Maps a field path to the 1-based line where it is written."""

    def __init__(self, root: yaml.Node | None):
        self.root = root

    def line(self, loc: Loc) -> int | None:
        node, best = self.root, None
        for step in loc:
            if isinstance(node, yaml.MappingNode):
                for key, value in node.value:
                    if key.value == step:
                        best, node = key.start_mark.line + 1, value
                        break
                else:
                    return best if best else (node.start_mark.line + 1)
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
                node = node.value[step]
                best = node.start_mark.line + 1
            else:
                break
        return best if best is not None else (node.start_mark.line + 1 if node is not None else None)


def _read_yaml(text: str) -> tuple[dict[str, Any], _Lines, list[SpecIssue]]:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        issue = SpecIssue(
            path="",
            message=f"not valid YAML: {problem}",
            line=mark.line + 1 if mark else None,
            hint="check indentation and quoting near this line (tabs are not allowed in YAML)",
        )
        return {}, _Lines(None), [issue]
    if not isinstance(data, dict):
        got = "an empty file" if data is None else f"a {type(data).__name__}"
        return {}, _Lines(None), [SpecIssue("", f"expected a mapping of sections, got {got}", 1, _ROOT_HINT)]
    issues = [
        SpecIssue(path, "duplicate key: the later value would silently win", line, "remove one of the two")
        for path, line in _duplicates(root)
    ]
    return data, _Lines(root), issues


_ROOT_HINT = "a spec starts with `name:`, `model:` and `training:`; see examples/quickstart.yaml"


def _duplicates(node: yaml.Node | None, prefix: str = "") -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            if key.value in seen:
                found.append((path, key.start_mark.line + 1))
            seen.add(key.value)
            found += _duplicates(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found += _duplicates(item, f"{prefix}.{i}")
    return found


# --- pydantic errors -> issues ------------------------------------------------------------


def _expand(errors: list[Any]) -> list[dict[str, Any]]:
    """Cross-field problems arrive as one error at the root: split them by field."""
    out = []
    for e in errors:
        exc = (e.get("ctx") or {}).get("error")
        if isinstance(exc, CrossFieldError):
            for path, message, hint in exc.problems:
                loc = tuple(int(p) if p.isdigit() else p for p in path.split("."))
                out.append({"loc": loc, "msg": message, "type": "cross_field", "hint": hint})
        else:
            out.append(e)
    return out


def _issue(e: dict[str, Any], lines: _Lines, set_paths: dict[Loc, str]) -> SpecIssue:
    # Pydantic adds union-member names and validator tags to loc; keep only real keys.
    loc = _data_loc(tuple(e["loc"]))
    path = ".".join(str(p) for p in loc)
    message, hint = _describe(e, loc)
    source = next((src for lc, src in set_paths.items() if loc[: len(lc)] == lc), None)
    return SpecIssue(path=path, message=message, line=lines.line(loc), hint=hint, source=source)


def _data_loc(loc: Loc) -> Loc:
    out: list[str | int] = []
    model: Any = JobSpec
    for step in loc:
        fields = _model_fields(model)
        if fields is None:  # inside a dict, list or scalar: keep keys and indexes verbatim
            if isinstance(step, int) or not _is_internal_tag(step):
                out.append(step)
            continue
        if step in fields:
            out.append(step)
            model = fields[step]
        elif not _is_internal_tag(step):
            out.append(step)
            model = None
    return tuple(out)


def _is_internal_tag(step: Any) -> bool:
    return isinstance(step, str) and (
        step.startswith(("literal[", "function-", "constrained-", "lax-", "json-or-python"))
        or step in {"int", "str", "float", "bool", "none", "SecretRef", "GpuRequest", "LoraSpec", "Architecture"}
        or step.endswith("Spec")
    )


def _model_fields(annotation: Any) -> dict[str, Any] | None:
    """Field name -> annotation of the model inside `annotation` (unwrapping Optional/Annotated)."""
    for candidate in _flatten(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return {name: f.annotation for name, f in candidate.model_fields.items()}
    return None


def _flatten(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _flatten(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [a for arg in typing.get_args(annotation) for a in _flatten(arg)]
    return [annotation]


def _describe(e: dict[str, Any], loc: Loc) -> tuple[str, str | None]:
    kind, msg = e["type"], e["msg"]
    if kind == "cross_field":
        return msg, e.get("hint")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if kind == "extra_forbidden":
        fields = _model_fields(_annotation_at(loc[:-1])) or {}
        close = difflib.get_close_matches(str(loc[-1]), list(fields), n=1, cutoff=0.6)
        hint = f"did you mean `{close[0]}`?" if close else f"known fields here: {', '.join(fields)}"
        return f"unknown field {loc[-1]!r}", hint
    if kind == "missing":
        return "required field is missing", "add it (see `jobspec schema` or the README's spec reference)"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        return msg, "check the value's type (quote strings that look like numbers)"
    return msg, None


def _annotation_at(loc: Loc) -> Any:
    model: Any = JobSpec
    for step in loc:
        fields = _model_fields(model)
        if fields is not None:
            if step not in fields:
                return None
            model = fields[step]
        else:  # list[X] or dict[str, X]: step is an index or key, descend into X
            items = [typing.get_args(a)[-1] for a in _flatten(model) if typing.get_origin(a) in (list, dict)]
            if not items:
                return None
            model = items[0]
    return model
