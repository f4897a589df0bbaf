"""The spec reference in Markdown, generated from the models (`jobspec schema --markdown`).

The README carries this text between markers; a test keeps the two equal.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from jobspec.spec import JobSpec


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
    if name in {"shm_size"} and isinstance(value, int):
        return f"`{value // 1024**3}Gi`"
    return f"`{json.dumps(value)}`"


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
        doc = (model.__doc__ or "").strip().splitlines()
        if doc and model.__module__ == "jobspec.spec" and not doc[0].startswith("Usage docs"):
            out.append(doc[0] + "\n")
        out.append("| field | type | default | description |\n| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            desc = (field.description or "").replace("|", "\\|")
            out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(model, name)} | {desc} |")
        out.append("")
    return "\n".join(out)
