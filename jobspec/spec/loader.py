"""Load a spec file: YAML -> JobSpec, with every problem reported at once: the field errors and the
cross-field rules on whatever validated (jobspec.spec.partial), in one pass.

Each problem names the file, the line, the field path and a fix. Values that are or may be
credentials are never echoed back in messages (a mistyped secret must not end up in a CI log).
Reading is bounded (jobspec.spec.safe_yaml): size, nodes after alias expansion, depth, numbers.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from jobspec.errors import ConfigError, SpecError, SpecIssue
from jobspec.spec import safe_yaml
from jobspec.spec.credentials import credential_kind
from jobspec.spec.models import JobSpec, annotation_types
from jobspec.spec.partial import skipped_problems
from jobspec.spec.rules import CrossFieldError
from jobspec.spec.secrets import REF_HINT, SpecSecrets

Loc = tuple[str | int, ...]


def load_spec(path: str | Path, overrides: Sequence[str] = ()) -> JobSpec:
    """Read and validate a spec file; `overrides` are `key.path=value` strings (`--set`)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(safe_yaml.MAX_BYTES + 1)  # bounded: the path may be a pipe or /dev/zero
            size = max(len(raw), os.fstat(f.fileno()).st_size)
    except FileNotFoundError:
        hint = "give the path to a job spec YAML, e.g. examples/quickstart.yaml"
        raise ConfigError(f"{path}: no such file ({hint})") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the spec: {err.strerror or err}") from None
    try:
        safe_yaml.check_size(size)
        text = raw.decode("utf-8")
    except safe_yaml.YamlLimit as err:
        raise SpecError(str(path), [SpecIssue(err.path, err.message, err.line, err.hint)]) from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a spec is a YAML file") from None
    return parse_spec(text, str(path), overrides)


def parse_spec(text: str, file: str = "<spec>", overrides: Sequence[str] = ()) -> JobSpec:
    data, lines, issues = _read_yaml(text)
    written = copy.deepcopy(data) if overrides else data  # the file alone: tells --set's problems from the file's
    set_paths: dict[Loc, str] = {}
    for n, item in enumerate(overrides, 1):
        key, source = _override_source(item, n)
        try:
            loc = apply_override(data, item)
        except ValueError as err:
            issues.append(SpecIssue(path=key, message=str(err), source=source))
        else:
            set_paths[loc] = source
    for loc, problem in safe_yaml.out_of_range(data):
        hint = "quote it if it is text; otherwise use a value a setting can take"
        issues.append(SpecIssue(_dotted(loc), problem, lines.line(loc), hint, _source(loc, set_paths)))
    if issues:
        raise SpecError(file, _reported(issues, SpecSecrets(data)))
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        secrets = SpecSecrets(data)
        errors = _expand([*err.errors(), *skipped_problems(data)])  # cross-field rules beside the field errors
        issues = [_issue(e, lines, set_paths, secrets) for e in errors[: 10 * MAX_ISSUES]]
        if set_paths:
            issues = _blame_overrides(issues, written, lines, secrets, list(dict.fromkeys(set_paths.values())))
        raise SpecError(file, _reported(issues, secrets, more=len(errors) - len(issues))) from None


def _blame_overrides(
    issues: list[SpecIssue], written: Any, lines: _Lines, secrets: SpecSecrets, sources: list[str]
) -> list[SpecIssue]:
    """Point a problem that the file alone does not have at the --set items, not at the file's line.

    A --set can break a rule about another field (`--set hardware.gpus=H100:3` leaves the file's
    global_batch 32 indivisible) or a section's rule (`--set training.steps=10` beside `epochs`).
    """
    try:
        JobSpec.model_validate(written)
        before: set[tuple[str, str]] = set()
    except ValidationError as err:
        errors = _expand([*err.errors(), *skipped_problems(written)])
        before = {(i.path, i.message) for i in (_issue(e, lines, {}, secrets) for e in errors)}
    blamed = ", ".join(sources)
    return [
        dataclasses.replace(i, source=blamed) if i.source is None and (i.path, i.message) not in before else i
        for i in issues
    ]


MAX_ISSUES = 50  # a spec with more problems is not a spec; the first ones say what is wrong


def _reported(issues: list[SpecIssue], secrets: SpecSecrets, more: int = 0) -> list[SpecIssue]:
    """The issues by line, at most MAX_ISSUES of them, scrubbed of anything that may be a credential."""
    issues = sorted(issues, key=lambda i: (i.line is None, i.line or 0))
    first = {(i.path, i.message, i.source): i for i in reversed(issues)}  # hidden details can make two issues one
    unique = sorted(first.values(), key=lambda i: (i.line is None, i.line or 0))
    more += max(0, len(unique) - MAX_ISSUES)
    shown = list(dict.fromkeys(secrets.scrub(unique[:MAX_ISSUES])))
    if more:
        text = f"{more} more problem{'s' if more > 1 else ''} not shown (at most {MAX_ISSUES} are listed)"
        shown.append(SpecIssue("", text, None, "fix the ones above, then validate again"))
    return shown


_KEY_PATH = re.compile(r"^[A-Za-z0-9_.-]+$")


# The longest --set key path that is named in a message (its value is read as YAML, within safe_yaml's bounds).
MAX_KEY_PATH_CHARS = 1024


def _override_source(item: str, n: int) -> tuple[str, str]:
    """(path, source) naming a --set item without its value. Without '=', the whole item may be a
    token pasted in the wrong place: it is not echoed at all."""
    key, eq, _ = item[: MAX_KEY_PATH_CHARS + 1].partition("=")  # bounded before any pattern reads it
    key = key.strip()
    short = len(key) <= MAX_KEY_PATH_CHARS and all(len(part) <= safe_yaml.MAX_KEY_CHARS for part in key.split("."))
    if eq and short and _KEY_PATH.match(key) and not credential_kind(key):
        return key, f"--set {key}=..."  # never the value: it may be the secret the spec is about to refuse
    return "", f"--set #{n} (not shown)"


def apply_override(data: dict[str, Any], item: str) -> Loc:
    """Set `a.b.c=value` in `data` (value parsed as YAML: 64, true, [a, b]); returns the path."""
    key, eq, raw = item.partition("=")
    parts = [p for p in key.strip().split(".")]
    if not eq or not all(parts):
        raise ValueError("expected key.path=value, e.g. training.global_batch=64")
    if len(parts) > safe_yaml.MAX_DEPTH:
        raise ValueError(f"a key path of {len(parts)} parts; a spec nests at most {safe_yaml.MAX_DEPTH} deep")
    if (longest := max(map(len, parts))) > safe_yaml.MAX_KEY_CHARS:  # measured, never quoted
        raise ValueError(f"a key of {longest:,} characters in the key path: at most {safe_yaml.MAX_KEY_CHARS}")
    try:
        value = safe_yaml.load(raw)[0] if raw.strip() else ""
    except safe_yaml.YamlLimit as err:
        raise ValueError(f"the value: {err.message} ({err.hint})") from None
    except yaml.YAMLError:  # not YAML: the text as written, measured as the reader measures a scalar
        if len(raw) > safe_yaml.MAX_STRING_CHARS:
            raise ValueError(
                f"a value of {len(raw):,} characters: longer than any setting takes "
                f"(at most {safe_yaml.MAX_STRING_CHARS:,}); keep long content in a file the job reads"
            ) from None
        value = raw
    node: Any = data
    loc: list[str | int] = []
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        index = isinstance(node, list) and part.isascii() and part.isdigit() and len(part) < 10
        step: str | int = int(part) if index else part
        loc.append(step)
        if isinstance(node, list):
            if not isinstance(step, int) or step >= len(node):
                raise ValueError(f"{_dotted(loc)}: no list item {part}")
            if last:
                node[step] = value
            node = node[step]
        elif isinstance(node, dict):
            if last:
                node[step] = value
            else:
                node = node.setdefault(step, {})
        else:
            raise ValueError(f"{_dotted(loc[:-1])} is not a mapping")
    return tuple(loc)


def _dotted(loc: Sequence[str | int]) -> str:
    return ".".join(str(p) for p in loc)


def _source(loc: Loc, set_paths: dict[Loc, str]) -> str | None:
    return next((src for lc, src in set_paths.items() if loc[: len(lc)] == lc), None)


# --- YAML with line numbers -------------------------------------------------------------


class _Lines:
    """Maps a field path to the 1-based line where it is written."""

    def __init__(self, root: yaml.Node | None):
        self.root = root
        self._keys: dict[int, dict[Any, tuple[yaml.Node, yaml.Node]]] = {}  # id(mapping) -> key -> (key, value)

    def line(self, loc: Loc) -> int | None:
        node, best = self.root, None
        for step in loc:
            if isinstance(node, yaml.MappingNode):
                match = self._index(node).get(step)
                if match is None:
                    return best if best else (node.start_mark.line + 1)
                best, node = match[0].start_mark.line + 1, match[1]
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
                node = node.value[step]
                best = node.start_mark.line + 1
            else:
                break
        return best if best is not None else (node.start_mark.line + 1 if node is not None else None)

    def _index(self, node: yaml.MappingNode) -> dict[Any, tuple[yaml.Node, yaml.Node]]:
        # The last pair wins: after a merge (`<<: *base`) a key written here follows the merged one.
        if id(node) not in self._keys:
            self._keys[id(node)] = {k.value: (k, v) for k, v in node.value if isinstance(k.value, (str, int, float))}
        return self._keys[id(node)]


def _read_yaml(text: str) -> tuple[dict[str, Any], _Lines, list[SpecIssue]]:
    try:
        root = safe_yaml.compose(text)
        issues = [
            SpecIssue(path, "duplicate key: the later value would silently win", line, "remove one of the two")
            for path, line in _duplicates(root)
        ]  # before construction: a merge (`<<`) rewrites the mapping nodes it expands
        data = safe_yaml.construct(root)
    except safe_yaml.YamlLimit as err:
        return {}, _Lines(None), [SpecIssue(err.path, err.message, err.line, err.hint)]
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        if mark and (long_key := _long_plain_key(text, mark.line, problem)):
            return {}, _Lines(None), [SpecIssue("", long_key, mark.line + 1, "a key names a setting: a few words")]
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
    return data, _Lines(root), issues


def _long_plain_key(text: str, line: int, problem: str) -> str | None:
    """libyaml refuses a plain key of more than 1024 characters as "could not find expected ':'": say why."""
    if "expected ':'" not in problem:
        return None
    lines = text.split("\n", line + 1)  # the lines up to `line`, and the rest in one piece
    length = len(lines[line]) if line < len(lines) else 0
    if length <= 1024:
        return None
    return (
        f"a line of {length:,} characters where a key was expected: YAML reads a plain key of at most 1024 "
        f"characters (a spec's keys: at most {safe_yaml.MAX_KEY_CHARS})"
    )


_ROOT_HINT = "a spec starts with `name:`, `model:` and `training:`; see examples/quickstart.yaml"


def _duplicates(node: yaml.Node | None, prefix: str = "") -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []  # recursion is bounded: safe_yaml caps the depth
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            if isinstance(key.value, str) and key.value in seen:
                found.append((path, key.start_mark.line + 1))
            seen.add(key.value if isinstance(key.value, str) else id(key))
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
                loc = tuple(int(p) if p.isascii() and p.isdigit() else p for p in path.split("."))
                out.append({"loc": loc, "msg": message, "type": "cross_field", "hint": hint})
        else:
            out.append(e)
    return out


def _issue(e: dict[str, Any], lines: _Lines, set_paths: dict[Loc, str], secrets: SpecSecrets) -> SpecIssue:
    # Pydantic adds union-member names and validator tags to loc; keep only real keys.
    loc = _data_loc(tuple(e["loc"]))
    message, hint = _describe(e, loc)
    line, source = lines.line(loc), _source(loc, set_paths)
    if secrets.at(loc, e.get("input")):
        shown = secrets.shown(loc)
        if len(shown) < len(loc) and e["type"] == "extra_forbidden":  # the key may be the credential itself
            message = "unknown field (not shown: it may be a credential)"
        loc = shown
        if e["type"] not in _VALUE_FREE and not isinstance(e.get("input"), (dict, list)):
            # A validator's message may quote its value (scrub() replaces whole quotes; this, any part of one).
            message, hint = "invalid value (not shown: it may be a credential)", REF_HINT
    return SpecIssue(path=_dotted(loc), message=message, line=line, hint=hint, source=source)


# Pydantic's own messages never quote the input; a validator's ValueError or a cross-field rule may.
_VALUE_FREE = {
    "missing", "cross_field", "extra_forbidden", "string_type", "dict_type", "list_type", "model_type",
    "model_attributes_type", "literal_error", "int_type", "int_parsing", "float_type", "float_parsing", "bool_type",
    "bool_parsing", "string_too_short", "string_too_long", "greater_than", "greater_than_equal", "less_than",
    "less_than_equal", "finite_number", "int_from_float", "none_required", "too_short", "too_long",
    "secret_key",  # models._secret_key: a Secret key's shape, its value never quoted
}  # fmt: skip


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
        or step in {"int", "str", "float", "bool", "none", "SecretRef", "GpuRequest", "LoraSpec", "Architecture",
                    "ArchitectureConfig"}
        or step.endswith("Spec")
    )


def _model_fields(annotation: Any) -> dict[str, Any] | None:
    """Field name -> annotation of the model inside `annotation` (unwrapping Optional/Annotated)."""
    for candidate in annotation_types(annotation):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return {name: f.annotation for name, f in candidate.model_fields.items()}
    return None


def _describe(e: dict[str, Any], loc: Loc) -> tuple[str, str | None]:
    kind, msg = e["type"], e["msg"]
    ctx = e.get("ctx") or {}
    if kind == "cross_field":
        return msg, e.get("hint")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if getattr(ctx.get("error"), "hint", None):  # a validator's HintedValueError
        return msg, ctx["error"].hint
    if kind == "literal_error":
        if isinstance(e.get("input"), str) and e["input"].strip().lower() in _NOT_OFFERED:
            return msg, _NOT_OFFERED[e["input"].strip().lower()]
        choices = re.findall(r"'([^']*)'", str(ctx.get("expected", "")))
        close = suggest_value(e.get("input"), choices)
        if close:
            more = f" (or {', '.join(close[1:])})" if close[1:] else ""
            return msg, f"did you mean `{close[0]}`?{more}"
        return msg, None
    if kind in _RANGES and loc:  # every range error says the bound, on the field's own name
        return msg, _RANGES[kind].format(name=loc[-1], **ctx)
    if kind == "extra_forbidden":
        fields = _model_fields(_annotation_at(loc[:-1])) or {}
        close = _close(str(loc[-1]), list(fields), 1)
        hint = f"did you mean `{close[0]}`?" if close else f"known fields here: {', '.join(fields)}"
        return f"unknown field {loc[-1]!r}", hint
    if kind == "missing":
        return "required field is missing", "add it (see `jobspec schema` or docs/reference/spec.md)"
    if kind.endswith("_parsing") or kind.endswith("_type"):
        return msg, "check the value's type (quote strings that look like numbers)"
    return msg, None


_RANGES = {
    "greater_than_equal": "{name} must be at least {ge}",
    "greater_than": "{name} must be more than {gt}",
    "less_than_equal": "{name} must be at most {le}",
    "less_than": "{name} must be less than {lt}",
    "too_short": "{name} needs at least {min_length} item(s)",
    "too_long": "{name} takes at most {max_length} item(s)",
    "string_too_short": "{name} needs at least {min_length} character(s)",
    "string_too_long": "{name} takes at most {max_length} character(s)",
}
# Words people write for a value a setting spells differently (the seeds' tier names among them).
_SYNONYMS = {
    "nvidia": "cuda", "gpu": "cuda", "amd": "rocm", "hip": "rocm", "none": "cpu",
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32", "full": "fp32",
    "standard": "fast", "ddp": "fast", "deepspeed": "zero2", "stage2": "zero2", "stage2_offload": "zero2_offload",
    "offload": "zero2_offload", "stage3": "zero3", "fsdp": "zero3",
    "true": "on", "yes": "on", "enabled": "on", "false": "off", "no": "off", "disabled": "off",
    "flash": "sdpa", "flash_attention_2": "sdpa", "chat": "messages",
    # transformers' TrainingArguments.optim names (TRL's too)
    "adam": "adamw", "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw",
    "adamw_apex_fused": "adamw", "adamw_bnb_8bit": "adamw_8bit", "paged_adamw_8bit": "adamw_8bit",
    "adamw_torch_8bit": "adamw_8bit", "bnb_8bit": "adamw_8bit",
}  # fmt: skip
# Values other tools take that jobspec does not offer, with the reason and what to use instead
_NOT_OFFERED = {
    "adafactor": "Adafactor is not offered: torch's does not step FSDP2's sharded parameters; adamw_8bit keeps the "
                 "optimizer state in about 2 bytes a parameter (docs/concepts/tiers.md#optimizer)",
    "bnpo": "TRL's bnpo averages per micro-batch, which the planner chooses: use dapo (over the step's tokens)",
    "luspo": "sequence-level importance sampling is not offered: use dapo, grpo, dr_grpo, cispo or sapo",
    "vespo": "sequence-level importance sampling is not offered: use dapo, grpo, dr_grpo, cispo or sapo",
}  # fmt: skip


def suggest_value(value: Any, choices: Sequence[str]) -> list[str]:
    """Allowed values close to `value`, best first: same word in other case, a known synonym
    ('nvidia' -> cuda), values it begins ('gpt2' -> gpt2-small, ...), then difflib's nearest."""
    if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not choices or len(str(value)) > 64:
        return []  # a long text is no typo of a setting's word (and difflib's time grows with it)

    def norm(word: str) -> str:
        return word.strip().lower().replace("-", "_").replace(" ", "_")

    word, keys = norm(str(value)), {norm(c): c for c in choices}
    if word in keys:
        return [keys[word]]
    if _SYNONYMS.get(word) in keys:
        return [keys[_SYNONYMS[word]]]
    begun = [c for k, c in keys.items() if len(word) >= 2 and k.startswith(word)]
    return begun or [keys[k] for k in _close(word, list(keys), 2)]


def _close(word: str, choices: list[str], n: int) -> list[str]:
    import difflib  # only for a spec with problems: not on every start

    return difflib.get_close_matches(word, choices, n=n, cutoff=0.6)


def _annotation_at(loc: Loc) -> Any:
    model: Any = JobSpec
    for step in loc:
        fields = _model_fields(model)
        if fields is not None:
            if step not in fields:
                return None
            model = fields[step]
        else:  # list[X] or dict[str, X]: step is an index or key, descend into X
            items = [typing.get_args(a)[-1] for a in annotation_types(model) if typing.get_origin(a) in (list, dict)]
            if not items:
                return None
            model = items[0]
    return model
