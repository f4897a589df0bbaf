"""What an attacker who can write the checkpoint volume does to a checkpoint: real malicious pickles (each writes
a marker file when it runs), links, FIFOs, directories in place of files, and a manifest rewritten to match.

Shared by the checkpoint tests (verify, resume) and the export tests. Nothing here is faked: the pickles are the
ones pickle.load and torch.load(weights_only=False) would run.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import pickle
import shlex
import threading
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


class RunsShell:
    """Unpickles as os.system("touch MARKER")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


class RunsPython:
    """Unpickles as exec("open(MARKER, 'w')")."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",)


class CallsMethod:
    """Unpickles as pathlib.Path.touch(Path(MARKER)): a dotted global (Path.touch), protocol 4."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return Path.touch, (Path(self.marker),)


def evil_pickles(marker: Path) -> dict[str, bytes]:
    """Shapes of a pickle that runs code: each writes `marker` when unpickled without restriction."""
    return {
        "os.system": pickle.dumps(RunsShell(marker)),
        "exec": pickle.dumps(RunsPython(marker)),
        "Path.touch": pickle.dumps(CallsMethod(marker), protocol=4),
        "protocol-0": pickle.dumps(RunsShell(marker), protocol=0),
    }


def evil_torch_file(marker: Path, value: Any = 1.0) -> bytes:
    """A torch.save zip of `value` whose data.pkl is replaced by a pickle that runs os.system: what a forged RNG
    file or optimizer byte item looks like to torch.load."""
    buf = io.BytesIO()
    torch.save(value, buf)
    source, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in source.infolist():
            evil = info.filename.endswith("/data.pkl")
            z.writestr(info, pickle.dumps(RunsShell(marker), protocol=2) if evil else source.read(info))
    return out.getvalue()


def deflated(torch_file: bytes) -> bytes:
    """The same torch.save zip with its entries deflated: torch.load reads it, inflating each entry in memory."""
    source, out = zipfile.ZipFile(io.BytesIO(torch_file)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info in source.infolist():
            z.writestr(info.filename, source.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def rewrite_manifest(ckpt: Path) -> None:
    """Make manifest.json match the directory as it is now (what a forger who can write the volume does):
    regular files by their bytes, anything else as an empty file."""
    path = ckpt / "manifest.json"
    record = json.loads(path.read_text())
    for name in record["files"]:
        p = ckpt / name
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        record["files"][name] = {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    path.write_text(json.dumps(record))


def dcp_metadata(ckpt: Path) -> Any:
    """The checkpoint's DCP metadata, read by the test with plain pickle (the test trusts its own files)."""
    return pickle.loads((ckpt / ".metadata").read_bytes())


def write_metadata(ckpt: Path, metadata: Any) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def forge_bytes_item(ckpt: Path, marker: Path, fqn: str = "optim.param_groups.0.lr") -> None:
    """Legitimate metadata whose byte item `fqn` points at an evil torch.save pickle appended to the shard: DCP's
    DefaultLoadPlanner reads byte items with torch.load(weights_only=False)."""
    shard = ckpt / "__0_0.distcp"
    evil, offset = evil_torch_file(marker), shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(evil)
    metadata = dcp_metadata(ckpt)
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            info.offset, info.length = offset, len(evil)
    write_metadata(ckpt, metadata)


def replace(path: Path, kind: str, target: Path | None = None) -> None:
    """Put a `kind` in place of the file `path`: "devzero" (a link to /dev/zero), "fifo", "dir", or "link-out" (a link
    to `target`, a copy elsewhere)."""
    if kind == "link-out":
        assert target is not None
        target.write_bytes(path.read_bytes())
    path.unlink()
    if kind == "devzero":
        path.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        path.mkdir()
    elif kind == "link-out":
        path.symlink_to(target)  # type: ignore[arg-type]
    else:
        raise ValueError(kind)


def within(seconds: float, fn: Callable[[], T], what: str) -> T:
    """fn() in a daemon thread, failing the test if it has not returned after `seconds` (a hang fails, never
    blocks the suite: the stuck thread is left behind)."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(("ok", fn()))
        except BaseException as err:
            result.append(("err", err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{what} did not return within {seconds:g} s (a hang)")
    kind, value = result[0]
    if kind == "err":
        raise value
    return value


def unblock_fifos(root: Path) -> None:
    """Open every FIFO under `root` for writing (non-blocking where a reader waits), so no stuck reader stays."""
    for p in root.rglob("*"):
        if p.is_fifo():
            with contextlib.suppress(OSError):  # no reader waiting: nothing to unblock
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
