"""Rendered objects as text for `kubectl apply -f -`: multi-document YAML or a `v1 List` in JSON."""

from __future__ import annotations

import json
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (the embedded spec) as `|` blocks, and never an
    `&anchor`/`*alias` for a dict that appears twice: manifests are read by people and by tools."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # The emitter falls back to a quoted scalar where a block cannot hold the text (trailing spaces).
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _represent_str)  # on the subclass only: yaml.SafeDumper is untouched


def to_yaml(objs: list[dict[str, Any]]) -> str:
    """One YAML document per object, `---` between them."""
    return "---\n".join(yaml.dump(obj, Dumper=_Dumper, sort_keys=False) for obj in objs)


def to_json(objs: list[dict[str, Any]]) -> str:
    """The objects as one `v1 List`."""
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}, indent=2) + "\n"
