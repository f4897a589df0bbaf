"""DCP's checkpoint metadata: the private globals its `.metadata` pickle names."""

from __future__ import annotations

from typing import Any

import torch

from runner.internals.versions import missing


def dcp_private_globals() -> dict[tuple[str, str], Any]:
    """The private globals a DCP `.metadata` pickle names, (module, name) -> what runner/checkpoint/unpickle.py's
    restricted unpickler gives for each (torch 2.13): FileSystemWriter's per-item record `filesystem._StorageInfo`
    (a dataclass: built without running code), the memory-format enum `metadata._MEM_FORMAT_ENCODING` (looked up
    by value only: `Enum(value, names)` would make a new enum), and `torch.serialization._get_layout`, which
    torch's pickle of a layout calls with its name (answered by a lookup among torch's layouts, never called).
    DCP offers no public reader of its metadata other than FileSystemReader's pickle.load, which runs any
    callable the file names. Required to resume or export a checkpoint."""
    from torch.distributed.checkpoint import metadata

    storage_info = dcp_storage_info()
    mem_format = getattr(metadata, "_MEM_FORMAT_ENCODING", None)
    if mem_format is None:
        raise missing("torch", "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING", _DCP_NEED)

    def mem_format_of(value: int) -> Any:
        return mem_format(value)

    mem_format_of.members = dict(mem_format.__members__)  # type: ignore[attr-defined]  # getattr(enum, NAME) form
    return {
        (storage_info.__module__, storage_info.__qualname__): storage_info,
        (mem_format.__module__, mem_format.__qualname__): mem_format_of,
        ("torch.serialization", "_get_layout"): _layout_named,
    }


def dcp_storage_info() -> type:
    """DCP FileSystemWriter's per-item record (`filesystem._StorageInfo`: file name, offset, length), which the
    metadata check reads field by field."""
    from torch.distributed.checkpoint import filesystem

    found = getattr(filesystem, "_StorageInfo", None)
    if not isinstance(found, type):
        raise missing("torch", "torch.distributed.checkpoint.filesystem._StorageInfo", _DCP_NEED)
    return found


_DCP_NEED = "reading a checkpoint's .metadata without running code from it"


def _layout_named(name: str) -> torch.layout:
    """What torch.serialization._get_layout(name) returns, without calling it: the layout whose str() is `name`."""
    for value in vars(torch).values():
        if isinstance(value, torch.layout) and str(value) == name:
            return value
    raise ValueError(f"no torch layout is named {str(name)[:40]!r}")
