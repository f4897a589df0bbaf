"""Rendered objects as text for `kubectl apply -f -`: multi-document YAML or a `v1 List` in JSON."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # The emitter falls back to a quoted scalar where a block cannot hold the text (trailing spaces).
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


def _dumper(base: type) -> type:
    """`base` writing multi-line strings (the embedded spec) as `|` blocks, and never an `&anchor`/`*alias`
    for a dict that appears twice: manifests are read by people and by tools."""

    class Dumper(base):  # type: ignore[misc,valid-type]  # SafeDumper or libyaml's CSafeDumper
        def ignore_aliases(self, data: Any) -> bool:
            return True

    Dumper.add_representer(str, _represent_str)  # on the subclass only: `base` is untouched
    return Dumper


_Dumper = _dumper(yaml.SafeDumper)
# libyaml's emitter (PyYAML's C extension) writes the same objects in a fifth of the CPU time (~10 ms
# less per `jobspec render`), but not always the same text: it wraps long double-quoted strings at
# other places, writes an empty key as `''` where PyYAML writes `? ''`, and closes a document that
# ends in a `|+` block with `...`. So it writes only objects whose every string is one printable-ASCII
# line, or lines ending in one newline (the embedded spec), without spaces at either end: those come
# out plain, single-quoted or as a `|` block, where the two emitters agree byte for byte.
_CDumper = _dumper(yaml.CSafeDumper) if hasattr(yaml, "CSafeDumper") else None

_LINE = r"[!-~](?:[ -~]*[!-~])?"  # printable ASCII, no space at either end
_SAME_IN_BOTH = re.compile(rf"{_LINE}|{_LINE}(?:\n(?:[ -~]*[!-~])?)*(?<=[!-~])\n")


def _same_in_both(obj: Any) -> bool:
    """Whether every string (key or value) in `obj` is one that both emitters write alike."""
    todo = [obj]
    while todo:
        value = todo.pop()
        if isinstance(value, dict):
            todo += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            todo += value
        elif isinstance(value, str) and not _SAME_IN_BOTH.fullmatch(value):
            return False
    return True


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """One YAML document per object, `---` between them."""
    dumper = _CDumper if _CDumper is not None and _same_in_both(objs) else _Dumper
    return "---\n".join(yaml.dump(obj, Dumper=dumper, sort_keys=False) for obj in objs)


def to_json(objs: list[dict[str, Any]]) -> str:
    """The objects as one `v1 List`."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2) + "\n"
