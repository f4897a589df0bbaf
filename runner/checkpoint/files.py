"""Only regular files, bounded reads: how the runner opens what a checkpoint directory holds.

A checkpoint volume is shared: another job, a colleague or an attacker who can write it may have replaced
a name in a step directory by a symbolic link (to /dev/zero, or out of the directory), a FIFO, a device or
a directory. Reading /dev/zero or a FIFO without a writer never ends; a link out reads what is not the
checkpoint. So every read of a checkpoint file goes through `open_regular`: it opens without following a
link in the last component (O_NOFOLLOW) and without waiting for a FIFO's writer (O_NONBLOCK), then asks
the open file itself (fstat, no race with a rename) whether it is a regular file: jobspec.shared_dir.open_fd, the
project's one way to open a file in a shared directory. `read_bytes` also refuses a file larger than its bound
before reading a byte, and reads at most the size fstat gave.

`UnsafeFile` is an OSError, so callers that already treat an unreadable file as damage keep doing so;
its message names the file and what it is instead.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from jobspec.shared_dir import Unsafe, kind, open_fd
from jobspec.untrusted import json_loads

_CHUNK = 64 * 2**20


class UnsafeFile(Unsafe):
    """A checkpoint file that is not a regular file of its own, or is larger than a reader may take."""


def _not_regular(path: Path, mode: int) -> UnsafeFile:
    return UnsafeFile(path, f"is {kind(mode)}, not a regular file (a checkpoint holds regular files only)")


def plain_name(name: str) -> bool:
    """Whether `name` names an entry of the directory itself: no separator, no '..', no NUL."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name and "\\" not in name


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file (not reached through a link); UnsafeFile otherwise."""
    path = Path(path)
    try:
        return os.fdopen(open_fd(path, os.O_RDONLY), "rb", buffering=0)
    except Unsafe as err:
        raise UnsafeFile(path, f"{err.detail} (a checkpoint holds regular files only)") from None


def size_of(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


def read_bytes(path: str | Path, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them: UnsafeFile for anything else or more."""
    path = Path(path)
    with open_regular(path) as f:
        size = size_of(f)
        if size > limit:
            raise UnsafeFile(path, f"has {size:,} bytes, more than a {what} may have ({limit:,})")
        return read_at_most(f, size)


def read_at_most(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes from `f` (fewer at its end): one read() may return less than asked."""
    parts, left = [], n
    while left > 0:
        part = f.read(min(left, _CHUNK))
        if not part:
            break
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def read_json(path: str | Path, limit: int, what: str = "JSON file") -> Any:
    """The JSON document in `path` (bounded as `read_bytes`); ValueError when it does not parse."""
    data = read_bytes(path, limit, what)
    return json_loads(data)  # ValueError when nested deeper than any file of ours


def read_or_problem(name: str, read: Callable[[], Any]) -> tuple[Any, str | None]:
    """(`read()`, None), or (None, why) naming the file `name` it reads: missing, not a regular file of its own, or
    unreadable (OSError, or ValueError: it does not parse)."""
    try:
        return read(), None
    except FileNotFoundError:
        return None, f"{name} is missing"
    except UnsafeFile as err:
        return None, str(err)
    except (OSError, ValueError) as err:
        return None, f"{name} is unreadable ({err})"


def regular_sizes(directory: Path) -> dict[str, int]:
    """Name -> size of the regular files directly in `directory` (links, FIFOs, devices left out)."""
    sizes = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                sizes[entry.name] = st.st_size
    return sizes


def problem(path: Path) -> str | None:
    """Why `path` is not a regular file of its directory ("X is missing", "X is a FIFO ..."), or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return f"{path.name} is missing"
    except OSError as err:
        return f"{path.name} cannot be read ({err.strerror or err})"
    return None if stat.S_ISREG(mode) else str(_not_regular(path, mode))


def is_regular(path: Path) -> bool:
    """Whether `path` is a regular file itself (a link to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
