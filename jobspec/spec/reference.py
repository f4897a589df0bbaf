"""The spec's JSON Schema (`jobspec schema`) and its reference in Markdown (`--markdown`), from the models.

The schema ships as `jobspec/schema/jobspec.schema.json` (editors name it in
`# yaml-language-server: $schema=...`); docs/reference/spec.md carries the Markdown (tests/docs_gen.py).
Tests keep both equal to what the models generate.
"""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from jobspec.spec.models import JobSpec
from jobspec.spec.units import format_bytes

SCHEMA_FILE = Path(__file__).parents[1] / "schema" / "jobspec.schema.json"


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file, as `jobspec schema` prints it and SCHEMA_FILE holds it."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "jobspec job spec"
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2) + "\n"


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args if a is not type(None)) + (
            " \\| null" if type(None) in args else ""
        )
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _default(model: type[BaseModel], name: str) -> str:
    field = model.model_fields[name]
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see section"
    # The field's own serializer: a ByteSize default prints as "8Gi", as a user would write it.
    adapter = TypeAdapter(Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation)
    return f"`{json.dumps(adapter.dump_python(value, mode='json'))}`"


def _is_size(field: FieldInfo) -> bool:
    """A ByteSize field (pydantic reports it as plain int): its serializer is format_bytes."""
    inner = [a for a in typing.get_args(field.annotation) if typing.get_origin(a) is Annotated]
    metadata = [*field.metadata, *(m for a in inner for m in typing.get_args(a)[1:])]
    return any(getattr(m, "func", None) is format_bytes for m in metadata)


def _models(root: type[BaseModel]) -> list[type[BaseModel]]:
    seen: list[type[BaseModel]] = []

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and annotation not in seen:
            seen.append(annotation)
            for field in annotation.model_fields.values():
                visit(field.annotation)
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(root)
    return seen


def markdown() -> str:
    out = []
    for model in _models(JobSpec):
        out.append(f"#### {model.__name__}\n")
        doc = " ".join((model.__doc__ or "").strip().split("\n\n")[0].split())  # the first paragraph, one line
        if doc and model.__module__ == "jobspec.spec.models" and not doc.startswith("Usage docs"):
            out.append(doc + "\n")
        out.append("| field | type | default | description |\n| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            desc = (field.description or "").replace("|", "\\|")
            kind = "size, e.g. `16Gi`" if _is_size(field) else _type_name(field.annotation)
            out.append(f"| `{name}` | {kind} | {_default(model, name)} | {desc} |")
        out.append("")
    return "\n".join(out)
