"""Every field of the spec, found by walking the models, and a spec with a chosen value in one of them.

The hostile tests put a long text or a credential in each: a field added to the models later is
tested without anyone listing it.
"""

from __future__ import annotations

import copy
import typing
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from jobspec.spec.models import JobSpec, annotation_types

Loc = tuple[str | int, ...]
Kind = Literal["str", "key", "other"]  # a text, a mapping's key, any other value (numbers, choices, sizes)
MAP_KEY = "X"  # the key used inside maps (env.X, scheduling.labels.X)

BASE: dict[str, Any] = {
    "name": "demo",
    "model": {"preset": "tiny"},
    "training": {"global_batch": 8, "steps": 10},
    "hardware": {"vendor": "cpu"},
}


def leaves(model: type[BaseModel] = JobSpec, prefix: Loc = ()) -> list[tuple[Loc, Kind]]:
    """(path, kind) of every leaf field under `model`: texts, map keys and every other value."""
    found: dict[Loc, Kind] = {}
    for name, field in model.model_fields.items():
        loc = (*prefix, name)
        for kind in annotation_types(field.annotation):
            origin = typing.get_origin(kind)
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found.update(leaves(kind, loc))
            elif origin is list:
                found.update(_items(typing.get_args(kind)[0], (*loc, 0)))
            elif origin is dict:
                found[loc] = "key"
                found.update(_items(typing.get_args(kind)[1], (*loc, MAP_KEY)))
            elif kind is not type(None):
                found.setdefault(loc, "str" if kind is str else "other")
    return list(found.items())


def _items(annotation: Any, loc: Loc) -> dict[Loc, Kind]:
    found: dict[Loc, Kind] = {}
    for kind in annotation_types(annotation):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found.update(leaves(kind, loc))
        elif kind is not type(None):
            found.setdefault(loc, "str" if kind is str else "other")
    return found


def dotted(loc: Loc) -> str:
    return ".".join(map(str, loc))


def spec_with(loc: Loc, value: Any, kind: Kind = "str") -> dict[str, Any]:
    """BASE with `value` at `loc` (as the key of a one-item map at `loc` when `kind` is "key")."""
    data = copy.deepcopy(BASE)
    if loc[:2] == ("model", "path"):
        data["model"]["preset"] = None
    node: Any = data
    for step, after in zip(loc, (*loc[1:], None), strict=True):
        last = after is None
        leaf = {value: "v"} if kind == "key" else value
        if isinstance(node, list):
            node.append(leaf if last else ([] if isinstance(after, int) else {}))
            node = node[-1]
        elif last:
            node[step] = leaf
        else:
            if not isinstance(node.get(step), (dict, list)):
                node[step] = [] if isinstance(after, int) else {}
            node = node[step]
    return data


def to_yaml(data: dict[str, Any]) -> str:
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(data, Dumper=dumper, width=2**31 - 1, allow_unicode=True)
